"""Per-token divergences between the target distribution p and the draft distribution q.

Every function takes logits `(N, V)` (any float dtype; softmax is computed in fp32) and returns `(N,)` per-token
values. Argument order is always `(target_logits, draft_logits)`: p comes from the target, q from the draft.

- `forward_kl`: KL(p || q) = sum_v p (log p - log q). DistillSpec / AdaSPEC default.
- `reverse_kl`: KL(q || p).
- `jsd(beta)`: generalised Jensen-Shannon divergence exactly as trl's `GKDTrainer.generalized_jsd_loss`
  (Agarwal et al. 2024, eq. 1): with the mixture m = beta p + (1 - beta) q,
  JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m) for 0 < beta < 1, and by trl's convention the endpoints are
  *defined* as beta = 0 -> KL(p || q) (forward KL) and beta = 1 -> KL(q || p) (reverse KL). Note that the formula
  itself tends to 0 at both ends; it is JSD_beta / beta that tends to KL(p || q) as beta -> 0 and
  JSD_beta / (1 - beta) that tends to KL(q || p) as beta -> 1. beta = 0.5 is the symmetric JSD (bounded by log 2).
- `tvd`: total variation 0.5 sum_v |p - q|.
- `expected_acceptance`: sum_v min(p, q) = 1 - tvd, the speculative-decoding acceptance probability at a position.

`Divergence` objects (`ForwardKL()`, `ReverseKL()`, `JSD(beta=0.5)`, `TVD()`) wrap these for Hydra
(`conf/divergence/*.yaml`); they compare equal when they compute the same thing, and `chunk_size` switches to
`chunked_divergence`, which bounds the fp32 `(N, V)` temporaries for large vocabularies and equals the plain
computation (same rows, same maths, concatenated). `Divergence.rows(target_rows, draft_rows)` computes the same
values from answer rows that are projected chunk by chunk (`specdistill.losses.rows`, `specdistill.losses.chunked`),
so no model's full logits exist at once; it is what training, validation and scoring use. Its chunk is
`chunk_size` rows when set, else as many as `chunk_budget_mb` allows (`specdistill.losses.chunked.auto_chunk_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from specdistill.losses.chunked import DEFAULT_CHUNK_BUDGET_MB, DivergenceFn, auto_chunk_size, rowwise
from specdistill.losses.rows import LogitRows

KERNELS = ("torch", "liger")  # how the training loss is computed (`Divergence.kernel`)


def _check_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> None:
    if target_logits.dim() != 2 or target_logits.shape != draft_logits.shape:
        raise ValueError(
            f"divergences take two (N, V) logit tensors of the same shape, got target {tuple(target_logits.shape)} "
            f"and draft {tuple(draft_logits.shape)}; flatten (B, T, V) logits to (B*T, V) and slice both to the "
            "tokenizer's real vocabulary with [..., :vocab_size]"
        )


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=-1)


def _kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from fp32 log-probabilities `(N, V)`.

    Terms with p = 0 are 0 by convention; masking them keeps -inf logits (e.g. blocked vocabulary rows) from
    producing 0 * inf = NaN.
    """
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), 0.0)
    return terms.sum(dim=-1)


def forward_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per token. `(N, V), (N, V) -> (N,)` fp32."""
    _check_logits(target_logits, draft_logits)
    return _kl_from_log_probs(_log_probs(target_logits), _log_probs(draft_logits))


def reverse_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p) per token. `(N, V), (N, V) -> (N,)` fp32."""
    _check_logits(target_logits, draft_logits)
    return _kl_from_log_probs(_log_probs(draft_logits), _log_probs(target_logits))


def check_beta(beta: float) -> float:
    """Return `beta` as a float if it lies in [0, 1]; raise ValueError otherwise."""
    beta = float(beta)
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(
            f"JSD beta must lie in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = symmetric JSD), got {beta}"
        )
    return beta


def jsd(target_logits: torch.Tensor, draft_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised JSD per token with trl's conventions (see module docstring). `(N, V), (N, V) -> (N,)` fp32."""
    beta = check_beta(beta)
    _check_logits(target_logits, draft_logits)
    log_p = _log_probs(target_logits)
    log_q = _log_probs(draft_logits)
    if beta == 0.0:
        return _kl_from_log_probs(log_p, log_q)
    if beta == 1.0:
        return _kl_from_log_probs(log_q, log_p)
    # log m = logsumexp(log p + log beta, log q + log(1 - beta)), stable for tiny probabilities.
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * _kl_from_log_probs(log_p, log_m) + (1.0 - beta) * _kl_from_log_probs(log_q, log_m)


def tvd(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Total variation distance 0.5 * sum_v |p - q| per token. `(N, V), (N, V) -> (N,)` fp32."""
    _check_logits(target_logits, draft_logits)
    p = torch.softmax(target_logits.float(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    return 0.5 * (p - q).abs().sum(dim=-1)


def expected_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Acceptance probability sum_v min(p, q) = 1 - tvd per token. `(N, V), (N, V) -> (N,)` fp32."""
    _check_logits(target_logits, draft_logits)
    p = torch.softmax(target_logits.float(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    return torch.minimum(p, q).sum(dim=-1)


def chunked_divergence(
    fn: DivergenceFn,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    chunk_size: int,
    recompute: bool = True,
) -> torch.Tensor:
    """Apply a per-token divergence `fn` to row chunks of `(N, V)` logits; returns `(N,)`.

    The rows are independent, so the result is exactly `fn(target_logits, draft_logits)`. Each chunk's fp32
    softmax temporaries are at most `chunk_size * V`; with `recompute` (and gradients needed) every chunk runs under
    activation checkpointing (`specdistill.losses.chunked.rowwise`), so the fp32 intermediates are freed after the
    forward and recomputed in backward instead of being held for the whole batch at once.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    _check_logits(target_logits, draft_logits)
    if recompute:
        return rowwise([fn], LogitRows(target_logits), LogitRows(draft_logits), chunk_size)[0]
    pieces = [
        fn(target_logits[start : start + chunk_size], draft_logits[start : start + chunk_size])
        for start in range(0, target_logits.shape[0], chunk_size)
    ]
    return torch.cat(pieces) if pieces else target_logits.new_zeros(0, dtype=torch.float32)


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Configurable per-token divergence: `__call__(target_logits (N, V), draft_logits (N, V)) -> (N,)`.

    Attributes:
        chunk_size: keyword-only; if set, compute over row chunks of this many tokens (see `chunked_divergence`);
            None (default): `__call__` computes all rows at once, `rows` as many as `chunk_budget_mb` allows.
        chunk_budget_mb: keyword-only; when `chunk_size` is None, the MiB of one chunk's fp32 `(n, V)` logits in
            `rows` (`DEFAULT_CHUNK_BUDGET_MB`: a batch that fits is one chunk); None: all rows at once.
        kernel: keyword-only; how the training loss is computed: `torch` (default, `rows`) or `liger` (Liger
            Kernel's fused linear JSD on CUDA, `specdistill.losses.fused`). Values are the same; `kernel` and
            `chunk_size` change speed and memory only.
    """

    chunk_size: int | None = None
    # Not in repr or equality: it changes memory, not values, and the reference scores' cache key is the repr.
    chunk_budget_mb: float | None = field(default=DEFAULT_CHUNK_BUDGET_MB, repr=False, compare=False)
    kernel: str = "torch"

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be None or a positive number of rows, got {self.chunk_size}")
        if self.chunk_budget_mb is not None and not self.chunk_budget_mb > 0:
            raise ValueError(
                f"chunk_budget_mb must be None or a positive number of MiB, got {self.chunk_budget_mb}"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    def per_token(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        if self.chunk_size is None:
            return self.per_token(target_logits, draft_logits)
        return chunked_divergence(self.per_token, target_logits, draft_logits, self.chunk_size)

    def rows(self, target_rows: Any, draft_rows: Any) -> torch.Tensor:
        """`(N,)` from answer rows (`specdistill.losses.rows`: hidden states and output layer, logits, or a cached
        sparse target), projected `rows_per_chunk` rows at a time without full logits."""
        return rowwise([self.per_token], target_rows, draft_rows, self.chunk_size, self.chunk_budget_mb)[0]

    def rows_per_chunk(self, rows: int, vocab_size: int) -> int | None:
        """The chunk `rows` uses for `rows` answer rows of `vocab_size` logits: `chunk_size` when set, else what
        `chunk_budget_mb` allows; None means all rows at once."""
        if self.chunk_size is not None:
            return self.chunk_size
        return auto_chunk_size(rows, vocab_size, self.chunk_budget_mb)


@dataclass(frozen=True)
class ForwardKL(Divergence):
    """KL(p || q): mass-covering; the DistillSpec / AdaSPEC loss."""

    def per_token(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        return forward_kl(target_logits, draft_logits)


@dataclass(frozen=True)
class ReverseKL(Divergence):
    """KL(q || p): mode-seeking."""

    def per_token(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        return reverse_kl(target_logits, draft_logits)


@dataclass(frozen=True)
class JSD(Divergence):
    """Generalised JSD with trl's conventions (beta = 0 forward KL, beta = 1 reverse KL).

    Attributes:
        beta: mixture weight of the target in m = beta p + (1 - beta) q, in [0, 1]; default 0.5.
    """

    beta: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)

    def per_token(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        return jsd(target_logits, draft_logits, self.beta)


@dataclass(frozen=True)
class TVD(Divergence):
    """Total variation 0.5 sum |p - q| = 1 - expected acceptance: directly optimises acceptance."""

    def per_token(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        return tvd(target_logits, draft_logits)
