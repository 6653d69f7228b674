"""Token-level diagnostics on hand-made logits and token strings with known answers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdistill.diagnostics import (
    TOKEN_CLASSES,
    SignedMargins,
    kept_dropped_by_class,
    margin_summary,
    per_token_kl,
    signed_margins,
    summarise,
    token_class,
    top2_margin,
)
from specdistill.losses import forward_kl

# Row 0 agrees (both argmax 0), row 1 disagrees (target argmax 2), row 2 agrees (both argmax 1).
DRAFT = torch.tensor([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
TARGET = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 9.0], [0.0, 7.0, 0.0]])


def test_top2_margin_is_top1_minus_top2_in_fp32():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 5.0, 5.0], [-1.0, 2.0, 0.5]])
    assert torch.equal(top2_margin(logits), torch.tensor([2.0, 0.0, 1.5]))
    low_precision = top2_margin(logits.to(torch.bfloat16))
    assert low_precision.dtype == torch.float32
    assert torch.equal(low_precision, torch.tensor([2.0, 0.0, 1.5]))


def test_signed_margins_positive_where_the_draft_agrees_negative_where_it_does_not():
    signed = signed_margins(DRAFT, TARGET)
    assert signed.agree.dtype == torch.bool and signed.margin.dtype == torch.float32
    assert signed.agree.tolist() == [True, False, True]
    # agree: 3 - 1 and 2 - 1; disagree: draft logit of token 2 (0) - draft max (3)
    assert torch.equal(signed.margin, torch.tensor([2.0, -3.0, 1.0]))


def test_a_tie_at_the_drafts_top_is_a_zero_margin_on_either_side():
    # the draft ties tokens 0 and 1; argmax picks 0
    draft = torch.tensor([[2.0, 2.0, 0.0], [2.0, 2.0, 0.0]])
    target = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    signed = signed_margins(draft, target)
    assert signed.agree.tolist() == [True, False]
    assert torch.equal(signed.margin, torch.zeros(2))


def test_per_token_kl_is_zero_for_identical_logits_and_matches_the_closed_form():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(per_token_kl(logits, logits), torch.zeros(4), atol=1e-6)
    # p = softmax([0, log 3]) = (1/4, 3/4), q = softmax([0, 0]) = (1/2, 1/2)
    target = torch.tensor([[0.0, math.log(3.0)]])
    draft = torch.tensor([[0.0, 0.0]])
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert torch.allclose(per_token_kl(draft, target), torch.tensor([forward]))
    # the argument order is (draft, target): swapping gives KL(q || p), a different number
    assert torch.allclose(per_token_kl(target, draft), torch.tensor([reverse]))
    assert not math.isclose(forward, reverse, rel_tol=1e-3)


def test_per_token_kl_is_the_losses_forward_kl_in_fp32():
    gen = torch.Generator().manual_seed(1)
    draft, target = torch.randn(6, 17, generator=gen), torch.randn(6, 17, generator=gen) * 3
    assert torch.equal(per_token_kl(draft, target), forward_kl(target, draft))
    assert per_token_kl(draft.half(), target.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize(
    ("draft", "target", "message"),
    [
        (torch.zeros(3, 5), torch.zeros(3, 6), "vocabularies differ: draft V = 5, target V = 6"),
        (torch.zeros(3, 5), torch.zeros(4, 5), "different positions: draft 3 rows, target 4 rows"),
        (torch.zeros(0, 5), torch.zeros(0, 5), "draft_logits has no positions"),
        (torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), r"draft_logits must be \(N, V\)"),
    ],
)
def test_bad_logit_pairs_name_the_problem(draft, target, message):
    with pytest.raises(ValueError, match=message):
        signed_margins(draft, target)
    with pytest.raises(ValueError, match=message):
        per_token_kl(draft, target)


def test_a_margin_needs_two_vocabulary_entries_and_a_position():
    with pytest.raises(ValueError, match="at least 2 vocabulary entries"):
        top2_margin(torch.zeros(3, 1))
    with pytest.raises(ValueError, match="at least 2 vocabulary entries"):
        signed_margins(torch.zeros(3, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="logits has no positions"):
        top2_margin(torch.zeros(0, 4))


def test_summarise_gives_plain_numbers_with_interpolated_quantiles():
    summary = summarise(torch.tensor([3.0, -1.0, 1.0, 0.0, 2.0]))
    assert summary["count"] == 5 and isinstance(summary["count"], int)
    expected = {"mean": 1.0, "median": 1.0, "p10": -0.6, "p90": 2.6, "fraction_positive": 0.6}
    for key, value in expected.items():
        assert isinstance(summary[key], float)
        assert summary[key] == pytest.approx(value), key
    assert json.loads(json.dumps(summary)) == summary
    even = summarise([4.0, 1.0, 3.0, 2.0])
    assert even["median"] == pytest.approx(2.5) and even["fraction_positive"] == 1.0
    single = summarise([-2.0])
    assert single["p10"] == single["p90"] == single["median"] == -2.0 and single["fraction_positive"] == 0.0


def test_summarise_matches_torch_quantile():
    values = torch.randn(101, generator=torch.Generator().manual_seed(2))
    summary = summarise(values)
    reference = torch.quantile(values.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    assert [summary["p10"], summary["median"], summary["p90"]] == pytest.approx(reference.tolist())


def test_summarise_rejects_empty_nan_and_unflattened_values():
    with pytest.raises(ValueError, match="got no values"):
        summarise([])
    with pytest.raises(ValueError, match="NaN"):
        summarise([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"takes \(N,\) values"):
        summarise(torch.zeros(2, 3))


def test_margin_summary_counts_and_means():
    summary = margin_summary(signed_margins(DRAFT, TARGET))  # margins 2, -3, 1
    assert summary == {
        "positive_fraction": pytest.approx(2 / 3),
        "mean_positive_margin": pytest.approx(1.5),
        "mean_negative_margin": pytest.approx(-3.0),
        "agree_count": 2,
        "disagree_count": 1,
    }
    all_agree = margin_summary(
        SignedMargins(agree=torch.tensor([True, True]), margin=torch.tensor([0.5, 0.0]))
    )
    assert all_agree["mean_negative_margin"] is None
    assert all_agree["positive_fraction"] == 0.5 and all_agree["mean_positive_margin"] == 0.5
    assert (all_agree["agree_count"], all_agree["disagree_count"]) == (2, 0)
    json.dumps(all_agree)


def test_margin_summary_and_signed_margins_reject_bad_input():
    with pytest.raises(ValueError, match="no positions"):
        margin_summary(SignedMargins(agree=torch.zeros(0, dtype=torch.bool), margin=torch.zeros(0)))
    with pytest.raises(ValueError, match="of the same length"):
        SignedMargins(agree=torch.tensor([True]), margin=torch.zeros(2))
    with pytest.raises(ValueError, match="bool tensor"):
        SignedMargins(agree=torch.tensor([1]), margin=torch.zeros(1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", "digits_operators"),
        (" +", "digits_operators"),
        ("==", "digits_operators"),
        (" (", "digits_operators"),
        ("def", "keyword"),
        (" None", "keyword"),
        (" foo", "identifier"),
        ("x1", "identifier"),
        ("é", "identifier"),  # str.isidentifier accepts non-ASCII letters
        ("\n    ", "whitespace"),
        ("\t", "whitespace"),
        ("", "other"),
        (".", "other"),
        ("foo(", "other"),
        ("1x", "other"),
        ("\ufffd", "other"),  # a partial UTF-8 byte decoded alone
    ],
)
def test_token_class(text, expected):
    assert token_class(text) == expected


def test_kept_dropped_by_class_counts_per_class_in_class_order():
    texts = ["12", " +", "def", " foo", "\n    ", "é", "==", "."]
    kept = [True, False, True, False, False, True, True, False]
    result = kept_dropped_by_class(texts, kept)
    assert list(result) == list(TOKEN_CLASSES)
    assert result["digits_operators"] == {"kept": 2, "dropped": 1, "kept_fraction": pytest.approx(2 / 3)}
    assert result["keyword"] == {"kept": 1, "dropped": 0, "kept_fraction": 1.0}
    assert result["identifier"] == {"kept": 1, "dropped": 1, "kept_fraction": 0.5}
    assert result["whitespace"] == {"kept": 0, "dropped": 1, "kept_fraction": 0.0}
    assert result["other"] == {"kept": 0, "dropped": 1, "kept_fraction": 0.0}
    assert kept_dropped_by_class(texts, torch.tensor(kept)) == result
    # classes that do not occur are left out
    assert list(kept_dropped_by_class(["def", "12"], [True, False])) == ["digits_operators", "keyword"]


def test_kept_dropped_by_class_rejects_bad_input():
    with pytest.raises(ValueError, match="token_texts has 2 entries but kept has 1"):
        kept_dropped_by_class(["a", "b"], [True])
    with pytest.raises(ValueError, match="no tokens"):
        kept_dropped_by_class([], [])
    with pytest.raises(ValueError, match="Python bools, got int"):
        kept_dropped_by_class(["a", "b"], [1, 0])
    with pytest.raises(ValueError, match=r"\(N,\) bool tensor"):
        kept_dropped_by_class(["a", "b"], torch.tensor([1, 0]))


def test_acceptance_is_one_for_the_targets_own_logits_and_the_overlap_otherwise():
    from specdistill.diagnostics.positions import position_diagnostics

    target = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    same = position_diagnostics(target.clone(), target)
    assert torch.allclose(same.acceptance, torch.ones(2))
    # a draft that cannot propose token 2 (an EAGLE-3 vocabulary): q = (0.5, 0.5, 0) in every row
    draft = torch.tensor([[0.0, 0.0, -math.inf], [0.0, 0.0, -math.inf]])
    restricted = position_diagnostics(draft, target)
    assert torch.allclose(restricted.acceptance, torch.tensor([0.5 + 0.3, 0.1 + 0.1]))
