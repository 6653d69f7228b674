"""Proposers: a new draft kind plugs into the engine unchanged; the target's hidden states of the verified
positions reach a proposer that asks for them; the engine rolls a proposer back as its contract says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import DraftPolicy, FixedLength, HeuristicSchedule, Oracle
from specdistill.decoding.proposers import DraftLMProposer, DraftProposal, Proposer, TargetHidden
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.decoding.toy import toy_pair
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution, two_token_counts
from tests.test_engine import GREEDY, V, _all_policies, _prompts
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

SAMPLING = SamplingConfig(temperature=1.0)
TIMINGS = {"target_time_s", "draft_time_s", "wall_time_s", "oracle_probe_time_s"}


@pytest.fixture(scope="module")
def pair():
    return toy_pair(V)  # tests/test_engine.py's pair


def _counters(stats: DecodingStats) -> dict:
    return {k: v for k, v in dataclasses.asdict(stats).items() if k not in TIMINGS}


# ---------------------------------------------------------------------------------------------- test-only proposers


class _PromptLookup(Proposer):
    """Prompt lookup: proposes the token that followed the latest earlier occurrence of the newest token.

    No model, no cache: its state is just how many tokens it has seen. Its logits favour the looked-up token
    (uniform when there is none), so in sampling mode it proposes from a proper distribution.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self._device = device
        self._length = 0

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def length(self) -> int:
        return self._length

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._length = 0
        self.forwards = 0

    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        self._length = tokens.shape[1]
        seen = tokens[0].tolist()
        logits = torch.zeros(self.vocab_size, device=self._device)
        for i in range(len(seen) - 2, -1, -1):
            if seen[i] == seen[-1]:
                logits[seen[i + 1]] = 3.0
                break
        return DraftProposal(logits)

    def rollback(self, length: int) -> None:
        self._length = length


class _TargetLinear(Proposer):
    """A small linear map (the target's own LM head) from the target's last hidden state of the newest verified
    position to logits: an EAGLE-like draft that reads the target's states through `observe_target` only."""

    target_hidden_layers = (-1,)

    def __init__(self, target: torch.nn.Module, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.head = target.get_output_embeddings()
        self._length = 0
        self._state: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def length(self) -> int:
        return self._length

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._length = 0
        self._state = None
        self.forwards = 0

    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        self._length = tokens.shape[1]
        if self._state is None:  # nothing verified yet: no opinion
            return DraftProposal(torch.zeros(self.vocab_size, device=self.device))
        self.forwards += 1
        return DraftProposal(self.head(self._state)[: self.vocab_size])

    def observe_target(self, verified: TargetHidden) -> None:
        (states,) = verified.states
        self._state = states[verified.verified_length - verified.start - 1]

    def rollback(self, length: int) -> None:
        self._length = length


class _Recording(DraftLMProposer):
    """The draft LM proposer, asking for the target's states at `layers` and recording every call of the contract."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, layers: tuple[int, ...] | None) -> None:
        super().__init__(model, vocab_size)
        self.target_hidden_layers = layers
        self.calls: list[tuple] = []
        self.observed: list[TargetHidden] = []

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        super().start(prompt, capacity, cache_implementation)
        self.calls.append(("start", self.length))

    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        self.calls.append(("propose", self.length, tokens.shape[1]))
        return super().propose(tokens, with_hidden)

    def observe_target(self, verified: TargetHidden) -> None:
        self.observed.append(verified)

    def rollback(self, length: int) -> None:
        self.calls.append(("rollback", self.length, length))
        super().rollback(length)


def _policies_without_hidden(draft) -> dict[str, tuple[DraftPolicy, int]]:
    """tests/test_engine.py's policies that read no draft hidden state (fixed, heuristic, confidence, entropy,
    oracle), with the engine bound each runs under."""
    return {name: entry for name, entry in _all_policies(draft).items() if not entry[0].needs_hidden_states}


# ---------------------------------------------------------------------------------------------- a new draft kind


@pytest.mark.parametrize("kind", ["prompt_lookup", "target_linear"])
def test_a_new_proposer_is_lossless_in_greedy_mode_for_every_policy(pair, kind):
    target, draft = pair
    proposer = _PromptLookup(V, torch.device("cpu")) if kind == "prompt_lookup" else _TargetLinear(target, V)
    prompts = _prompts(4)
    references = [autoregressive(target, p, 24, GREEDY, None, V).tokens for p in prompts]
    accepted = rejected = 0
    for name, (policy, max_draft_length) in _policies_without_hidden(draft).items():
        decoder = SpeculativeDecoder(
            target, proposer, policy, GREEDY, None, V, max_draft_length=max_draft_length
        )
        assert decoder.proposer is proposer
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 24)
            assert result.tokens == reference, f"{kind} with {name} diverged from the target's greedy output"
            accepted += result.stats.accepted_tokens
            rejected += result.stats.rejected_tokens
    assert accepted > 0 and rejected > 0  # both the acceptance and the rollback paths were exercised


SMALL_V = 8
SMALL_SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
STAT_PROMPT = [1, 5, 2, 1]


@pytest.mark.parametrize("kind", ["prompt_lookup", "target_linear"])
def test_a_new_proposer_samples_the_target_distribution(kind):
    # The pair of tests/test_engine.py's distribution checks; only the target is used here.
    target, _ = toy_pair(SMALL_V, hidden_size=16, num_heads=2, initializer_range=0.5, noise=1.0, seed=5)
    proposer = (
        _PromptLookup(SMALL_V, torch.device("cpu"))
        if kind == "prompt_lookup"
        else _TargetLinear(target, SMALL_V)
    )
    decoder = SpeculativeDecoder(
        target, proposer, FixedLength(1), SMALL_SAMPLING, None, SMALL_V, max_draft_length=1
    )
    counts = two_token_counts(decoder, STAT_PROMPT, SMALL_V, samples=400)
    exact = exact_two_token_distribution(target, STAT_PROMPT, SMALL_SAMPLING, SMALL_V)
    assert matches_two_token_distribution(counts, exact)


# ---------------------------------------------------------------------------------------------- target hidden states


def _target_forward_flags(target: torch.nn.Module):
    """Install a hook recording `output_hidden_states` of every target forward; returns (flags, handle)."""
    flags: list[bool] = []

    def hook(module, args, kwargs):
        flags.append(bool(kwargs.get("output_hidden_states", False)))

    return flags, target.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
@pytest.mark.parametrize("policy_name", ["fixed3", "heuristic", "oracle"])
def test_proposer_receives_the_target_states_of_the_verified_positions(pair, sampling, policy_name):
    target, draft = pair
    layers = (0, 1, -1)
    policy = {"fixed3": FixedLength(3), "heuristic": HeuristicSchedule(2), "oracle": Oracle()}[policy_name]
    proposer = _Recording(draft, V, layers)
    decoder = SpeculativeDecoder(target, proposer, policy, sampling, None, V, max_draft_length=5)
    flags, handle = _target_forward_flags(target)
    try:
        result = decoder.generate([7, 2, 9, 4], 30, torch.Generator().manual_seed(3), keep_state=True)
    finally:
        handle.remove()
    stats, state = result.stats, result.state
    assert stats.rejected_tokens > 0 or policy.withdraws_stop  # the oracle withdraws instead of rejecting
    # the verification passes alone ask for hidden states (an oracle's probes do not), one observation each
    assert flags.count(True) == stats.target_forwards == len(proposer.observed)
    assert len(flags) > stats.target_forwards if policy_name == "oracle" else all(flags)
    with torch.inference_mode():
        full = target(input_ids=state.tokens, output_hidden_states=True).hidden_states
    covered = 0
    for verified in proposer.observed:
        assert (
            verified.start == covered
        )  # the pass continued from the previous round's crop: no gap, no overlap
        assert len(verified.states) == len(layers)
        for layer, states in zip(layers, verified.states, strict=True):
            # at least one pending token (the previous round's extra one) before the candidates
            assert states.shape == (states.shape[0], target.config.hidden_size)
            assert states.shape[0] > verified.num_candidates
            kept = states[: verified.verified_length - verified.start]
            torch.testing.assert_close(kept, full[layer][0, verified.start : verified.verified_length])
        covered = verified.verified_length
    assert covered == state.target_length
    assert sum(v.accepted for v in proposer.observed) == stats.accepted_tokens
    # asking for the states changes nothing in what is decoded
    plain = SpeculativeDecoder(target, draft, policy, sampling, None, V, max_draft_length=5)
    again = plain.generate([7, 2, 9, 4], 30, torch.Generator().manual_seed(3))
    assert again.tokens == result.tokens and _counters(again.stats) == _counters(stats)


def test_target_forward_is_unchanged_when_no_proposer_asks(pair):
    target, draft = pair
    flags, handle = _target_forward_flags(target)
    try:
        SpeculativeDecoder(target, draft, Oracle(), GREEDY, None, V, max_draft_length=5).generate(
            [3, 3, 8], 20
        )
    finally:
        handle.remove()
    assert flags and not any(flags)


def test_the_first_pass_covers_the_prompt_then_the_candidates(pair):
    target, draft = pair
    proposer = _Recording(draft, V, (-1,))
    SpeculativeDecoder(target, proposer, FixedLength(3), GREEDY, None, V).generate([1, 2, 3], 16)
    first = proposer.observed[0]
    assert first.start == 0 and first.num_candidates == 3 and first.states[0].shape[0] == 3 + 3


# ---------------------------------------------------------------------------------------------- the engine's contract


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_engine_keeps_the_call_order_and_never_rolls_back_below_the_previous_crop(pair, sampling):
    target, draft = pair
    eos = autoregressive(target, [6, 1], 40, GREEDY, None, V).tokens[25]
    policies = [FixedLength(4), HeuristicSchedule(3), Oracle(), _all_policies(draft)["head_newest"][0]]
    for policy in policies:
        proposer = _Recording(draft, V, None)
        decoder = SpeculativeDecoder(target, proposer, policy, sampling, eos, V, max_draft_length=6)
        gen = torch.Generator().manual_seed(5)
        for prompt in ([6, 1], [9, 9, 3, 0, 12]):
            proposer.calls.clear()
            tokens = decoder.generate(prompt, 30, gen, keep_state=True).state.tokens
            assert proposer.calls[0] == ("start", 0)
            previous_crop = 0
            for call in proposer.calls[1:]:
                assert call[0] != "start"
                if call[0] == "propose":
                    _, covered, end = call
                    assert covered < end  # always something new to consume
                else:
                    _, covered, length = call
                    assert previous_crop <= length <= covered and length < tokens.shape[1]
                    previous_crop = length
            assert proposer.calls[-1][0] == "rollback"  # every round ends with a rollback
            assert proposer.length == previous_crop


def test_draft_lm_proposer_refuses_a_rollback_below_its_previous_one(pair):
    _, draft = pair
    proposer = DraftLMProposer(draft, V)
    proposer.start(torch.tensor([[1, 2, 3, 4]]), 16, "dynamic")
    with torch.inference_mode():
        proposer.propose(torch.tensor([[1, 2, 3, 4]]), with_hidden=False)
    proposer.rollback(3)
    assert proposer.length == proposer.cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="previous rollback"):
        proposer.rollback(2)
    with pytest.raises(ValueError, match=r"outside \[3, 3\]"):
        proposer.rollback(4)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_a_draft_lm_proposer_decodes_exactly_like_the_plain_draft(pair, sampling):
    target, draft = pair
    names = ["fixed4", "heuristic", "confidence", "oracle", "head", "head_newest", "head_proposer"]
    plain_policies, wrapped_policies = _all_policies(draft), _all_policies(draft)  # equal, separate state
    for name in names:
        policy, max_draft_length = plain_policies[name]
        plain = SpeculativeDecoder(
            target, draft, policy, sampling, None, V, max_draft_length=max_draft_length
        )
        assert isinstance(plain.proposer, DraftLMProposer) and plain.proposer.model is draft
        proposer = DraftLMProposer(draft, V)
        policy = wrapped_policies[name][0]
        wrapped = SpeculativeDecoder(
            target, proposer, policy, sampling, None, V, max_draft_length=max_draft_length
        )
        for prompt in _prompts(2, seed=4):
            a = plain.generate(prompt, 20, torch.Generator().manual_seed(2), keep_state=True)
            b = wrapped.generate(prompt, 20, torch.Generator().manual_seed(2), keep_state=True)
            assert a.tokens == b.tokens, name
            assert _counters(a.stats) == _counters(b.stats), name
            assert a.stats.draft_forwards > 0 and a.state.draft_length == b.state.draft_length
            assert a.state.draft_cache.get_seq_length() == a.state.draft_length


def test_bad_proposers_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="vocab_size is 40 but the engine's vocab_size is 48"):
        SpeculativeDecoder(target, DraftLMProposer(draft, 40), FixedLength(2), GREEDY, None, V)
    with pytest.raises(ValueError, match="causal LM .* or a Proposer"):
        SpeculativeDecoder(target, "draft", FixedLength(2), GREEDY, None, V)
    for layers in ((), (3,), (-4,), [1], (1.0,)):  # the toy target has 2 layers: 3 hidden-state entries
        with pytest.raises(ValueError, match="target_hidden_layers"):
            SpeculativeDecoder(target, _Recording(draft, V, layers), FixedLength(2), GREEDY, None, V)
    SpeculativeDecoder(target, _Recording(draft, V, (-3, 2)), FixedLength(2), GREEDY, None, V)  # both ends

    class _Forgetful(DraftLMProposer):
        target_hidden_layers = (-1,)

    decoder = SpeculativeDecoder(target, _Forgetful(draft, V), FixedLength(2), GREEDY, None, V)
    with pytest.raises(NotImplementedError, match="override observe_target"):
        decoder.generate([1, 2], 4)
