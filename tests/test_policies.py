"""Draft-length policies: configs, validation, their rules, and their behaviour inside the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdistill.decoding.engine import SpeculativeDecoder
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import (
    ConfidenceThreshold,
    DraftPolicy,
    DraftStep,
    EntropyThreshold,
    FixedLength,
    HeuristicSchedule,
    Oracle,
    entropy,
)
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.toy import toy_pair
from specdistill.models.acceptance_head import AcceptanceHead
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

CONF = Path(__file__).resolve().parents[1] / "conf" / "policy"
V = 48
GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def pair():
    return toy_pair(V)


def _step(index: int = 1, token: int = 0, probs: list[float] | None = None, will_accept: bool | None = None):
    probs_t = torch.tensor(probs if probs is not None else [1.0, 0.0])
    return DraftStep(index=index, token=token, draft_probs=probs_t, will_accept=will_accept)


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fixed", FixedLength),
        ("heuristic", HeuristicSchedule),
        ("confidence", ConfidenceThreshold),
        ("entropy", EntropyThreshold),
        ("oracle", Oracle),
    ],
)
def test_every_policy_config_builds_its_policy(name, cls):
    policy = instantiate(OmegaConf.load(CONF / f"{name}.yaml"))
    assert type(policy) is cls and isinstance(policy, DraftPolicy)


def _every_policy() -> list[DraftPolicy]:
    return [
        FixedLength(3),
        HeuristicSchedule(),
        ConfidenceThreshold(),
        EntropyThreshold(),
        Oracle(),
        AcceptanceHeadPolicy(AcceptanceHead(8, num_blocks=1)),
    ]


def test_policies_declare_no_upper_bound():
    # the engine owns the most candidates per round; the only bound a policy declares is its minimum
    for policy in _every_policy():
        assert not hasattr(policy, "max_draft_length"), type(policy).__name__
        assert isinstance(policy.min_draft_length, int) and policy.min_draft_length >= 1
    assert (
        AcceptanceHeadPolicy(AcceptanceHead(8, num_blocks=1)).min_draft_length == 2
    )  # public SpecDec++ code
    assert AcceptanceHeadPolicy(AcceptanceHead(8, num_blocks=1), min_draft_length=1).min_draft_length == 1
    for cls in (HeuristicSchedule, ConfidenceThreshold, EntropyThreshold, Oracle):
        with pytest.raises(TypeError):
            cls(max_draft_length=20)


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: FixedLength(0), "k"),
        (lambda: FixedLength(2.5), "k"),
        (lambda: HeuristicSchedule(initial=0), "initial"),
        (lambda: ConfidenceThreshold(0.0), "threshold"),
        (lambda: ConfidenceThreshold(1.5), "threshold"),
        (lambda: EntropyThreshold(0.0), "threshold"),
        (lambda: EntropyThreshold(-1.0), "threshold"),
        (lambda: AcceptanceHeadPolicy(AcceptanceHead(8, 1), min_draft_length=0), "min_draft_length"),
    ],
)
def test_policies_validate_their_options(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------------------------------- rules


def test_fixed_length_drafts_k():
    policy = FixedLength(3)
    assert [policy.should_stop(_step(i)) for i in (1, 2, 3, 4)] == [False, False, True, True]


def test_heuristic_schedule_follows_transformers_rule():
    policy = HeuristicSchedule(initial=3)
    policy.reset(6)  # the engine's bound: the schedule stops growing there
    lengths = []
    for drafted_all in (True, True, False, False, False, False, True):
        lengths.append(policy.current)
        policy.end_round(policy.current, policy.current if drafted_all else 0)
    assert lengths == [3, 5, 6, 5, 4, 3, 2]  # +2 capped at the engine's 6, then -1 per partial round
    policy.current = 1
    policy.end_round(1, 0)
    assert policy.current == 1  # never below 1
    policy.reset(6)
    assert policy.current == 3  # transient: every sequence restarts
    persistent = HeuristicSchedule(initial=3, persistent=True)
    persistent.end_round(3, 3)
    persistent.reset()
    assert persistent.current == 5
    unbounded = HeuristicSchedule(initial=3)
    unbounded.reset()  # no engine bound: transformers' rule, no cap
    for _ in range(10):
        unbounded.end_round(unbounded.current, unbounded.current)
    assert unbounded.current == 23
    persistent.reset(4)  # a persistent length above the next engine's bound starts at that bound
    assert persistent.current == 4


def test_confidence_threshold_stops_on_low_probability_of_own_token():
    policy = ConfidenceThreshold(0.4)
    assert not policy.should_stop(_step(token=0, probs=[0.6, 0.4]))
    assert policy.should_stop(_step(token=1, probs=[0.65, 0.35]))


def test_entropy_threshold_stops_on_spread_distribution():
    policy = EntropyThreshold(threshold=0.5)
    assert not policy.should_stop(_step(probs=[0.95, 0.05]))  # 0.199 nats
    assert policy.should_stop(_step(probs=[0.5, 0.5]))  # log 2 = 0.693 nats
    torch.testing.assert_close(entropy(torch.tensor([0.25] * 4)), torch.tensor(1.3862944))
    assert float(entropy(torch.tensor([1.0, 0.0]))) == 0.0  # 0 log 0 = 0, not NaN


def test_oracle_stops_at_the_first_rejected_candidate():
    policy = Oracle()
    assert policy.needs_oracle and policy.withdraws_stop
    assert not policy.should_stop(_step(will_accept=True))
    assert policy.should_stop(_step(will_accept=False))
    with pytest.raises(ValueError, match="will_accept"):
        policy.should_stop(_step())


# ---------------------------------------------------------------------------------------------- inside the engine


class _LengthRecorder(DraftPolicy):
    """Wraps a policy and records the number of candidates drafted in each round."""

    def __init__(self, inner: DraftPolicy) -> None:
        self.inner = inner
        self.min_draft_length = inner.min_draft_length
        self.lengths: list[int] = []

    def reset(self, max_draft_length: int | None = None) -> None:
        self.inner.reset(max_draft_length)

    def begin_round(self) -> None:
        self.inner.begin_round()

    def should_stop(self, step: DraftStep) -> bool:
        return self.inner.should_stop(step)

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        self.lengths.append(num_drafted)
        self.inner.end_round(num_drafted, num_accepted)


def test_heuristic_schedule_grows_when_everything_is_accepted(pair):
    target, _ = pair
    recorder = _LengthRecorder(HeuristicSchedule(initial=2))
    SpeculativeDecoder(target, target, recorder, GREEDY, None, V, max_draft_length=7).generate([1, 2, 3], 40)
    # all accepted with a self-draft: 2, 4, 6, then the cap; the last round is cut by the token budget
    assert recorder.lengths == [2, 4, 6, 7, 7, 7, 0]
    assert sum(n + 1 for n in recorder.lengths) == 40


def test_confidence_threshold_sets_draft_lengths(pair):
    target, draft = pair
    always = _LengthRecorder(ConfidenceThreshold(1.0))  # p < 1 always: one candidate
    never = _LengthRecorder(ConfidenceThreshold(1e-9))
    for recorder in (always, never):
        SpeculativeDecoder(target, draft, recorder, GREEDY, None, V, max_draft_length=5).generate([3, 9], 20)
    # (a round of 0 candidates happens when only one token of the budget is left)
    assert set(always.lengths) - {0} == {1}
    assert never.lengths[:3] == [5, 5, 5]  # (later rounds may be cut short by the 20-token budget)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "sampling"])
def test_oracle_drafts_only_accepted_candidates(pair, sampling):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, Oracle(), sampling, None, V, max_draft_length=8)
    gen = torch.Generator().manual_seed(0)
    stats = [decoder.generate(p, 24, gen).stats for p in ([1, 2, 3], [30, 4], [7])]
    assert sum(s.drafted_tokens for s in stats) > 0
    for s in stats:
        assert s.accepted_tokens == s.drafted_tokens
        assert s.rejected_tokens == 0 and s.metrics()["discard_rate"] == 0.0
        assert s.target_forwards == s.rounds  # the probe's target passes are not counted
        assert s.oracle_probe_time_s > 0  # ... nor timed: their time is reported apart
        assert s.generated_tokens == 24


def test_oracle_needs_fewest_target_calls_in_greedy_mode(pair):
    target, draft = pair
    oracle = SpeculativeDecoder(target, draft, Oracle(), GREEDY, None, V, max_draft_length=8)
    others = [FixedLength(1), FixedLength(3), FixedLength(8), HeuristicSchedule(4)]
    for prompt in ([1, 2, 3], [30, 4], [7, 7, 7, 7]):
        best = oracle.generate(prompt, 30).stats.target_forwards
        for policy in others:
            decoder = SpeculativeDecoder(target, draft, policy, GREEDY, None, V, max_draft_length=8)
            calls = decoder.generate(prompt, 30)
            assert best <= calls.stats.target_forwards, type(policy).__name__


class _AlwaysStop(DraftPolicy):
    """Says stop at every candidate and records where it was asked."""

    def __init__(self, min_draft_length: int) -> None:
        self.min_draft_length = min_draft_length
        self.asked: list[int] = []

    def should_stop(self, step: DraftStep) -> bool:
        self.asked.append(step.index)
        return True


def test_engine_asks_every_candidate_and_ignores_stops_before_the_minimum(pair):
    target, draft = pair
    policy = _AlwaysStop(min_draft_length=3)
    recorder = _LengthRecorder(policy)
    SpeculativeDecoder(target, draft, recorder, GREEDY, None, V, max_draft_length=6).generate([5, 6], 12)
    # asked at 1 and 2 too (the answer is ignored there), and drafting ends at the minimum
    assert policy.asked[:3] == [1, 2, 3] and set(policy.asked) == {1, 2, 3}
    assert set(recorder.lengths) <= {3, 2, 1, 0}  # 3, or fewer only where the token budget cuts the round
    assert recorder.lengths[0] == 3


def test_engine_validates_the_bounds(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="min_draft_length"):
        SpeculativeDecoder(target, draft, _AlwaysStop(7), GREEDY, None, V, max_draft_length=6)
    with pytest.raises(ValueError, match="min_draft_length"):
        SpeculativeDecoder(target, draft, _AlwaysStop(0), GREEDY, None, V)
    with pytest.raises(ValueError, match="max_draft_length"):
        SpeculativeDecoder(target, draft, FixedLength(2), GREEDY, None, V, max_draft_length=0)
