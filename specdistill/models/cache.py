"""KV-cache helpers that work with both transformers 4.x (`past_key_values`) and 5.x (`cache`)."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from transformers.cache_utils import Cache


@cache
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache: Cache | None, **kwargs: Any):
    """Run `model` on `input_ids` continuing `cache`; returns `(output, cache)`.

    `input_ids: (B, T)`; `cache` is None for the first call. The returned cache holds the new positions too.
    """
    name = _cache_kwarg(type(model))
    out = model(input_ids=input_ids, use_cache=True, **{name: cache}, **kwargs)
    new_cache = out.get("cache", None) if hasattr(out, "get") else None
    if new_cache is None:
        new_cache = out.past_key_values
    return out, new_cache


@cache
def _crop_takes_removal(cache_cls: type) -> bool:
    return "tokens_to_remove" in inspect.signature(cache_cls.crop).parameters


def crop_cache(cache: Cache, keep_length: int) -> None:
    """Crop `cache` in place so it keeps the first `keep_length` positions."""
    current = cache.get_seq_length()
    if keep_length >= current:
        return
    if _crop_takes_removal(type(cache)):
        cache.crop(-(current - keep_length))
    else:
        cache.crop(keep_length)
