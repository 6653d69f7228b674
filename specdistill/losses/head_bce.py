"""Acceptance-head loss and validation metrics (docs/METHODS.md section 4), as pure functions on flat tensors.

Every function takes `logits: (N,)` acceptance logits of the head and `labels: (N,)` soft labels
`a = min(1, p(Y)/q(Y))` in [0, 1], and computes in fp32. The positive class of the head is *acceptance*; the AUROC is
reported for predicting *rejection* (the event that stops drafting), i.e. with score `1 - sigmoid(logit)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _check(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 1 or logits.shape != labels.shape:
        raise ValueError(
            f"expected flat logits (N,) and labels (N,) of the same length, got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}: select the scored positions with a boolean mask first."
        )
    labels = labels.float()
    if labels.numel() and (labels.min() < 0 or labels.max() > 1 or torch.isnan(labels).any()):
        raise ValueError("soft labels must lie in [0, 1] (they are min(1, p/q) acceptance probabilities).")
    return logits.float(), labels


def _check_weights(w_acc: float, w_rej: float) -> None:
    if not (w_acc > 0 and w_rej > 0):
        raise ValueError(
            f"w_acc={w_acc} and w_rej={w_rej} must both be positive (SpecDec++: w_acc=1, w_rej=6)."
        )


def weighted_bce_terms(
    logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 6.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of the weighted soft-label BCE, per position.

    Returns:
        `(loss_terms, weights)`, both `(N,)`: `w_rej (1-a) (-log(1-s)) + w_acc a (-log s)` and
        `w_rej (1-a) + w_acc a`. Summing each over any set of positions (a batch, a gradient-accumulation window, a
        whole validation split) and dividing gives the loss of that set.
    """
    _check_weights(w_acc, w_rej)
    logits, labels = _check(logits, labels)
    # -log s = -logsigmoid(x) and -log(1 - s) = -logsigmoid(-x): stable for any logit magnitude.
    rej_weight = w_rej * (1.0 - labels)
    acc_weight = w_acc * labels
    terms = -rej_weight * F.logsigmoid(-logits) - acc_weight * F.logsigmoid(logits)
    return terms, rej_weight + acc_weight


def weighted_bce_with_logits(
    logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 6.0
) -> torch.Tensor:
    """SpecDec++ loss `sum[w_rej (1-a)(-log(1-s)) + w_acc a (-log s)] / sum[w_rej (1-a) + w_acc a]`.

    With `w_acc = w_rej` this is the mean soft-label BCE (`F.binary_cross_entropy_with_logits`). An empty input gives
    a zero loss that still carries a (zero) gradient, so a batch without draft tokens does not break training.

    Args:
        logits: `(N,)` head logits.
        labels: `(N,)` soft acceptance labels in [0, 1].
        w_acc: weight of the acceptance term.
        w_rej: weight of the rejection term (1, 3, 6 or 12 in the paper; 6 is the authors' pick).

    Returns:
        Scalar fp32 loss.
    """
    terms, weights = weighted_bce_terms(logits, labels, w_acc, w_rej)
    if terms.numel() == 0:
        return logits.float().sum() * 0.0
    return terms.sum() / weights.sum()


def binary_kl(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`(N,)` KL(Bernoulli(a) || Bernoulli(s)) between labels and predicted acceptance, with 0 log 0 = 0."""
    logits, labels = _check(logits, labels)
    entropy_part = torch.xlogy(labels, labels) + torch.xlogy(1.0 - labels, 1.0 - labels)
    cross_part = labels * F.logsigmoid(logits) + (1.0 - labels) * F.logsigmoid(-logits)
    return (entropy_part - cross_part).clamp_min(0.0)


def auroc_rejection(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """AUROC of the score `1 - s` for the event "the target rejects the token", with soft labels.

    Each position counts as a rejection with weight `1 - a` and as an acceptance with weight `a`; the AUROC is the
    weighted fraction of (rejected, accepted) pairs of *distinct* positions that the score orders correctly, ties
    counting one half. With hard 0/1 labels this is the usual AUROC.

    Raises:
        ValueError: if the labels hold no rejection weight or no acceptance weight (the AUROC is undefined).
    """
    logits, labels = _check(logits, labels)
    pos, neg = 1.0 - labels, labels  # positive class = rejection
    total_pairs = pos.sum() * neg.sum() - (pos * neg).sum()
    if total_pairs <= 0:
        raise ValueError(
            "AUROC is undefined: the labels hold no rejected-and-accepted pair (all tokens accepted or all rejected)."
        )
    # Score for rejection is -logit (monotone in 1 - s); group equal scores so ties count one half.
    scores, group = torch.unique(-logits, sorted=True, return_inverse=True)
    pos_per_group = torch.zeros_like(scores).index_add_(0, group, pos)
    neg_per_group = torch.zeros_like(scores).index_add_(0, group, neg)
    neg_below = torch.cumsum(neg_per_group, 0) - neg_per_group
    correct = (pos_per_group * (neg_below + 0.5 * neg_per_group)).sum()
    # Remove each position's pairing with itself (only soft labels have one), which sits in its own tie group.
    correct = correct - 0.5 * (pos * neg).sum()
    return correct / total_pairs


def reliability_bins(
    logits: torch.Tensor, labels: torch.Tensor, num_bins: int = 10
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-width bins of predicted acceptance `s`.

    Returns:
        `(mean_prediction, mean_label, count)`, each `(num_bins,)`; empty bins hold 0 in the means.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins} must be >= 1.")
    logits, labels = _check(logits, labels)
    probs = torch.sigmoid(logits)
    index = (probs * num_bins).long().clamp_(0, num_bins - 1)
    count = torch.zeros(num_bins).index_add_(0, index.cpu(), torch.ones_like(probs).cpu())
    pred_sum = torch.zeros(num_bins).index_add_(0, index.cpu(), probs.cpu())
    label_sum = torch.zeros(num_bins).index_add_(0, index.cpu(), labels.cpu())
    safe = count.clamp_min(1.0)
    return pred_sum / safe, label_sum / safe, count


def expected_calibration_error(
    logits: torch.Tensor, labels: torch.Tensor, num_bins: int = 10
) -> torch.Tensor:
    """ECE = sum_b (n_b / N) |mean label in b - mean prediction in b| over equal-width bins of `s`."""
    mean_pred, mean_label, count = reliability_bins(logits, labels, num_bins)
    if count.sum() == 0:
        raise ValueError("expected_calibration_error needs at least one position.")
    return ((count / count.sum()) * (mean_label - mean_pred).abs()).sum()


def write_reliability_diagram(
    logits: torch.Tensor, labels: torch.Tensor, path: str | Path, num_bins: int = 10, title: str | None = None
) -> Path:
    """Save `reliability_figure` as a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    reliability_figure(logits, labels, num_bins, title).savefig(path, dpi=100)
    return path


def reliability_figure(
    logits: torch.Tensor, labels: torch.Tensor, num_bins: int = 10, title: str | None = None
) -> Figure:
    """A reliability diagram (mean label against mean prediction per bin, with counts); its title, `title` or
    "acceptance head reliability", always ends with the ECE."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mean_pred, mean_label, count = reliability_bins(logits, labels, num_bins)
    ece = expected_calibration_error(logits, labels, num_bins)
    filled = count > 0
    centers = (torch.arange(num_bins) + 0.5) / num_bins

    # A bare Figure with an Agg canvas: no pyplot global state, safe in headless and multi-threaded runs.
    fig = Figure(figsize=(4.5, 5.5))
    FigureCanvasAgg(fig)
    ax, ax_count = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfect calibration")
    ax.bar(
        centers[filled], mean_label[filled], width=1.0 / num_bins, alpha=0.35, edgecolor="black", label="bins"
    )
    ax.plot(
        mean_pred[filled], mean_label[filled], marker="o", color="C0", label="mean label vs mean prediction"
    )
    ax.set_ylabel("mean soft acceptance label")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{title or 'acceptance head reliability'} (ECE {ece:.3f})", fontsize=10)
    ax_count.bar(centers, count, width=1.0 / num_bins, color="C1", edgecolor="black")
    ax_count.set_xlabel("predicted acceptance probability")
    ax_count.set_ylabel("positions")
    fig.tight_layout()
    return fig
