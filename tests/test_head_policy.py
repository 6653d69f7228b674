"""SpecDec++ stopping rule and the acceptance-head draft-length policy (the method is SpecDec++; the code's name for
its head, policies and report keys is "acceptance_head")."""

from __future__ import annotations

import pytest
import torch

from specdistill.decoding import head_policy
from specdistill.decoding.head_policy import (
    AcceptanceHeadPolicy,
    head_policy_grid,
    head_should_stop,
    simulate_draft_length,
)
from specdistill.decoding.policies import DraftStep
from specdistill.models.acceptance_head import AcceptanceHead
from tests.threads import one_torch_thread


def test_rule_stops_exactly_where_rejection_probability_first_exceeds_threshold():
    # products with score_newest: 0.9, 0.72, 0.504, 0.3528 -> 1 - P: 0.1, 0.28, 0.496, 0.6472
    probs = [0.9, 0.8, 0.7, 0.7, 0.99, 0.99]
    assert simulate_draft_length(probs, 0.5, min_draft_length=1, score_newest=True) == 4
    assert simulate_draft_length(probs, 0.25, min_draft_length=1, score_newest=True) == 2
    assert simulate_draft_length(probs, 0.05, min_draft_length=1, score_newest=True) == 1
    # one-behind scoring (public code): decision at index i covers candidates 1..i-1, so one more candidate
    assert simulate_draft_length(probs, 0.5, min_draft_length=1, score_newest=False) == 5
    assert simulate_draft_length(probs, 0.05, min_draft_length=1, score_newest=False) == 2


def test_rule_is_strict_inequality_and_knows_no_bounds():
    assert not head_should_stop(0.5, threshold=0.5)
    assert head_should_stop(0.49, threshold=0.5)
    assert head_should_stop(0.0, 0.5) and not head_should_stop(1.0, 0.5)  # bounds are the engine's


def test_simulation_applies_the_engines_min_and_max():
    low = [0.01] * 30
    high = [1.0] * 30
    assert simulate_draft_length(low, 0.5, min_draft_length=3, score_newest=True) == 3
    assert simulate_draft_length(low, 0.5, min_draft_length=2, score_newest=False) == 2
    assert simulate_draft_length(high, 0.5, min_draft_length=2, max_draft_length=7) == 7
    with pytest.raises(ValueError, match="min_draft_length"):
        simulate_draft_length(low, 0.5, min_draft_length=5, max_draft_length=4)
    with pytest.raises(ValueError, match="threshold"):
        simulate_draft_length(low, 1.0)


def _head_with_bias(hidden: int, bias: float) -> AcceptanceHead:
    """A head whose prediction is sigmoid(bias + hidden[0]): easy to steer through the hidden state."""
    head = AcceptanceHead(hidden, num_blocks=1)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, 0] = 1.0
        head.out.bias.fill_(bias)
    return head


def _run_policy(
    policy: AcceptanceHeadPolicy, hidden_logits: list[float], max_draft_length: int = 20, hidden_size: int = 4
) -> int:
    """Drive the policy as the engine does (asked after every candidate, a stop before its minimum ignored, the
    engine's max) with steps whose hidden state makes the head predict sigmoid(hidden_logits[index-1])."""
    policy.begin_round()
    for index in range(1, max_draft_length + 1):
        hidden = torch.zeros(hidden_size)
        hidden[0] = hidden_logits[index - 1]
        step = DraftStep(index=index, token=5, draft_probs=torch.full((8,), 1 / 8), hidden=hidden)
        if policy.should_stop(step) and index >= policy.min_draft_length:
            return index
    return max_draft_length


@pytest.mark.parametrize("score_newest", [False, True])
def test_policy_matches_offline_rule(score_newest):
    torch.manual_seed(0)
    hidden_logits = (torch.randn(20) * 2 + 2).tolist()
    policy = AcceptanceHeadPolicy(
        _head_with_bias(4, 0.0), threshold=0.5, min_draft_length=2, score_newest=score_newest
    )
    assert policy.needs_hidden_states and policy.feed_newest is score_newest
    assert (
        policy.min_draft_length == 2
    )  # enforced by the engine, which asks after every candidate all the same
    length = _run_policy(policy, hidden_logits)
    # the hidden state at index i: with score_newest it is candidate i's, else candidate (i-1)'s (index 1: no one's)
    if score_newest:
        cand_probs = torch.sigmoid(torch.tensor(hidden_logits)).tolist()
    else:
        cand_probs = torch.sigmoid(torch.tensor(hidden_logits[1:])).tolist()
    expected = simulate_draft_length(cand_probs, 0.5, 2, 20, score_newest=score_newest)
    assert length == expected
    assert len(policy.scored_probs) == (length if score_newest else length - 1)


def test_policy_does_not_score_last_accepted_token_and_resets_per_round():
    # index 1 hidden would predict rejection (logit -10) but belongs to the last accepted token: ignored.
    policy = AcceptanceHeadPolicy(
        _head_with_bias(4, 0.0), threshold=0.5, min_draft_length=1, score_newest=False
    )
    assert _run_policy(policy, [-10.0] + [10.0] * 19) == 20
    assert policy.scored_probs and min(policy.scored_probs) > 0.99
    # with score_newest the same state is candidate 1's own: stop at once
    newest = AcceptanceHeadPolicy(
        _head_with_bias(4, 0.0), threshold=0.5, min_draft_length=1, score_newest=True
    )
    assert _run_policy(newest, [-10.0] + [10.0] * 19) == 1
    assert _run_policy(newest, [10.0] * 20) == 20  # begin_round reset P_acc


def test_policy_requires_hidden_state_and_keeps_only_a_minimum():
    policy = AcceptanceHeadPolicy(_head_with_bias(4, 1.0), threshold=0.3, score_newest=True)
    assert policy.threshold == 0.3 and policy.min_draft_length == 2
    assert not hasattr(policy, "max_draft_length") and not hasattr(policy, "stop_min_length")
    assert not hasattr(head_policy, "load_head_policy")
    with pytest.raises(ValueError, match="hidden"):
        policy.should_stop(DraftStep(index=1, token=0, draft_probs=torch.ones(4) / 4, hidden=None))


# --- with the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_pair():
    from specdistill.decoding.toy import toy_pair

    with one_torch_thread():
        yield toy_pair(40)


def _trained_looking_head(hidden_size: int) -> AcceptanceHead:
    torch.manual_seed(0)
    head = AcceptanceHead(hidden_size, num_blocks=3)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        head.out.bias.fill_(2.0)  # mostly confident, so rounds of varied length happen
    return head


@pytest.mark.parametrize("score_newest", [False, True])
def test_greedy_output_under_head_policy_equals_target_greedy(engine_pair, score_newest):
    from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
    from specdistill.decoding.sampling import SamplingConfig

    target, draft = engine_pair
    greedy = SamplingConfig(greedy=True)
    policy = AcceptanceHeadPolicy(_trained_looking_head(32), threshold=0.5, score_newest=score_newest)
    decoder = SpeculativeDecoder(target, draft, policy, greedy, None, 40, max_draft_length=8)
    lengths = set()
    for prompt in ([3, 1, 4], [15, 9]):
        reference = autoregressive(target, prompt, 16, greedy, None, 40).tokens
        result = decoder.generate(prompt, 16)
        assert result.tokens == reference
        lengths.update(length for length, count in enumerate(result.stats.draft_length_hist) if count)
    assert len(lengths) > 1  # the head actually varied the draft length


class _Recorder(AcceptanceHeadPolicy):
    """Records each scored hidden state with the round's start, to compare against a full forward pass."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (round, index, hidden, q)
        self.rounds: list[int] = []  # tokens emitted per round

    def begin_round(self) -> None:
        super().begin_round()
        self.rounds.append(0)

    def should_stop(self, step):
        self.records.append((len(self.rounds) - 1, step.index, step.hidden.clone(), step.draft_probs.clone()))
        return super().should_stop(step)

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        assert num_accepted == num_drafted  # draft == target in greedy mode: everything is accepted
        self.rounds[-1] = num_drafted + 1  # candidates plus the bonus token


def _decode_with_target_as_draft(target, policy: _Recorder, max_draft_length: int = 5):
    """Greedy decode with `target` as its own draft (every candidate accepted); return the full pass's hidden states
    `(T, H)` and probabilities `(T, V)` (the model's own forward, not the engine's path) and each round's start."""
    from specdistill.decoding.engine import SpeculativeDecoder
    from specdistill.decoding.sampling import SamplingConfig
    from specdistill.models.acceptance_head import draft_hidden_states

    prompt = [3, 1, 4, 1]
    greedy = SamplingConfig(greedy=True)
    decoder = SpeculativeDecoder(target, target, policy, greedy, None, 40, max_draft_length=max_draft_length)
    sequence = torch.tensor([prompt + decoder.generate(prompt, 18).tokens])
    with torch.no_grad():
        full = draft_hidden_states(target, sequence)[0]
        full_probs = target(sequence).logits[0, :, :40].softmax(-1)
    starts = [len(prompt) + sum(policy.rounds[:r]) for r in range(len(policy.rounds))]
    return full, full_probs, starts


@pytest.mark.parametrize("score_newest", [False, True])
def test_policy_sees_the_hidden_states_the_head_is_trained_on(engine_pair, score_newest):
    """The decoding-time hidden state of a candidate equals `draft_hidden_states` (the training input) at the
    position whose input token is that candidate (score_newest), or the previous token (public code)."""
    target, _ = engine_pair
    policy = _Recorder(_trained_looking_head(32), threshold=0.5, score_newest=score_newest)
    full, _, starts = _decode_with_target_as_draft(target, policy)
    checked = 0
    for round_index, index, hidden, _ in policy.records:
        # candidate `index` of a round sits at start + index - 1; one-behind scoring reads the token before it
        position = starts[round_index] + index - (1 if score_newest else 2)
        torch.testing.assert_close(hidden, full[position], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked >= 5


def _proposer_head_reading_q(hidden: int) -> AcceptanceHead:
    """A proposer head predicting sigmoid(10 * (q(candidate) - 0.5)): accepts confident candidates."""
    head = AcceptanceHead(hidden, num_blocks=1, input="proposer")
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, -1] = 10.0
        head.out.bias.fill_(-5.0)
    return head


def test_proposer_policy_scores_the_newest_candidate_from_its_proposing_state():
    policy = AcceptanceHeadPolicy(_proposer_head_reading_q(4), threshold=0.5, min_draft_length=1)
    assert policy.scores_newest and not policy.feed_newest  # scored at once, without feeding it to the draft
    confident, unsure = torch.tensor([0.95, 0.05]), torch.tensor([0.3, 0.7])
    hidden = torch.zeros(4)
    q_steps = [confident, confident, unsure]
    for index, probs in enumerate(q_steps, start=1):
        stop = policy.should_stop(DraftStep(index=index, token=0, draft_probs=probs, hidden=hidden))
        assert stop is (index == 3)
    expected = torch.sigmoid(torch.tensor([4.5, 4.5, -2.0])).tolist()
    assert policy.scored_probs == pytest.approx(expected, rel=1e-5)
    assert simulate_draft_length(expected, 0.5, 1, 20, score_newest=True) == 3
    with pytest.raises(ValueError, match="score_newest"):
        AcceptanceHeadPolicy(_proposer_head_reading_q(4), score_newest=True)


def test_proposer_policy_sees_proposing_states_and_draft_probabilities(engine_pair):
    """At step i the policy gets the state that proposed candidate i (the training input at len(context) - 1) and
    the distribution the candidate came from."""
    target, _ = engine_pair
    policy = _Recorder(_proposer_head_reading_q(32), threshold=0.5)
    full, full_probs, starts = _decode_with_target_as_draft(target, policy)
    for round_index, index, hidden, probs in policy.records:
        # candidate `index` sits at start + index - 1 and was proposed one position earlier
        position = starts[round_index] + index - 2
        torch.testing.assert_close(hidden, full[position], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(probs, full_probs[position], rtol=1e-4, atol=1e-5)
    assert len(policy.records) >= 5


def test_grid_builds_one_policy_per_threshold_named_acceptance_head():
    proposer = head_policy_grid(
        AcceptanceHead(4, 1, input="proposer"), [0.3, 0.5], [False, True], min_draft_length=1
    )
    assert sorted(proposer) == ["acceptance_head_h0.3", "acceptance_head_h0.5"]
    assert all(p.scores_newest and p.min_draft_length == 1 for p in proposer.values())
    candidate = head_policy_grid(AcceptanceHead(4, 1), [0.3, 0.5], [False, True])
    assert sorted(candidate) == [
        "acceptance_head_h0.3",
        "acceptance_head_h0.3_newest",
        "acceptance_head_h0.5",
        "acceptance_head_h0.5_newest",
    ]
    assert all(p.min_draft_length == 2 for p in candidate.values())
    assert candidate["acceptance_head_h0.5_newest"].score_newest
    assert candidate["acceptance_head_h0.3"].threshold == 0.3
    assert list(head_policy_grid(AcceptanceHead(4, 1), [0.7], True)) == ["acceptance_head_h0.7_newest"]


def test_a_withdrawing_policy_needs_the_candidate_it_stops_on_scored():
    assert not AcceptanceHeadPolicy(_head_with_bias(4, 0.0), score_newest=True).withdraws_stop
    newest = AcceptanceHeadPolicy(_head_with_bias(4, 0.0), score_newest=True, withdraw=True)
    proposer = AcceptanceHeadPolicy(_proposer_head_reading_q(4), withdraw=True)
    assert newest.withdraws_stop and proposer.withdraws_stop
    # the public rule leaves the newest candidate unscored: withdrawing it would act on no prediction of it
    with pytest.raises(ValueError, match="score_newest=True"):
        AcceptanceHeadPolicy(_head_with_bias(4, 0.0), score_newest=False, withdraw=True)


def test_grid_adds_withdrawing_policies_where_the_newest_candidate_is_scored():
    proposer = head_policy_grid(AcceptanceHead(4, 1, input="proposer"), [0.5], withdraw=[False, True])
    assert list(proposer) == ["acceptance_head_h0.5", "acceptance_head_h0.5_withdrawn"]
    assert [p.withdraws_stop for p in proposer.values()] == [False, True]
    candidate = head_policy_grid(AcceptanceHead(4, 1), [0.5], [False, True], withdraw=[False, True])
    assert list(candidate) == [
        "acceptance_head_h0.5",
        "acceptance_head_h0.5_newest",
        "acceptance_head_h0.5_newest_withdrawn",
    ]
    for withdraw in (True, [False, True]):  # asked for, and none could be built: refused, not left out
        with pytest.raises(ValueError, match="scores the newest candidate"):
            head_policy_grid(AcceptanceHead(4, 1), [0.5], False, withdraw=withdraw)


def _proposer_head_predicting(hidden: int, logit: float) -> AcceptanceHead:
    head = AcceptanceHead(hidden, num_blocks=1, input="proposer")
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(logit)
    return head


def test_a_head_that_withdraws_every_candidate_decodes_like_the_target_one_token_per_call(engine_pair):
    """Every candidate predicted rejected and withdrawn: each round verifies only the pending token (a plain target
    step) and still emits the candidate when the target agrees with it, never a bonus token after it."""
    from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
    from specdistill.decoding.sampling import SamplingConfig

    target, draft = engine_pair
    greedy = SamplingConfig(greedy=True)
    pessimist = _proposer_head_predicting(32, -10.0)
    withdraw = AcceptanceHeadPolicy(pessimist, threshold=0.5, min_draft_length=1, withdraw=True)
    keep = AcceptanceHeadPolicy(pessimist, threshold=0.5, min_draft_length=1)
    accepted = 0
    for prompt in ([3, 1, 4], [15, 9], [7, 7, 2]):
        reference = autoregressive(target, prompt, 20, greedy, None, 40).tokens
        out = SpeculativeDecoder(target, draft, withdraw, greedy, None, 40, max_draft_length=8).generate(
            prompt, 20
        )
        assert out.tokens == reference
        stats = out.stats
        assert stats.rounds == stats.generated_tokens == 20  # one token per target call
        assert stats.rejected_tokens == 0 and stats.drafted_tokens == stats.accepted_tokens
        accepted += stats.accepted_tokens
        # the same stops without withdrawal send the candidate and get a bonus token after each acceptance
        kept = SpeculativeDecoder(target, draft, keep, greedy, None, 40, max_draft_length=8).generate(
            prompt, 20
        )
        assert kept.tokens == reference and kept.stats.drafted_tokens >= kept.stats.rounds - 1
    assert accepted > 0  # withdrawn candidates the target agreed with were emitted
