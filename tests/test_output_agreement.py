"""Greedy outputs against the target's (`specdistill.evaluation.agreement`): identical outputs are counted, a
departure is found at its first token and measured by the target's top-two gap there, and a near tie (what rounding
in a low-precision dtype explains) is told apart from a real loss of exactness."""

from __future__ import annotations

import pytest
import torch

from specdistill.decoding.engine import autoregressive
from specdistill.evaluation.agreement import (
    NEAR_TIE_ULPS,
    first_difference,
    format_agreement,
    output_agreement,
    top_two_gap,
    ulp,
)
from tests.test_architectures import PROMPT, tiny_pair
from tests.test_engine import GREEDY
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 32
NEW = 12


def test_first_difference_finds_the_first_parting_token_or_an_early_end():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], []) is None


def test_ulp_is_the_spacing_of_the_dtype_at_the_value():
    assert ulp(1.0, torch.bfloat16) == 2**-7 and ulp(20.0, torch.bfloat16) == 2**-3
    assert ulp(-20.0, torch.float32) == 2**-19
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        value = torch.tensor(13.7, dtype=dtype)
        step = torch.nextafter(value, torch.tensor(100.0, dtype=dtype)) - value
        assert float(step) == ulp(float(value), dtype)
    assert 0 < ulp(0.0, torch.float32) < 1e-40


def _case():
    """A tiny target in which tokens `a` and `b` have the same output row, so their logits tie exactly everywhere,
    its greedy output on PROMPT (which holds `a` or `b`), and the first position of one of them."""
    target, _ = tiny_pair("llama", V)
    tokens = autoregressive(target, PROMPT, NEW, GREEDY, None, V).tokens
    a = tokens[2]
    b = (a + 1) % V
    with torch.no_grad():
        target.lm_head.weight[b] = target.lm_head.weight[a]
    tokens = autoregressive(target, PROMPT, NEW, GREEDY, None, V).tokens
    position = next(i for i, t in enumerate(tokens) if t in (a, b))
    return target, tokens, position, a, b


def test_a_departure_at_a_tie_is_a_near_tie_and_one_elsewhere_is_not():
    target, tokens, tie, a, b = _case()
    at_tie = list(tokens)
    at_tie[tie] = b if tokens[tie] == a else a  # the other half of the tie
    elsewhere = list(tokens)
    other = next(i for i, t in enumerate(tokens) if t not in (a, b))
    elsewhere[other] = (
        (tokens[other] + 7) % V if (tokens[other] + 7) % V not in (a, b) else (tokens[other] + 9) % V
    )
    prompts = [{"prompt_ids": PROMPT, "example_id": i} for i in range(3)]
    reference = [{"tokens": tokens}] * 3
    result = output_agreement(
        target, prompts, reference, [{"tokens": tokens}, {"tokens": at_tie}, {"tokens": elsewhere}], V
    )
    assert (result["outputs"], result["identical"], result["near_ties"]) == (3, 1, 1)
    tie_row, far_row = result["departures"]
    assert (tie_row["example_id"], tie_row["position"], tie_row["gap"], tie_row["near_tie"]) == (
        1,
        tie,
        0.0,
        True,
    )
    assert far_row["example_id"] == 2 and far_row["position"] == other and not far_row["near_tie"]
    # the gap is the target's own after the common prefix, in ulps of its best logit
    gap, ulps = top_two_gap(target, [*PROMPT, *tokens[:other]], V)
    assert far_row["gap"] == gap > 0 and far_row["ulps"] == ulps > NEAR_TIE_ULPS
    text = format_agreement(
        {"x/fixed_k2": result, "y/fixed_k2": {**result, "identical": 3, "departures": []}}, torch.float32
    )
    assert (
        text.splitlines()[0]
        == "greedy outputs identical to the target's (float32): 1 of 2 configurations on all 3 prompts"
    )
    assert text.splitlines()[1].startswith("  x/fixed_k2: 1/3 identical; 1 of 2 departures at near ties")


def test_outputs_of_other_prompts_are_refused():
    target, tokens, *_ = _case()
    with pytest.raises(ValueError, match="same prompts"):
        output_agreement(target, [{"prompt_ids": PROMPT, "example_id": 0}], [], [{"tokens": tokens}], V)
