"""The target's verification cost (`specdistill.decoding.cost`): each timed pass verifies exactly `n` new tokens after
the same cached context, the curve is relative to one token, and tokens per unit of cost divide tokens per call at K
by the cost of K + 1 tokens; the curve is kept per target, hardware and dtype across runs, and `CostPadded` moves a
policy's stop to the most candidates the target verifies at no more cost."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.decoding.cost import (
    cached_verification_cost,
    measure_verification_cost,
    padded_length,
    relative_cost,
    tokens_per_cost,
)
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import ConfidenceThreshold, CostPadded, DraftPolicy, DraftStep, Oracle
from specdistill.evaluation.offline import format_cost
from specdistill.models.acceptance_head import AcceptanceHead
from tests.test_architectures import tiny_pair
from tests.test_engine import BUMPY_COST
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 32


def test_every_pass_verifies_n_tokens_after_the_same_context():
    target, _ = tiny_pair("llama", V)
    seen: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        seen.append((kwargs["input_ids"].shape[1], 0 if cache is None else int(cache.get_seq_length())))

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        seconds = measure_verification_cost(target, [1, 3, 5], context_length=7, repeats=2)
    finally:
        handle.remove()
    assert sorted(seconds) == [1, 3, 5] and all(s > 0 for s in seconds.values())
    # the prefill, then (1 untimed + 2 timed) x (1, 3, 5), each after the 7 cached tokens: the cache is cropped back
    assert seen == [(7, 0)] + [(n, 7) for _ in range(3) for n in (1, 3, 5)]


def test_bad_lengths_are_refused():
    target, _ = tiny_pair("llama", V)
    for lengths in ([], [0, 1], [1.5]):
        with pytest.raises(ValueError, match="lengths"):
            measure_verification_cost(target, lengths)
    with pytest.raises(ValueError, match="context_length"):
        measure_verification_cost(target, [1], context_length=0)


def test_the_curve_is_relative_to_one_token_and_tokens_per_cost_divide_by_k_plus_one():
    assert relative_cost({1: 0.02, 2: 0.025, 4: 0.04}) == pytest.approx({1: 1.0, 2: 1.25, 4: 2.0})
    with pytest.raises(ValueError, match="lack 1"):
        relative_cost({2: 0.1})
    cost = {1: 1.0, 2: 1.1, 3: 1.5, 4: 1.2}
    # K = 3 verifies 4 tokens: 2.4 / 1.2; K = 4 has no measured cost of 5 tokens; K = 1's figure is missing
    assert tokens_per_cost({1: None, 2: 1.65, 3: 2.4, 4: 2.6}, cost) == pytest.approx({2: 1.1, 3: 2.0})
    lines = format_cost(cost, {"prompt_lookup": {1: None, 2: 1.65, 3: 2.4}, "none": {1: None}}).splitlines()
    assert lines[0].startswith("target verification cost") and "n=3 1.50" in lines[0]
    assert lines[1:] == [f"  {'prompt_lookup':<28} tokens per unit of target cost, best K=3: 2.000"]


def test_a_bfloat16_target_is_timed_in_bfloat16():
    target, _ = tiny_pair("llama", V)
    target = target.to(torch.bfloat16)
    seen = []
    handle = target.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    try:
        measure_verification_cost(target, [1, 2], context_length=4, repeats=1)
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}


def _count_forwards(target) -> list[int]:
    calls: list[int] = []
    target.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_the_curve_is_measured_once_per_target_and_dtype_and_read_back(tmp_path):
    target, _ = tiny_pair("llama", V)
    calls = _count_forwards(target)
    first = cached_verification_cost(target, [1, 2, 3], 6, tmp_path)
    measured = len(calls)
    assert measured > 0 and first[1] == 1.0 and sorted(first) == [1, 2, 3]
    (written,) = tmp_path.iterdir()
    assert cached_verification_cost(target, [1, 2, 3], 6, tmp_path) == first
    assert len(calls) == measured  # read back: the target ran no pass
    # fewer counts: read from the same file; more counts: all of them measured again together, one file still
    assert cached_verification_cost(target, [1, 3], 6, tmp_path) == {1: 1.0, 3: first[3]}
    assert len(calls) == measured
    wider = cached_verification_cost(target, [1, 5], 6, tmp_path)
    assert len(calls) > measured and sorted(wider) == [1, 5]
    assert (
        sorted(json.loads(written.read_text())) == ["1", "2", "3", "5"] and len(list(tmp_path.iterdir())) == 1
    )
    # another context or another dtype are other curves: measured again, each in its own file
    cached_verification_cost(target, [1, 2, 3], 9, tmp_path)
    cached_verification_cost(target.to(torch.bfloat16), [1, 2, 3], 6, tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    # no cache: measured on every call
    before = len(calls)
    cached_verification_cost(target, [1, 2], 6, None)
    assert len(calls) > before and len(list(tmp_path.iterdir())) == 3
    assert written.exists()


def test_a_cached_file_that_is_no_curve_is_refused_naming_it(tmp_path):
    target, _ = tiny_pair("llama", V)
    cached_verification_cost(target, [1, 2], 6, tmp_path)
    (path,) = tmp_path.iterdir()
    for text in ("not json", '{"1": 2.0, "2": 1.5}', '{"1": 1.0, "2": -1}', "[1, 2]"):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path.name}.*delete it"):
            cached_verification_cost(target, [1, 2], 6, tmp_path)


# a float32 curve of the kind measured on a 2-core CPU: 3 tokens cost more than 4, 5 or 6
BUMPY = BUMPY_COST


def test_a_stop_is_padded_to_the_most_candidates_that_cost_no_more():
    assert padded_length(2, BUMPY, 6) == 5  # 3 tokens cost 2.0; 4, 5 and 6 cost less, 7 more
    assert padded_length(1, BUMPY, 6) == 4  # 2 tokens cost 1.6: 4 cost 1.5 and 5 cost 1.6 (no more)
    assert padded_length(1, BUMPY, 2) == 1  # the cap
    assert padded_length(3, BUMPY, 6) == 3  # 4 tokens are the cheapest from there
    assert padded_length(6, BUMPY, 9) == 6  # the table ends at 7 tokens
    assert padded_length(9, BUMPY, 12) == 9  # no cost of 10 tokens: left as it is
    smooth = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}
    assert all(padded_length(k, smooth, 8) == k for k in range(1, 9))


class _Asked(DraftPolicy):
    """Stops at candidate `at`; records every candidate it was asked about."""

    def __init__(self, at: int, min_draft_length: int = 1) -> None:
        self.at, self.min_draft_length, self.asked = at, min_draft_length, []

    def should_stop(self, step: DraftStep) -> bool:
        self.asked.append(step.index)
        return step.index >= self.at


def _round(policy: DraftPolicy, cap: int) -> int:
    """Drafted candidates of one round as the engine decides them (min_draft_length, the cap)."""
    policy.begin_round()
    for index in range(1, cap + 1):
        step = DraftStep(index=index, token=0, draft_probs=torch.ones(V) / V)
        if policy.should_stop(step) and index >= policy.min_draft_length:
            return index
    return cap


def test_cost_padded_asks_its_policy_until_it_stops_then_drafts_on_to_the_padded_length():
    inner = _Asked(at=2)
    padded = CostPadded(inner, BUMPY)
    padded.reset(max_draft_length=6)
    assert _round(padded, 6) == 5 and inner.asked == [1, 2]
    inner.asked.clear()
    padded.reset(max_draft_length=3)  # the engine's bound caps the padding
    assert _round(padded, 3) == 3 and inner.asked == [1, 2]
    # a stop the engine would ignore (before min_draft_length) is not padded either
    early = CostPadded(_Asked(at=1, min_draft_length=2), BUMPY)
    early.reset(6)
    assert early.min_draft_length == 2 and _round(early, 6) == 5
    # a curve that only rises leaves every stop where it was
    smooth = CostPadded(ConfidenceThreshold(0.9), {n: float(n) for n in range(1, 8)})
    smooth.reset(6)
    assert _round(smooth, 6) == 1
    with pytest.raises(ValueError, match="oracle"):
        CostPadded(Oracle(), BUMPY)
    withdrawing = AcceptanceHeadPolicy(AcceptanceHead(4, 1, input="proposer"), withdraw=True)
    with pytest.raises(ValueError, match="withdraw=True"):
        CostPadded(withdrawing, BUMPY)
    with pytest.raises(ValueError, match="n = 1"):
        CostPadded(ConfidenceThreshold(0.5), {2: 1.0})
