"""Speculative-decoding engine: sampling warpers, losslessness (greedy and sampling), caches, EOS, budget, stats."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdistill.decoding import engine
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import (
    ConfidenceThreshold,
    CostPadded,
    DraftPolicy,
    EntropyThreshold,
    FixedLength,
    HeuristicSchedule,
    Oracle,
)
from specdistill.decoding.sampling import SamplingConfig, warp_logits, warp_probs
from specdistill.decoding.stats import DecodingStats, speedup
from specdistill.decoding.toy import toy_pair
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.models.cache import forward_with_cache
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution, two_token_counts
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 48
GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def pair():
    return toy_pair(V)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, V, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]


BUMPY_COST = {1: 1.0, 2: 1.6, 3: 2.0, 4: 1.5, 5: 1.6, 6: 1.9, 7: 2.2}


def _all_policies(draft) -> dict[str, tuple[DraftPolicy, int]]:
    """name -> (policy, the engine's max_draft_length to run it with)."""
    torch.manual_seed(0)
    head = AcceptanceHead(draft.config.hidden_size, num_blocks=2)
    proposer = AcceptanceHead(draft.config.hidden_size, num_blocks=2, input="proposer")
    return {
        "fixed1": (FixedLength(1), 20),
        "fixed4": (FixedLength(4), 20),
        "heuristic": (HeuristicSchedule(initial=3), 8),
        "confidence": (ConfidenceThreshold(0.4), 20),
        "entropy": (EntropyThreshold(1.0), 20),
        "oracle": (Oracle(), 6),
        "head": (AcceptanceHeadPolicy(head, threshold=0.5), 6),
        "head_newest": (AcceptanceHeadPolicy(head, threshold=0.5, score_newest=True), 6),
        "head_proposer": (AcceptanceHeadPolicy(proposer, threshold=0.5), 6),
        # the candidate it stops on withdrawn: tested on the row before it, no bonus token after it
        "head_withdraw": (
            AcceptanceHeadPolicy(proposer, threshold=0.5, min_draft_length=1, withdraw=True),
            6,
        ),
        # its stops moved to where verifying more costs no more (3 tokens dearer than 4 to 6): more candidates only
        "head_padded": (CostPadded(AcceptanceHeadPolicy(head, threshold=0.5), BUMPY_COST), 6),
    }


# ---------------------------------------------------------------------------------------------- sampling warpers


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 10, 0.9), (1.0, 0, 0.5), (1.3, 5, 1.0)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(warp_probs(logits, temperature, top_k, top_p), ref.softmax(-1))


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.9]])
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(warp_probs(logits, temperature=0.0), expected)
    assert torch.equal(SamplingConfig(temperature=0.8, greedy=True).warp_probs(logits), expected)
    assert SamplingConfig(temperature=0).is_greedy and not SamplingConfig().is_greedy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


# ---------------------------------------------------------------------------------------------- greedy losslessness


def test_greedy_output_equals_target_greedy_for_every_policy(pair):
    target, draft = pair
    prompts = _prompts(5)
    references = [autoregressive(target, p, 20, GREEDY, None, V).tokens for p in prompts]
    rejections = 0
    for name, (policy, max_draft_length) in _all_policies(draft).items():
        decoder = SpeculativeDecoder(
            target, draft, policy, GREEDY, None, V, max_draft_length=max_draft_length
        )
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 20)
            assert result.tokens == reference, f"{name} diverged from the target's greedy output"
            rejections += result.stats.rejected_tokens
    assert rejections > 0  # the pair is related but not identical: rejections were exercised


def test_draft_equal_to_target_accepts_every_candidate(pair):
    target, _ = pair
    decoder = SpeculativeDecoder(target, target, FixedLength(3), GREEDY, None, V)
    stats = decoder.generate([3, 1, 4], 20).stats
    assert stats.accepted_tokens == stats.drafted_tokens == 15
    assert stats.metrics()["tokens_per_target_call"] == 4.0  # k + 1 per round: the bonus token is emitted
    sampler = SpeculativeDecoder(target, target, FixedLength(3), SamplingConfig(temperature=1.0), None, V)
    stats = sampler.generate([3, 1, 4], 20, torch.Generator().manual_seed(0)).stats
    assert stats.accepted_tokens == stats.drafted_tokens
    assert stats.metrics()["acceptance_rate"] == 1.0


# ---------------------------------------------------------------------------------------------- sampling losslessness

SMALL_V = 8
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
STAT_PROMPT = [1, 5, 2]


@pytest.fixture(scope="module")
def small_pair():
    # Seed and noise chosen so that p and q overlap about halfway (sum min(p, q) ~ 0.56 on the first token).
    return toy_pair(SMALL_V, hidden_size=16, num_heads=2, initializer_range=0.5, noise=1.0, seed=5)


def _is_lossless(target, draft, policy: DraftPolicy, samples: int = 400) -> bool:
    # max_new_tokens=2 with one candidate per round: the first token comes from acceptance or the residual, the
    # second from the bonus token (after an acceptance) or a plain target step (after a rejection).
    decoder = SpeculativeDecoder(target, draft, policy, SAMPLING, None, SMALL_V, max_draft_length=1)
    counts = two_token_counts(decoder, STAT_PROMPT, SMALL_V, samples)
    return matches_two_token_distribution(
        counts, exact_two_token_distribution(target, STAT_PROMPT, SAMPLING, SMALL_V)
    )


@pytest.mark.parametrize(
    "policy", ["fixed", "oracle", "head_candidate", "head_proposer", "head_withdraw", "head_withdraw_always"]
)
def test_sampling_matches_target_distribution(small_pair, policy):
    # head policies make the engine read the draft's hidden states (base model + LM head): q must not change
    hidden_size = small_pair[1].config.hidden_size
    policies = {
        "fixed": lambda: FixedLength(1),
        "oracle": lambda: Oracle(),
        "head_candidate": lambda: AcceptanceHeadPolicy(AcceptanceHead(hidden_size, 1), min_draft_length=1),
        "head_proposer": lambda: AcceptanceHeadPolicy(
            AcceptanceHead(hidden_size, 1, input="proposer"), min_draft_length=1
        ),
        "head_withdraw": lambda: AcceptanceHeadPolicy(
            AcceptanceHead(hidden_size, 1, input="proposer"), min_draft_length=1, withdraw=True
        ),
        # h = 0 stops on every candidate: each one is withdrawn and tested on the pending token's row
        "head_withdraw_always": lambda: AcceptanceHeadPolicy(
            AcceptanceHead(hidden_size, 1, input="proposer"), 0.0, min_draft_length=1, withdraw=True
        ),
    }
    assert _is_lossless(*small_pair, policies[policy]())


def test_distribution_test_catches_a_broken_residual(small_pair, monkeypatch):
    # The classic bug: resampling from p instead of norm(max(0, p - q)) after a rejection.
    monkeypatch.setattr(engine, "residual_distribution", lambda p, q: p)
    assert not _is_lossless(*small_pair, FixedLength(1))


def test_distribution_test_catches_a_swapped_residual(small_pair, monkeypatch):
    def swapped(p, q):
        mass = (q - p).clamp_min(0)
        return mass / mass.sum()

    monkeypatch.setattr(engine, "residual_distribution", swapped)
    assert not _is_lossless(*small_pair, FixedLength(1), samples=100)


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    torch.testing.assert_close(engine.residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(engine.residual_distribution(p, p), p)  # zero mass (no rejection possible): p


# ---------------------------------------------------------------------------------------------- caches, EOS, budget


def _assert_cache_matches_fresh_forward(model, tokens: torch.Tensor, cache, length: int) -> None:
    """Continuing `cache` (covering `length` tokens) gives the same next-token logits as a fresh full forward."""
    assert cache.get_seq_length() == length < tokens.shape[1]
    with torch.inference_mode():
        cached = forward_with_cache(model, tokens[:, length:], cache)[0].logits[0, -1]
        fresh = model(input_ids=tokens).logits[0, -1]
    torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "sampling"])
def test_caches_stay_consistent_after_rejections(pair, sampling):
    target, draft = pair
    for max_new_tokens, policy in ((17, FixedLength(4)), (23, HeuristicSchedule(3)), (20, Oracle())):
        decoder = SpeculativeDecoder(target, draft, policy, sampling, None, V, max_draft_length=5)
        result = decoder.generate(
            [7, 2, 9], max_new_tokens, torch.Generator().manual_seed(1), keep_state=True
        )
        assert result.stats.rejected_tokens + result.stats.rounds > 1
        state = result.state
        assert state.tokens.shape[1] == 3 + max_new_tokens
        _assert_cache_matches_fresh_forward(target, state.tokens, state.target_cache, state.target_length)
        _assert_cache_matches_fresh_forward(draft, state.tokens, state.draft_cache, state.draft_length)


@pytest.mark.parametrize("draft_is_target", [True, False], ids=["self_draft", "noisy_draft"])
def test_eos_stops_the_output_there(pair, draft_is_target):
    target, draft = pair
    draft = target if draft_is_target else draft
    prompt = [5, 11, 3]
    reference = autoregressive(target, prompt, 30, GREEDY, None, V).tokens
    eos = reference[9]
    expected = reference[: reference.index(eos) + 1]
    assert len(expected) >= 3
    ar = autoregressive(target, prompt, 30, GREEDY, eos, V)
    assert ar.tokens == expected
    decoder = SpeculativeDecoder(target, draft, FixedLength(6), GREEDY, [eos, V + 5], V)
    result = decoder.generate(prompt, 30)
    assert result.tokens == expected
    assert result.stats.generated_tokens == len(expected)


def test_max_new_tokens_is_respected(pair):
    target, draft = pair
    for max_new_tokens in (0, 1, 2, 5, 13):
        for policy in (FixedLength(4), Oracle()):
            decoder = SpeculativeDecoder(target, draft, policy, GREEDY, None, V, max_draft_length=8)
            result = decoder.generate([1, 2], max_new_tokens)
            assert len(result.tokens) == result.stats.generated_tokens == max_new_tokens
        assert len(autoregressive(target, [1, 2], max_new_tokens, GREEDY, None, V).tokens) == max_new_tokens


def test_bad_arguments_are_rejected(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="output rows"):
        SpeculativeDecoder(target, draft, FixedLength(2), GREEDY, None, V + 1)
    decoder = SpeculativeDecoder(target, draft, FixedLength(2), SamplingConfig(), None, V)
    with pytest.raises(ValueError, match="Generator"):
        decoder.generate([1, 2], 4)
    with pytest.raises(ValueError, match="prompt_ids"):
        decoder.generate([], 4, torch.Generator())
    with pytest.raises(ValueError, match=r"\[0, 48\)"):
        decoder.generate([1, V], 4, torch.Generator())
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([1, 2], -1, torch.Generator())
    with pytest.raises(ValueError, match="batch size 1"):
        decoder.generate(torch.ones(2, 3, dtype=torch.long), 4, torch.Generator())


def test_hidden_state_handed_to_policies_is_post_final_norm(pair):
    _, draft = pair
    seen: list[torch.Tensor] = []

    class Recorder(FixedLength):
        needs_hidden_states = True

        def should_stop(self, step):
            seen.append(step.hidden)
            return super().should_stop(step)

    prompt = [4, 8, 15]
    SpeculativeDecoder(draft, draft, Recorder(1), GREEDY, None, V).generate(prompt, 2)
    with torch.inference_mode():
        expected = draft.gpt_neox(torch.tensor([prompt])).last_hidden_state[0, -1]  # final_layer_norm applied
    torch.testing.assert_close(seen[0], expected)


# ---------------------------------------------------------------------------------------------- draft-length bounds


class _Never(DraftPolicy):
    """Never says stop; records every index it is asked at."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.bounds: list[int | None] = []

    def reset(self, max_draft_length: int | None = None) -> None:
        self.bounds.append(max_draft_length)

    def should_stop(self, step) -> bool:
        self.asked.append(step.index)
        return False


@pytest.mark.parametrize("max_draft_length", [1, 3, 20])
def test_engine_stops_at_its_max_for_a_policy_that_never_stops(pair, max_draft_length):
    target, _ = pair
    policy = _Never()
    decoder = SpeculativeDecoder(target, target, policy, GREEDY, None, V, max_draft_length=max_draft_length)
    stats = decoder.generate([2, 7], 60).stats  # self-draft: every round is accepted in full
    hist = stats.draft_length_hist
    assert len(hist) == max_draft_length + 1 and hist[max_draft_length] >= 2  # never more than the max
    assert max(policy.asked) == max_draft_length
    assert policy.bounds == [max_draft_length]  # the engine tells the policy its bound once per sequence
    assert decoder.max_draft_length == max_draft_length
    assert SpeculativeDecoder(target, target, _Never(), GREEDY, None, V).max_draft_length == 20  # default


class _HeadRecorder(AcceptanceHeadPolicy):
    """Records, per round, each (index asked, answer, number of candidates in P_acc so far)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[list[tuple[int, bool, int]]] = []

    def begin_round(self) -> None:
        super().begin_round()
        self.rounds.append([])

    def should_stop(self, step) -> bool:
        answer = super().should_stop(step)
        self.rounds[-1].append((step.index, answer, len(self.scored_probs)))
        return answer


def _pessimistic_head(hidden_size: int, input: str) -> AcceptanceHead:
    """A head predicting acceptance sigmoid(-10): one scored candidate makes 1 - P_acc exceed any h < 1."""
    head = AcceptanceHead(hidden_size, num_blocks=1, input=input)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(-10.0)
    return head


@pytest.mark.parametrize(
    ("head_input", "score_newest", "expected"),
    [
        # public rule: index 1 scores nothing (P_acc = 1, no stop); index 2 scores candidate 1 and stops
        ("candidate", False, [(1, False, 0), (2, True, 1)]),
        # newest-candidate scoring: the policy says stop at index 1 already; the engine ignores it (minimum 2)
        ("candidate", True, [(1, True, 1), (2, True, 2)]),
        ("proposer", False, [(1, True, 1), (2, True, 2)]),
    ],
    ids=["one_behind", "newest", "proposer"],
)
def test_head_with_min_two_is_asked_at_index_one_and_the_engine_ignores_its_stop(
    pair, head_input, score_newest, expected
):
    target, draft = pair
    head = _pessimistic_head(draft.config.hidden_size, head_input)
    policy = _HeadRecorder(head, 0.5, score_newest=score_newest)
    assert policy.min_draft_length == 2  # the public SpecDec++ code's minimum, enforced by the engine
    stats = SpeculativeDecoder(target, draft, policy, GREEDY, None, V).generate([4, 4, 1], 24).stats
    full = [r for r in policy.rounds if len(r) == 2]
    assert len(full) >= 5 and all(r == expected for r in full)
    # other rounds are the last ones, cut by the token budget (k_cap = remaining - 1 < 2)
    assert all(len(r) < 2 for r in policy.rounds if len(r) != 2)
    assert stats.draft_length_hist[2] == len(full) and len(stats.draft_length_hist) == 3


# ---------------------------------------------------------------------------------------------- statistics


def test_stats_arithmetic_on_a_hand_checked_example():
    stats = DecodingStats(sequences=1)
    stats.record_round(4, 2, rejected=True)  # emits 3 tokens, 2 wasted candidates
    stats.record_round(3, 3, rejected=False)  # emits 4 tokens (bonus)
    stats.record_round(2, 0, rejected=True)  # emits 1 token
    stats.generated_tokens = 8
    stats.target_forwards = 3
    stats.wall_time_s = 2.0
    metrics = stats.metrics()
    assert metrics == {
        "acceptance_rate": 5 / 7,  # 5 accepted, 2 rejections; the tail after a rejection is ignored
        "accepted_per_draft": 5 / 9,
        "tokens_per_target_call": 8 / 3,
        "mean_draft_length": 3.0,
        "discard_rate": 4 / 8,
        "tokens_per_second": 4.0,
    }
    assert stats.tested_by_position == [3, 2, 2]
    assert stats.accepted_by_position == [2, 2, 1]
    assert stats.acceptance_by_position() == [2 / 3, 1.0, 0.5]
    assert stats.draft_length_hist == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="accepted"):
        stats.record_round(2, 3, rejected=False)


def test_stats_aggregate_by_summing_counters():
    a, b = DecodingStats(sequences=1), DecodingStats(sequences=1)
    a.record_round(2, 2, rejected=False)
    a.generated_tokens, a.target_forwards, a.wall_time_s = 3, 1, 1.0
    b.record_round(5, 0, rejected=True)
    b.generated_tokens, b.target_forwards, b.wall_time_s = 1, 1, 1.0
    total = DecodingStats.sum([a, b])
    assert total.sequences == 2 and total.drafted_tokens == 7
    assert total.metrics()["acceptance_rate"] == 2 / 3  # pooled, not the mean of 1.0 and 0.0
    assert total.draft_length_hist == [0, 0, 1, 0, 0, 1]
    assert total.to_dict()["tokens_per_second"] == 2.0
    baseline = DecodingStats(generated_tokens=4, target_forwards=4, wall_time_s=4.0)
    assert speedup(total, baseline) == 2.0
    empty = DecodingStats().metrics()
    assert all(value is None for value in empty.values())  # undefined, never NaN


def test_engine_stats_are_consistent(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, FixedLength(3), GREEDY, None, V)
    stats = DecodingStats.sum([decoder.generate(p, 16).stats for p in _prompts(4, seed=3)])
    assert stats.generated_tokens == 64
    assert stats.target_forwards == stats.rounds
    # every round emits its accepted candidates plus one target token
    assert stats.generated_tokens == stats.accepted_tokens + stats.rounds
    assert 0 < stats.metrics()["acceptance_rate"] < 1
    assert sum(stats.draft_length_hist) == stats.rounds
    assert stats.draft_forwards == stats.drafted_tokens  # one draft forward per candidate, none recomputed
    assert stats.draft_time_s > 0 and stats.target_time_s > 0
    assert stats.draft_time_s + stats.target_time_s <= stats.wall_time_s * 1.05
