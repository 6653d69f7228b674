"""KV caches that speculative decoding can roll back, for every attention layout transformers uses.

Speculative decoding appends candidates to a cache and, after a rejection, removes them again. A full-attention
layer keeps every position, so removing the newest ones is a slice. A sliding-window layer (Mistral, Qwen2 with
`use_sliding_window`, every other layer of Gemma-2) keeps only the last `window - 1` positions, so once the sequence
is longer than the window the positions a rollback must restore have already been dropped. The caches built here
keep them:

- `dynamic` (the default): transformers' `DynamicCache` for the model's config (full, sliding or hybrid layers),
  with *past recording* on from the first forward: a sliding layer keeps what arrived since the previous
  `crop_cache` and drops it, or trims back to its window, at the next one. `crop_cache` must therefore run after
  every verification (the engine does) and never go below the length of the previous crop.
- `static`: preallocated tensors of `max_length` positions (what `torch.compile` needs). Every layer, sliding ones
  too, holds the whole sequence: a static sliding layer is a ring buffer that cannot give back an overwritten
  position, while a full-length layer under the model's sliding-window mask computes the same attention. Costs the
  memory of full attention on the sliding layers.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
import transformers
from transformers.cache_utils import Cache, DynamicCache, StaticCache, StaticLayer

CACHE_IMPLEMENTATIONS = ("dynamic", "static")


@cache
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@cache
def takes_logits_to_keep(model_cls: type) -> bool:
    """Whether `model_cls.forward` can compute the logits of the last positions only (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def forward_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache: Cache | None, **kwargs: Any):
    """Run `model` on `input_ids` continuing `cache`; returns `(output, cache)`.

    `input_ids: (B, T)`; `cache` is None for a model-made cache. The returned cache holds the new positions too.
    """
    name = _cache_kwarg(type(model))
    out = model(input_ids=input_ids, use_cache=True, **{name: cache}, **kwargs)
    new_cache = out.get("cache", None) if hasattr(out, "get") else None
    if new_cache is None:
        new_cache = out.past_key_values
    return out, new_cache


def new_cache(
    model: torch.nn.Module, implementation: str = "dynamic", max_length: int | None = None
) -> Cache:
    """An empty cache for `model` that `crop_cache` can roll back (see the module docstring).

    Args:
        model: a Hugging Face causal LM (or its base model).
        implementation: `"dynamic"` or `"static"`.
        max_length: most positions the cache will hold (prompt + output + candidates); required for `"static"`.
    """
    config = model.config.get_text_config(decoder=True)
    if implementation == "dynamic":
        cache = DynamicCache(config=config)
        cache.activate_past_recording()
        return cache
    if implementation == "static":
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"a static cache needs max_length, a positive int, got {max_length!r}")
        if not StaticLayer.is_croppable:
            raise ValueError(
                f"transformers {transformers.__version__} cannot roll back static caches (from 5.24 it can): "
                "use the dynamic cache or upgrade transformers."
            )
        cache = StaticCache(config=config, max_cache_len=max_length)
        cache.layers = [
            StaticLayer(max_cache_len=max_length) if getattr(layer, "is_sliding", False) else layer
            for layer in cache.layers
        ]
        return cache
    raise ValueError(f"cache implementation must be one of {CACHE_IMPLEMENTATIONS}, got {implementation!r}")


def cache_length(cache: Cache) -> int:
    """Number of positions `cache` covers (an int for static caches too, whose layers count in a tensor)."""
    return int(cache.get_seq_length())


def crop_cache(cache: Cache, keep_length: int) -> None:
    """Roll `cache` back in place to its first `keep_length` positions (sliding layers also trim to their window).

    `keep_length` may not be below the length at the previous crop: a sliding layer has dropped what lies before.
    A cache nothing was written to yet (or a layer of it) is left as it is.
    """
    current = cache_length(cache)
    if not 0 <= keep_length <= current:
        raise ValueError(f"cannot crop a cache of {current} positions to {keep_length}")
    if not cache.is_croppable:
        raise ValueError(
            f"{type(cache).__name__} cannot be rolled back (layers: "
            f"{sorted({type(layer).__name__ for layer in cache.layers})}); build it with "
            "specdistill.models.cache.new_cache."
        )
    removed = current - keep_length
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        if isinstance(window, int) and getattr(layer, "is_initialized", False) and current >= window:
            needed = min(window - 1, keep_length) + removed
            if layer.keys.shape[-2] < needed:
                raise ValueError(
                    f"cannot crop a cache of {current} positions to {keep_length}: a sliding-window layer "
                    f"(window {window}) holds {layer.keys.shape[-2]}, and dropped the rest. Build the cache with "
                    "new_cache (it records what a crop may need) and never crop below the previous crop."
                )
    # `Cache.crop` layer by layer, skipping the layers nothing was written to yet (a draft that never ran, as when
    # one token is asked for): transformers' sliding-window layer reads its tensors there, which do not exist yet.
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True):
            layer.crop(-removed)
