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


def test_head_policy_config_loads_a_saved_head(tmp_path):
    AcceptanceHead(16, num_blocks=1).save(tmp_path / "head")
    cfg = OmegaConf.load(CONF / "head.yaml")
    cfg.head_dir = str(tmp_path / "head")
    policy = instantiate(cfg)
    assert isinstance(policy, AcceptanceHeadPolicy) and policy.needs_hidden_states


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: FixedLength(0), "k"),
        (lambda: FixedLength(2.5), "k"),
        (lambda: HeuristicSchedule(initial=0), "initial"),
        (lambda: HeuristicSchedule(initial=8, max_draft_length=4), "initial"),
        (lambda: ConfidenceThreshold(0.0), "threshold"),
        (lambda: ConfidenceThreshold(1.5), "threshold"),
        (lambda: ConfidenceThreshold(0.4, max_draft_length=0), "max_draft_length"),
        (lambda: EntropyThreshold(0.0), "threshold"),
        (lambda: EntropyThreshold(-1.0), "threshold"),
        (lambda: Oracle(0), "max_draft_length"),
    ],
)
def test_policies_validate_their_options(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------------------------------- rules


def test_fixed_length_drafts_k():
    policy = FixedLength(3)
    assert policy.max_draft_length == 3
    assert [policy.should_stop(_step(i)) for i in (1, 2, 3)] == [False, False, True]


def test_heuristic_schedule_follows_transformers_rule():
    policy = HeuristicSchedule(initial=3, max_draft_length=6)
    policy.reset()
    lengths = []
    for drafted_all in (True, True, False, False, False, False, True):
        lengths.append(policy.current)
        policy.end_round(policy.current, policy.current if drafted_all else 0)
    assert lengths == [3, 5, 6, 5, 4, 3, 2]  # +2 capped at 6, then -1 per partial round
    policy.current = 1
    policy.end_round(1, 0)
    assert policy.current == 1  # never below 1
    policy.reset()
    assert policy.current == 3  # transient: every sequence restarts
    persistent = HeuristicSchedule(initial=3, persistent=True)
    persistent.end_round(3, 3)
    persistent.reset()
    assert persistent.current == 5


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
    policy = Oracle(5)
    assert policy.needs_oracle and policy.withdraw_rejected
    assert not policy.should_stop(_step(will_accept=True))
    assert policy.should_stop(_step(will_accept=False))
    with pytest.raises(ValueError, match="will_accept"):
        policy.should_stop(_step())


# ---------------------------------------------------------------------------------------------- inside the engine


class _LengthRecorder(DraftPolicy):
    """Wraps a policy and records the number of candidates drafted in each round."""

    def __init__(self, inner: DraftPolicy) -> None:
        self.inner = inner
        self.max_draft_length = inner.max_draft_length
        self.lengths: list[int] = []

    def reset(self) -> None:
        self.inner.reset()

    def begin_round(self) -> None:
        self.inner.begin_round()

    def should_stop(self, step: DraftStep) -> bool:
        return self.inner.should_stop(step)

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        self.lengths.append(num_drafted)
        self.inner.end_round(num_drafted, num_accepted)


def test_heuristic_schedule_grows_when_everything_is_accepted(pair):
    target, _ = pair
    recorder = _LengthRecorder(HeuristicSchedule(initial=2, max_draft_length=7))
    SpeculativeDecoder(target, target, recorder, GREEDY, None, V).generate([1, 2, 3], 40)
    # all accepted with a self-draft: 2, 4, 6, then the cap; the last round is cut by the token budget
    assert recorder.lengths == [2, 4, 6, 7, 7, 7, 0]
    assert sum(n + 1 for n in recorder.lengths) == 40


def test_confidence_threshold_sets_draft_lengths(pair):
    target, draft = pair
    always = _LengthRecorder(ConfidenceThreshold(1.0, max_draft_length=5))  # p < 1 always: one candidate
    never = _LengthRecorder(ConfidenceThreshold(1e-9, max_draft_length=5))
    for recorder in (always, never):
        SpeculativeDecoder(target, draft, recorder, GREEDY, None, V).generate([3, 9], 20)
    # (a round of 0 candidates happens when only one token of the budget is left)
    assert set(always.lengths) - {0} == {1}
    assert never.lengths[:3] == [5, 5, 5]  # (later rounds may be cut short by the 20-token budget)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "sampling"])
def test_oracle_drafts_only_accepted_candidates(pair, sampling):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, Oracle(8), sampling, None, V)
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
    oracle = SpeculativeDecoder(target, draft, Oracle(8), GREEDY, None, V)
    others = [FixedLength(1), FixedLength(3), FixedLength(8), HeuristicSchedule(4, max_draft_length=8)]
    for prompt in ([1, 2, 3], [30, 4], [7, 7, 7, 7]):
        best = oracle.generate(prompt, 30).stats.target_forwards
        for policy in others:
            calls = SpeculativeDecoder(target, draft, policy, GREEDY, None, V).generate(prompt, 30)
            assert best <= calls.stats.target_forwards, type(policy).__name__


def test_engine_honours_min_draft_length(pair):
    target, draft = pair
    asked: list[int] = []

    class AlwaysStop(DraftPolicy):
        min_draft_length = 3
        max_draft_length = 6

        def should_stop(self, step: DraftStep) -> bool:
            asked.append(step.index)
            return True

    recorder = _LengthRecorder(AlwaysStop())
    recorder.min_draft_length = 3
    SpeculativeDecoder(target, draft, recorder, GREEDY, None, V).generate([5, 6], 12)
    assert set(asked) == {3}
    assert set(recorder.lengths) <= {3, 2, 1, 0}  # 3, or fewer only where the token budget cuts the round
