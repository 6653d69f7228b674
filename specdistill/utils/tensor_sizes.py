"""`LargestTensor`: the largest tensor operators create inside a block (a check that no full logits exist)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestTensor(TorchDispatchMode):
    """Records the largest output (by element count) of every operator run in the block, forward and backward alike (views excluded).

    Args:
        last_dim: only count tensors whose last dimension is this (e.g. the vocabulary, to find logits); None counts
            every tensor. It bounds the shapes of new tensors; it does not measure memory.
    """

    def __init__(self, last_dim: int | None = None) -> None:
        super().__init__()
        self.last_dim = last_dim
        self.numel = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views of an input (a transposed weight, a slice of logits) allocate nothing: their base was counted
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.numel() <= self.numel or _storage(t) in inputs:
                continue
            if self.last_dim is None or (t.dim() > 0 and t.shape[-1] == self.last_dim):
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
