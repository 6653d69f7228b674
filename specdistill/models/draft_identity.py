"""Which draft a file belongs to: a fingerprint of the draft's weights, recorded beside an acceptance head.

An acceptance head reads one draft's hidden states; paired with another draft it predicts garbage without any error.
The fingerprint hashes every tensor of the draft's state dict rounded to bfloat16, so that the same export loaded in
float32 or in bfloat16 (presets load frozen drafts in bf16) has one fingerprint, while any trained change shows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def draft_fingerprint(model: nn.Module) -> str:
    """sha256 (hex) of the draft's state dict: names, shapes and bfloat16-rounded values, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def describe_draft(model: nn.Module, source: str | None = None) -> dict[str, Any]:
    """What an acceptance head records about its draft: fingerprint, architecture, widths, where it was loaded from."""
    config = model.config
    return {
        "fingerprint": draft_fingerprint(model),
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "source": source,
    }
