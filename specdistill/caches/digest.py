"""What a cache depends on, as digests: every weight of a model, and JSON-able settings.

`weights_digest(model)` hashes the model's parameters and buffers themselves, not its path or config: a model
retrained into the same directory gets a new digest, so a cache keyed by it is recomputed instead of silently reused.

Cost: one pass over the weights, copied to the host tensor by tensor and fed to sha256 (about 1 GB/s on one core):
well under a second for the test models (5M parameters, 20 MB), about 15-30 s for a 7B model in bf16 (14 GB), and
proportionally more for larger ones. It runs once per model per fit start, before the model is placed (a `Frozen`
holder remembers it, so a target shared by two caches is hashed once). Hashing the safetensors files a model was
loaded from would cost the same read, but would miss a model changed in memory and needs the file to exist; hashing
the tensors covers both, so specdistill does that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer of `model`: name, dtype, shape and bytes, in name order.

    Args:
        model: any `nn.Module`, on any device, with its weights whole (not ZeRO-3 partitioned).

    Returns:
        64 hex digits; equal for two models exactly when their named tensors are equal to the bit (tied weights are
        hashed under each name).

    Raises:
        ValueError: the weights are partitioned by DeepSpeed ZeRO-3 (each rank holds a slice): take the digest
            before the model is placed (`Frozen.weights_digest()` ahead of `Frozen.place`).
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    digest = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name]
        if hasattr(tensor, "ds_id"):  # a ZeRO-3 parameter: this rank holds a slice, not the weight
            raise ValueError(
                f"{name} of this {type(model).__name__} is partitioned by DeepSpeed ZeRO-3, so its bytes are not "
                "on this rank: take weights_digest(model) before the model is placed (Frozen.weights_digest() "
                "before Frozen.place)"
            )
        header = f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0"
        digest.update(header.encode())
        # viewed as bytes, so every dtype (bf16 has no numpy type) hashes its exact bit pattern
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(memoryview(data.numpy()))
    return digest.hexdigest()


def json_digest(obj: Any) -> str:
    """sha256 of `obj` as canonical JSON (sorted keys): a digest of settings."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
