"""The draft's logit margins per position: how safely it picks its token, or how far it is from the target's.

The AdaSPEC paper's margin analysis looks at two numbers per position: where the draft's argmax agrees with the
target's, the draft's top-1 minus top-2 logit (how safely it agrees); where it disagrees, the draft's logit of the
target's argmax minus its own top logit (how far the right token is from winning). `signed_margins` folds both into
one signed value per position:

- agree (draft argmax == target argmax): margin = top-1 - top-2 logit of the draft, >= 0;
- disagree: margin = draft logit of the target's argmax - the draft's top logit, <= 0.

The margin is 0 only at ties: the draft's two largest logits are equal (agree), or the target's token ties the
draft's top logit but `argmax` picked another index (disagree). Argmax ties go to the lowest index, as `torch.argmax`.
All margins are computed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.diagnostics.checks import check_logit_pair, check_logits


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row. `(N, V)` with V >= 2 -> `(N,)` fp32, >= 0."""
    check_logits(logits, "logits", min_vocab=2)
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


@dataclass(frozen=True)
class SignedMargins:
    """Per-position agreement and signed margin of the draft (see the module docstring).

    Attributes:
        agree: `(N,)` bool, True where the draft's argmax is the target's argmax.
        margin: `(N,)` fp32; >= 0 where `agree`, <= 0 elsewhere.
    """

    agree: torch.Tensor
    margin: torch.Tensor

    def __post_init__(self) -> None:
        if self.agree.dim() != 1 or self.agree.shape != self.margin.shape:
            raise ValueError(
                f"SignedMargins needs agree (N,) and margin (N,) of the same length, got "
                f"{tuple(self.agree.shape)} and {tuple(self.margin.shape)}"
            )
        if self.agree.dtype != torch.bool:
            raise ValueError(f"SignedMargins.agree must be a bool tensor, got {self.agree.dtype}")


def signed_margins(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> SignedMargins:
    """Agreement of the argmaxes and the draft's signed margin at each position.

    Args:
        draft_logits: `(N, V)` the draft's logits, V >= 2.
        target_logits: `(N, V)` the target's logits at the same positions, same vocabulary.

    Returns:
        `SignedMargins` with `agree (N,)` bool and `margin (N,)` fp32: top-1 - top-2 of the draft where it agrees,
        draft logit of the target's argmax - the draft's top logit where it disagrees.
    """
    check_logit_pair(draft_logits, target_logits)
    check_logits(draft_logits, "draft_logits", min_vocab=2)
    draft = draft_logits.float()
    target_token = target_logits.argmax(dim=-1).to(draft.device)
    agree = draft.argmax(dim=-1) == target_token
    gap_to_target = draft.gather(-1, target_token.unsqueeze(-1)).squeeze(-1) - draft.amax(dim=-1)
    margin = torch.where(agree, top2_margin(draft), gap_to_target)
    return SignedMargins(agree=agree, margin=margin)


def margin_summary(signed: SignedMargins) -> dict[str, float | int | None]:
    """Plain-number summary of signed margins for result.json.

    Args:
        signed: the `(N,)` agreement and margins of `signed_margins`, N >= 1.

    Returns:
        `positive_fraction` (share of positions with margin > 0), `mean_positive_margin` (mean over margin > 0),
        `mean_negative_margin` (mean over margin < 0), `agree_count` and `disagree_count`. A mean over no
        positions is None (JSON null); margins of exactly 0 (ties) count in neither mean.
    """
    if signed.margin.numel() == 0:
        raise ValueError("margin_summary got no positions; compute signed_margins on at least one row")
    margin = signed.margin.double()
    positive, negative = margin[margin > 0], margin[margin < 0]
    agree_count = int(signed.agree.sum().item())
    return {
        "positive_fraction": float((margin > 0).double().mean().item()),
        "mean_positive_margin": float(positive.mean().item()) if positive.numel() else None,
        "mean_negative_margin": float(negative.mean().item()) if negative.numel() else None,
        "agree_count": agree_count,
        "disagree_count": int(signed.agree.numel()) - agree_count,
    }
