"""Logit warpers shared by the draft and the target (and by SpecDec++ rollout labelling).

Speculative sampling is lossless with respect to the *warped* target distribution, so the draft and the target must
be warped identically: temperature, then top-k, then top-p (the order of transformers' `generate`). Greedy decoding
(`greedy=True` or `temperature == 0`) is handled explicitly as a one-hot argmax rather than a limit of tiny
temperatures, which would overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen from logits; applied identically to the draft and the target.

    Attributes:
        temperature: divides the logits; 0 means greedy (argmax). Must be finite and >= 0.
        top_k: keep the k most likely tokens (ties at the k-th value are kept); 0 disables.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1.0 disables.
        greedy: pick the argmax regardless of temperature.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p!r}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (greedy flag or temperature 0)."""
        return self.greedy or self.temperature == 0

    def warp_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`warp_logits` with this config's settings."""
        return warp_logits(logits, self.temperature, self.top_k, self.top_p, greedy=self.greedy)

    def warp_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`warp_probs` with this config's settings."""
        return warp_probs(logits, self.temperature, self.top_k, self.top_p, greedy=self.greedy)

    def policy_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft distribution draft-length policies and proposer heads see: `warp_probs`, except in greedy mode,
        where a one-hot would tell them nothing and they get the unwarped softmax (the draft's own confidence)."""
        if self.is_greedy:
            return logits.float().softmax(-1)
        return self.warp_probs(logits)


def _check_options(temperature: float, top_k: int, top_p: float) -> None:
    # Same checks as SamplingConfig, for callers that use the functions directly.
    SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def _top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_value = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_value, float("-inf"))


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is <= 1 - top_p; the most likely token always survives.
    sorted_drop = cumulative <= (1.0 - top_p)
    sorted_drop[..., -1] = False
    drop = sorted_drop.scatter(-1, sorted_idx, sorted_drop)
    return logits.masked_fill(drop, float("-inf"))


def _one_hot_argmax(logits: torch.Tensor, fill: float, hot: float) -> torch.Tensor:
    out = torch.full_like(logits, fill)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), hot)


def warp_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False
) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits.

    Args:
        logits: `(..., V)` raw logits on the real vocabulary.
        temperature, top_k, top_p, greedy: see `SamplingConfig`.

    Returns:
        `(..., V)` float32 logits; filtered entries are `-inf`. In greedy mode (greedy or temperature 0) the argmax
        entry is 0 and every other entry `-inf`, so `softmax` gives the one-hot argmax distribution.
    """
    _check_options(temperature, top_k, top_p)
    logits = logits.float()
    if greedy or temperature == 0:
        return _one_hot_argmax(logits, float("-inf"), 0.0)
    if temperature != 1.0:
        logits = logits / temperature
    return _top_p_filter(_top_k_filter(logits, top_k), top_p)


def warp_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False
) -> torch.Tensor:
    """Warped probabilities: `softmax(warp_logits(...))`, one-hot argmax in greedy mode.

    Args:
        logits: `(..., V)` raw logits on the real vocabulary.

    Returns:
        `(..., V)` float32 probabilities summing to 1 along the last dimension.
    """
    _check_options(temperature, top_k, top_p)
    if greedy or temperature == 0:
        return _one_hot_argmax(logits.float(), 0.0, 1.0)
    return warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
