"""Forward helpers shared by the engine (target) and the draft-LM proposer: one causal-LM step on a rollable cache."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from specdistill.models.cache import forward_with_cache, takes_logits_to_keep


def forward_keep_last(
    model: torch.nn.Module, ids: torch.Tensor, cache: Cache | None, keep: int, hidden: bool = False
):
    """Forward `ids: (1, T)` continuing `cache`; only the last `keep` positions' logits are computed if supported.

    Returns `(output, cache)` as `forward_with_cache`; `hidden` adds `output.hidden_states` (embeddings first, one
    `(1, T, H)` entry per layer after it).
    """
    kwargs = {}
    if takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = keep
    if hidden:
        kwargs["output_hidden_states"] = True
    return forward_with_cache(model, ids, cache, **kwargs)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter (where its inputs go)."""
    return next(model.parameters()).device
