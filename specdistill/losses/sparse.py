"""A target distribution kept as its top-m tokens plus the mass of the rest, and divergences against it.

`SparseRows(log_probs (N, m), token_ids (N, m), tail_mass (N,))` stores, per answer token, the target's m largest
log-probabilities (fp32, on the real vocabulary, before any warping), their token ids, and `tail_mass` = 1 - the sum
of those m probabilities. A divergence against a draft then runs on m + 1 outcomes: the m cached tokens, and one
"tail" bucket holding the rest of the vocabulary, with the draft's probabilities aggregated the same way
(`bucket_log_probs`). With m = V the tail is empty and the value is the exact divergence; with m < V it is the exact
divergence between the bucketed distributions, which is at most the full one for KL and JSD (data processing) and for
TVD, and equals the full one when the draft agrees with the target inside the tail up to a common scale.
docs/METHODS.md ("Cached target distributions") gives the measured error at m = 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# log 0 of an empty tail: finite, so that 0 * (log p - log q) has a zero (not NaN) gradient; exp() of it is 0.0.
LOG_ZERO = -1.0e4


def bucket_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`(n, V)` logits and `(n, m)` ids -> `(n, m + 1)` fp32 log-probabilities: the m ids, then the rest's total.

    The tail of a row whose ids cover the whole vocabulary is `LOG_ZERO`, with zero (never NaN) gradients.
    """
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.gather(-1, token_ids) - log_z
    rest = logits.scatter(-1, token_ids, float("-inf"))
    empty = torch.isneginf(rest).all(dim=-1, keepdim=True)
    # logsumexp of an all -inf row has a NaN gradient; feed it zeros there and put LOG_ZERO in afterwards.
    safe = torch.where(empty, torch.zeros_like(rest), rest)
    tail = torch.where(
        empty, torch.full_like(log_z, LOG_ZERO), torch.logsumexp(safe, -1, keepdim=True) - log_z
    )
    return torch.cat([top, tail], dim=-1)


@dataclass(frozen=True)
class SparseRows:
    """A target's answer rows as top-m log-probabilities `(N, m)` fp32, their ids `(N, m)` long and tail mass `(N,)`."""

    log_probs: torch.Tensor
    token_ids: torch.Tensor
    tail_mass: torch.Tensor

    def __post_init__(self) -> None:
        n, m = self.log_probs.shape
        if self.token_ids.shape != (n, m) or self.tail_mass.shape != (n,):
            raise ValueError(
                f"sparse target rows need log_probs (N, m), token_ids (N, m) and tail_mass (N,), got "
                f"{tuple(self.log_probs.shape)}, {tuple(self.token_ids.shape)} and {tuple(self.tail_mass.shape)}"
            )

    def __len__(self) -> int:
        return self.log_probs.shape[0]

    @property
    def vocab_size(self) -> None:
        """Unknown from the rows alone: the cache records it (`specdistill.losses.target_cache`)."""
        return None

    def inputs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        return self.log_probs[start:stop], self.token_ids[start:stop], self.tail_mass[start:stop]

    def against(
        self,
        draft_logits: torch.Tensor,
        log_probs: torch.Tensor,
        token_ids: torch.Tensor,
        tail_mass: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(target, draft)` as `(n, m + 1)` log-probabilities over the cached ids and the tail bucket."""
        token_ids = token_ids.long().to(draft_logits.device)
        tail = tail_mass.float().clamp_min(0.0).log().clamp_min(LOG_ZERO).unsqueeze(-1)
        target = torch.cat([log_probs.float(), tail], dim=-1).to(draft_logits.device)
        return target, bucket_log_probs(draft_logits, token_ids)


def top_m(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(n, V)` logits -> `(log_probs (n, m) fp32, token_ids (n, m) long, tail_mass (n,) fp32)` of the top m tokens.

    The tail mass is summed from the remaining log-probabilities (not 1 - the top's sum, which cancels badly).
    """
    if m < 1:
        raise ValueError(f"top_m needs m >= 1 cached tokens per position, got {m}")
    log_p = torch.log_softmax(logits.float(), dim=-1)
    top, ids = log_p.topk(min(m, log_p.shape[-1]), dim=-1)
    tail = torch.logsumexp(log_p.scatter(-1, ids, float("-inf")), dim=-1).exp()
    return top, ids, tail
