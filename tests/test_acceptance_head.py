"""Acceptance head (model, save/load), its weighted BCE loss and validation metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.losses.head_bce import (
    auroc_rejection,
    binary_kl,
    expected_calibration_error,
    reliability_bins,
    weighted_bce_terms,
    weighted_bce_with_logits,
    write_reliability_diagram,
)
from specdistill.models.acceptance_head import AcceptanceHead


def _random_head(hidden: int = 16, blocks: int = 3, seed: int = 0) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, blocks)
    with torch.no_grad():  # leave the zero init so the blocks matter in the tests
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head


# --- head -------------------------------------------------------------------------------------------------------


def test_head_blocks_have_their_own_weights_and_shapes():
    head = _random_head(hidden=16, blocks=3)
    weights = [block.linear.weight for block in head.blocks]
    assert len(weights) == 3
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1])
    assert head(torch.randn(2, 5, 16)).shape == (2, 5)
    assert head(torch.randn(16)).shape == ()


def test_head_forward_matches_formula():
    head = _random_head(hidden=8, blocks=2)
    x = torch.randn(4, 8)
    expected = x
    for block in head.blocks:
        expected = expected + F.silu(expected @ block.linear.weight.T + block.linear.bias)
    expected = (expected @ head.out.weight.T + head.out.bias).squeeze(-1)
    torch.testing.assert_close(head(x), expected)


def test_untrained_blocks_are_identity():
    head = AcceptanceHead(8, 3)
    x = torch.randn(3, 8)
    torch.testing.assert_close(head.blocks(x), x)


def test_head_save_load_round_trip(tmp_path):
    head = _random_head(hidden=16, blocks=3)
    head.save(tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["head_config.json", "model.safetensors"]
    loaded = AcceptanceHead.load(tmp_path / "head")
    assert loaded.config() == {"hidden_size": 16, "num_blocks": 3}
    x = torch.randn(7, 16)
    torch.testing.assert_close(loaded(x), head(x), rtol=0, atol=0)


def test_head_load_missing_files_and_bad_width(tmp_path):
    with pytest.raises(FileNotFoundError, match="head_config.json"):
        AcceptanceHead.load(tmp_path)
    with pytest.raises(ValueError, match="hidden_size"):
        AcceptanceHead(8)(torch.randn(2, 9))


# --- loss -------------------------------------------------------------------------------------------------------


def test_weighted_bce_equals_formula_on_small_example():
    logits = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([1.0, 0.25, 0.0])
    s = torch.sigmoid(logits)
    w_acc, w_rej = 1.0, 6.0
    num = sum(
        w_rej * (1 - a) * -math.log(1 - si) + w_acc * a * -math.log(si)
        for si, a in zip(s.tolist(), labels.tolist(), strict=True)
    )
    den = sum(w_rej * (1 - a) + w_acc * a for a in labels.tolist())
    loss = weighted_bce_with_logits(logits, labels, w_acc=w_acc, w_rej=w_rej)
    assert loss.item() == pytest.approx(float(num / den), rel=1e-6)
    # hand value: den = 1 + (6 * 0.75 + 0.25) + 6 = 11.75
    assert float(den) == pytest.approx(11.75)


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_equal_weights_reduce_to_soft_label_bce(weight):
    torch.manual_seed(0)
    logits, labels = torch.randn(50) * 3, torch.rand(50)
    expected = F.binary_cross_entropy_with_logits(logits, labels)
    torch.testing.assert_close(weighted_bce_with_logits(logits, labels, w_acc=weight, w_rej=weight), expected)


def test_rejection_weight_pulls_predictions_down():
    labels = torch.full((1,), 0.5)
    grid = torch.linspace(-4, 4, 801)
    losses = torch.stack([weighted_bce_with_logits(x.view(1), labels, 1.0, 6.0) for x in grid])
    best = torch.sigmoid(grid[losses.argmin()]).item()
    # minimiser of 6*0.5*(-log(1-s)) + 0.5*(-log s): s = 0.5 / (0.5 + 3) = 1/7
    assert best == pytest.approx(1 / 7, abs=2e-3)


def test_loss_stable_for_extreme_logits_and_empty_input():
    logits = torch.tensor([200.0, -200.0], requires_grad=True)
    loss = weighted_bce_with_logits(logits, torch.tensor([0.0, 1.0]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx((6 * 200 + 200) / 7, rel=1e-5)
    empty = torch.zeros(0, requires_grad=True)
    zero = weighted_bce_with_logits(empty, torch.zeros(0))
    zero.backward()
    assert zero.item() == 0.0


def test_loss_terms_sum_across_splits_equal_whole():
    torch.manual_seed(1)
    logits, labels = torch.randn(20), torch.rand(20)
    terms, weights = weighted_bce_terms(logits, labels)
    split = (terms[:7].sum() + terms[7:].sum()) / (weights[:7].sum() + weights[7:].sum())
    torch.testing.assert_close(split, weighted_bce_with_logits(logits, labels))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        weighted_bce_with_logits(torch.zeros(2), torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="same length"):
        weighted_bce_with_logits(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="positive"):
        weighted_bce_with_logits(torch.zeros(2), torch.zeros(2), w_rej=0.0)


# --- metrics ----------------------------------------------------------------------------------------------------


def test_binary_kl_matches_direct_formula_and_is_zero_at_labels():
    labels = torch.tensor([0.0, 0.3, 1.0, 0.9])
    logits = torch.tensor([0.5, -0.2, 1.5, 3.0])
    s = torch.sigmoid(logits)
    direct = torch.tensor(
        [
            -math.log(1 - s[0]),
            0.3 * math.log(0.3 / s[1]) + 0.7 * math.log(0.7 / (1 - s[1])),
            -math.log(s[2]),
            0.9 * math.log(0.9 / s[3]) + 0.1 * math.log(0.1 / (1 - s[3])),
        ]
    )
    torch.testing.assert_close(binary_kl(logits, labels), direct)
    at_labels = torch.logit(torch.tensor([0.2, 0.7]))
    torch.testing.assert_close(
        binary_kl(at_labels, torch.tensor([0.2, 0.7])), torch.zeros(2), atol=1e-6, rtol=0
    )


def _pairwise_auroc(scores: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> float:
    num = den = 0.0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if i == j:
                continue
            w = float(pos[i] * neg[j])
            den += w
            num += w * (1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0)
    return num / den


def test_auroc_hard_labels_matches_torchmetrics_and_pairwise():
    from torchmetrics.functional.classification import binary_auroc

    torch.manual_seed(0)
    logits = torch.randn(40).round(decimals=1)  # rounding creates ties
    labels = (torch.rand(40) > 0.4).float()
    ours = auroc_rejection(logits, labels).item()
    reference = binary_auroc(-logits, (1 - labels).long()).item()
    assert ours == pytest.approx(reference, abs=1e-6)
    assert ours == pytest.approx(_pairwise_auroc(-logits, 1 - labels, labels), abs=1e-6)


def test_auroc_soft_labels_matches_pairwise_and_extremes():
    torch.manual_seed(3)
    logits, labels = torch.randn(15).round(decimals=1), torch.rand(15)
    expected = _pairwise_auroc(-logits, 1 - labels, labels)
    assert auroc_rejection(logits, labels).item() == pytest.approx(expected, abs=1e-6)
    hard = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert auroc_rejection(torch.tensor([3.0, 2.0, -1.0, -2.0]), hard).item() == 1.0
    assert auroc_rejection(torch.tensor([-3.0, -2.0, 1.0, 2.0]), hard).item() == 0.0
    with pytest.raises(ValueError, match="undefined"):
        auroc_rejection(torch.randn(3), torch.ones(3))


def test_ece_and_bins_on_hand_example():
    probs = torch.tensor([0.05, 0.15, 0.15, 0.95])
    labels = torch.tensor([0.0, 0.5, 0.1, 1.0])
    logits = torch.logit(probs)
    mean_pred, mean_label, count = reliability_bins(logits, labels, num_bins=10)
    assert count.tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 1]
    torch.testing.assert_close(mean_label[1], torch.tensor(0.3))
    # |0 - 0.05| * 1/4 + |0.3 - 0.15| * 2/4 + |1 - 0.95| * 1/4
    expected = 0.05 / 4 + 0.15 / 2 + 0.05 / 4
    assert expected_calibration_error(logits, labels, 10).item() == pytest.approx(expected, abs=1e-5)


def test_reliability_diagram_png(tmp_path):
    torch.manual_seed(0)
    path = write_reliability_diagram(torch.randn(100), torch.rand(100), tmp_path / "sub" / "rel.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
