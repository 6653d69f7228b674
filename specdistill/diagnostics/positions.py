"""Per-position diagnostics of one draft against the target: margins, agreement and KL at answer positions.

`position_diagnostics` takes the two models' logits at the same answer positions and returns what the analyses plot
and summarise (`PositionDiagnostics`). A draft that cannot propose some tokens (an EAGLE-3 head's draft vocabulary:
its logits are `-inf` there) is compared on the tokens it can propose, as its training loss does: both
distributions are restricted to those columns (the target's renormalised there), and positions whose target argmax
lies outside them have no margin (the draft cannot agree there); they are counted in `outside_support`.

`summarise_positions` turns the collected positions of one draft into plain numbers for result.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdistill.diagnostics.checks import check_logit_pair
from specdistill.diagnostics.kl import per_token_kl
from specdistill.diagnostics.margins import SignedMargins, margin_summary, signed_margins
from specdistill.diagnostics.summary import summarise
from specdistill.losses.divergence import expected_acceptance


@dataclass(frozen=True)
class PositionDiagnostics:
    """One draft at `N` answer positions (fp32 / bool tensors on the CPU).

    Attributes:
        agree: `(M,)` bool, the draft's argmax is the target's, at the `M <= N` positions with a margin.
        margin: `(M,)` the signed margin there (`specdistill.diagnostics.margins`).
        kl: `(N,)` forward KL(target || draft) over the draft's support, at every position.
        acceptance: `(N,)` the probability that speculative sampling accepts the draft's token there,
            sum_v min(p, q) over the whole vocabulary (a token the draft cannot propose has q = 0).
        outside_support: how many of the `N` positions have a target argmax the draft cannot propose.
        restricted: True when the draft's support is smaller than the vocabulary (KL over the support).
    """

    agree: torch.Tensor
    margin: torch.Tensor
    kl: torch.Tensor
    acceptance: torch.Tensor
    outside_support: int
    restricted: bool


def draft_support(draft_logits: torch.Tensor) -> torch.Tensor:
    """`(V,)` bool: the columns where every row of the `(N, V)` draft logits is finite (tokens it can propose)."""
    return torch.isfinite(draft_logits).all(dim=0)


def position_diagnostics(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> PositionDiagnostics:
    """Margins, agreement and KL of the draft at each of `N` answer positions.

    Args:
        draft_logits: `(N, V)` the draft's logits, `-inf` on tokens it cannot propose (the same in every row).
        target_logits: `(N, V)` the target's logits at the same positions.

    Returns:
        `PositionDiagnostics`, on the CPU.

    Raises:
        ValueError: shapes differ, no positions, NaN logits, or fewer than 2 tokens the draft can propose.
    """
    check_logit_pair(draft_logits, target_logits)
    if torch.isnan(draft_logits).any() or torch.isnan(target_logits).any():
        raise ValueError(
            "the logits hold NaN; a model produced them (check its weights and dtype) before diagnosing it"
        )
    support = draft_support(draft_logits)
    if int(support.sum()) < 2:
        raise ValueError(
            f"the draft can propose {int(support.sum())} of {support.numel()} tokens (its other logits are -inf or "
            "differ in finiteness between rows); a margin needs at least 2 finite logits per row"
        )
    restricted = not bool(support.all())
    draft, target = draft_logits, target_logits
    inside = torch.ones(draft.shape[0], dtype=torch.bool, device=draft.device)
    if restricted:
        inside = support.to(target.device)[target.argmax(dim=-1)]
        draft, target = draft[:, support], target[:, support.to(target.device)]
    kl = per_token_kl(draft, target)
    signed = (
        signed_margins(draft[inside], target[inside])
        if bool(inside.any())
        else SignedMargins(torch.zeros(0, dtype=torch.bool), torch.zeros(0))
    )
    return PositionDiagnostics(
        agree=signed.agree.cpu(),
        margin=signed.margin.cpu(),
        kl=kl.float().cpu(),
        acceptance=expected_acceptance(target_logits, draft_logits).cpu(),
        outside_support=int((~inside).sum()),
        restricted=restricted,
    )


def concatenate(parts: Sequence[PositionDiagnostics]) -> PositionDiagnostics:
    """The positions of several batches of one draft, in order, as one `PositionDiagnostics`."""
    if not parts:
        raise ValueError("concatenate got no batches; diagnose at least one batch of answer positions")
    return PositionDiagnostics(
        agree=torch.cat([p.agree for p in parts]),
        margin=torch.cat([p.margin for p in parts]),
        kl=torch.cat([p.kl for p in parts]),
        acceptance=torch.cat([p.acceptance for p in parts]),
        outside_support=sum(p.outside_support for p in parts),
        restricted=any(p.restricted for p in parts),
    )


def summarise_positions(diagnostics: PositionDiagnostics) -> dict:
    """Plain numbers for result.json: counts, agreement, the margin summary and the distributions' statistics.

    Returns:
        `positions` (N), `outside_support`, `kl_over_draft_support` (bool), `agreement` (share of the positions
        with a margin where the argmaxes agree, None when none has one), `margins` (`margin_summary`, or None),
        `margin_agree` / `margin_disagree` (`summarise` of the margins on each side, None when a side is empty) and
        `kl` (`summarise` of the per-token KL) and `expected_acceptance` (the mean acceptance probability).
    """
    agree, margin = diagnostics.agree, diagnostics.margin
    has_margins = margin.numel() > 0
    return {
        "positions": int(diagnostics.kl.numel()),
        "outside_support": diagnostics.outside_support,
        "kl_over_draft_support": diagnostics.restricted,
        "agreement": float(agree.double().mean()) if has_margins else None,
        "margins": margin_summary(SignedMargins(agree, margin)) if has_margins else None,
        "margin_agree": summarise(margin[agree]) if bool(agree.any()) else None,
        "margin_disagree": summarise(margin[~agree]) if bool((~agree).any()) else None,
        "kl": summarise(diagnostics.kl),
        "expected_acceptance": float(diagnostics.acceptance.double().mean()),
    }


def paper_direction(draft: dict, baseline: dict) -> dict[str, bool | None]:
    """Whether `draft`'s summary moves from `baseline`'s the way the AdaSPEC paper reports for AdaSPEC against
    DistillSpec: more positive margins, larger positive margins, negative margins closer to 0, KL nearer 0.

    Args:
        draft, baseline: `summarise_positions` results of the two drafts on the same positions.

    Returns:
        `positive_fraction_higher`, `mean_positive_margin_larger`, `mean_negative_margin_smaller` (closer to 0),
        `kl_median_lower`, `kl_mean_lower`: each True/False, or None where either side has no such value.
    """

    def compare(a: float | None, b: float | None, higher: bool) -> bool | None:
        if a is None or b is None:
            return None
        return a > b if higher else a < b

    margins, base = draft.get("margins") or {}, baseline.get("margins") or {}
    negative = margins.get("mean_negative_margin")
    base_negative = base.get("mean_negative_margin")
    return {
        "positive_fraction_higher": compare(
            margins.get("positive_fraction"), base.get("positive_fraction"), True
        ),
        "mean_positive_margin_larger": compare(
            margins.get("mean_positive_margin"), base.get("mean_positive_margin"), True
        ),
        "mean_negative_margin_smaller": compare(
            None if negative is None else abs(negative),
            None if base_negative is None else abs(base_negative),
            False,
        ),
        "kl_median_lower": compare(draft["kl"]["median"], baseline["kl"]["median"], False),
        "kl_mean_lower": compare(draft["kl"]["mean"], baseline["kl"]["mean"], False),
    }
