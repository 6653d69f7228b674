"""The training divergence through Liger Kernel's fused linear JSD (`divergence.kernel=liger`, CUDA, Triton).

`LigerFusedLinearJSD` projects hidden states through both output layers and computes the generalised JSD of Agarwal
et al. (m = beta p + (1 - beta) q; beta = 0 forward KL, beta = 1 reverse KL, the conventions of
`specdistill.losses.divergence.jsd`) block by block inside one kernel, with the draft's gradients, and returns their
mean over rows. The pure-PyTorch path (`Divergence.rows`) stays the reference: it gives the per-token values AdaSPEC
selects from (under no grad), and the kernel then gives the loss of the kept rows. Supported: ForwardKL, ReverseKL and
JSD on models whose output layer is a bias-free linear layer without a logit soft cap (Gemma-2 has one), with the
target run online (not a cached target) and outside DeepSpeed ZeRO-3 (its output layers are partitioned).
`pip install 'specdistill[liger]'`.
"""

from __future__ import annotations

import torch

from specdistill.losses.divergence import JSD, Divergence, ForwardKL, ReverseKL
from specdistill.losses.rows import HiddenRows
from specdistill.utils.extras import require


def liger_beta(divergence: Divergence) -> float:
    """The `jsd_beta` of Liger's generalised JSD that computes `divergence`; raises for one it cannot compute."""
    if isinstance(divergence, JSD):
        return float(divergence.beta)
    if isinstance(divergence, ForwardKL):
        return 0.0
    if isinstance(divergence, ReverseKL):
        return 1.0
    raise ValueError(
        f"divergence.kernel=liger computes forward KL, reverse KL and JSD, not {type(divergence).__name__}: use "
        "divergence.kernel=torch for it"
    )


def _weight(rows: HiddenRows, role: str) -> torch.Tensor:
    """The `(V, H)` output-layer weight of `rows`' model, real vocabulary only."""
    head = rows.head
    weight = getattr(head.layer, "weight", None)
    problem = None
    if getattr(head.layer, "bias", None) is not None:
        problem = "has a bias"
    elif head.softcap:
        problem = "soft-caps its logits (final_logit_softcapping)"
    elif weight is None or weight.dim() != 2 or weight.numel() == 0:
        problem = "has no full (V, H) weight here (partitioned by DeepSpeed ZeRO-3?)"
    if problem is not None:
        raise ValueError(
            f"divergence.kernel=liger needs bias-free linear output layers, but the {role}'s {problem}: use "
            "divergence.kernel=torch"
        )
    return weight[: head.vocab_size]


def fused_divergence_sum(
    divergence: Divergence, target_rows: HiddenRows, draft_rows: HiddenRows, keep: torch.Tensor | None
) -> torch.Tensor:
    """Sum over the kept rows of D(p, q), with gradients to the draft's hidden states and output layer.

    Args:
        divergence: ForwardKL, ReverseKL or JSD.
        target_rows, draft_rows: answer rows (hidden states and output layers) of target and draft.
        keep: `(N,)` bool, the rows that count; None keeps all.
    """
    if not isinstance(target_rows, HiddenRows) or not isinstance(draft_rows, HiddenRows):
        raise ValueError(
            "divergence.kernel=liger projects the target's hidden states itself: it cannot read a cached target "
            f"({type(target_rows).__name__}); set target_cache=null or use divergence.kernel=torch"
        )
    beta = liger_beta(divergence)
    draft_weight, target_weight = _weight(draft_rows, "draft"), _weight(target_rows, "target")
    if not draft_rows.hidden.is_cuda:
        raise ValueError(
            "divergence.kernel=liger runs Triton kernels on CUDA only: use divergence.kernel=torch here"
        )
    require("liger_kernel", "divergence.kernel=liger", "liger")
    from liger_kernel.transformers import LigerFusedLinearJSD

    target_hidden, draft_hidden = target_rows.hidden, draft_rows.hidden
    if keep is not None:
        target_hidden, draft_hidden = target_hidden[keep], draft_hidden[keep]
    if draft_hidden.shape[0] == 0:
        return draft_hidden.sum() * 0.0  # nothing kept: zero loss, zero gradients
    mean = LigerFusedLinearJSD(jsd_beta=beta)(
        draft_hidden.contiguous(), draft_weight, target_hidden.detach().contiguous(), target_weight.detach()
    )
    return mean * draft_hidden.shape[0]
