"""The offline acceptance estimate (`specdistill.evaluation.offline`): tokens per target call at every fixed K from
teacher-forced passes over the target's greedy outputs equals what greedy decoding measures, for causal-LM drafts on
Llama, Qwen2 and Gemma-2 targets, an EAGLE-3 head, prompt lookup and the hybrid; its walk follows the engine's rules
(budget, end of output, prefill-only first round)."""

from __future__ import annotations

import functools

import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.drafts.base import NO_CANDIDATE, DraftKind
from specdistill.drafts.eagle3.kind import Eagle3, TargetVocabularyHead
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.drafts.prompt_lookup.choice import lookup_rows
from specdistill.drafts.prompt_lookup.hybrid import HybridProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer
from specdistill.evaluation.offline import (
    accepted_runs,
    fixed_length_calls,
    format_offline,
    hybrid_candidates,
    lookup_blocks,
    offline_table,
)
from tests.test_architectures import tiny_pair
from tests.test_eagle3 import fused_states, tiny_head, tiny_target
from tests.test_engine import GREEDY
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 48
NEW = 40
LENGTHS = (1, 2, 3, 4)
# prompts with repeats, so that prompt lookup finds matches
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4], [7, 7, 2, 8, 7, 7, 2], [5, 10, 20, 5, 10, 30, 40, 5, 10]]


def _batch(seq: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": seq[None], "attention_mask": torch.ones(1, seq.numel(), dtype=torch.long)}


def _decoded(target, proposer, k: int) -> float:
    decoder = SpeculativeDecoder(target, proposer, FixedLength(k), GREEDY, None, V)
    tokens = calls = 0
    for prompt in PROMPTS:
        stats = decoder.generate(prompt, NEW).stats
        tokens, calls = tokens + stats.generated_tokens, calls + stats.target_forwards
    return tokens / calls


def _sequences(target) -> list[torch.Tensor]:
    return [
        torch.tensor([*p, *autoregressive(target, p, NEW, GREEDY, None, V).tokens], dtype=torch.long)
        for p in PROMPTS
    ]


def _offline(candidates, sequences, prefill=False) -> dict[int, float | None]:
    lengths = [len(p) for p in PROMPTS]
    return offline_table({"x": candidates}, sequences, lengths, NEW, LENGTHS, {"x": prefill})["x"]


# ------------------------------------------------------------------------------------------------------ pure maths


def test_accepted_runs_count_leading_matches_only():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    candidates = torch.tensor(
        [
            [2, 3, 9],
            [3, 9, 5],
            [4, 5, 6],
            [5, NO_CANDIDATE, NO_CANDIDATE],
            [NO_CANDIDATE, NO_CANDIDATE, NO_CANDIDATE],
        ]
    )
    # anchor 0: 2, 3 match, 9 != 4; anchor 1: 3 then a miss (5 after it does not count); anchor 2: 4, 5, then past
    # the end (6 never matches); anchor 3: 5; anchor 4: nothing after the end
    assert accepted_runs(candidates, tokens).tolist() == [2, 1, 2, 1, 0]
    with pytest.raises(ValueError, match="disagree in length"):
        accepted_runs(candidates, tokens[:4])


def test_the_walk_follows_the_engine_rules():
    # prompt of 2 (anchor 1), output of 6 tokens (positions 2..7)
    runs = [0, 3, 0, 0, 0, 2, 0, 0]
    # anchor 1 emits 3 + 1 (to anchor 5); there 2 tokens are left: K capped at 1 by the budget, 1 + 1
    assert fixed_length_calls(runs, 2, 6, 4) == 2
    assert (
        fixed_length_calls(runs, 2, 6, 1) == 4
    )  # 1 + 1 at anchor 1, then 0 + 1 twice, then 1 + 1 at anchor 5
    assert fixed_length_calls(runs, 2, 6, 0) == 6  # no drafting: one call per token
    # the first round only prefills: 1 token, then anchor 2 (run 0), anchor 3 ...
    assert fixed_length_calls(runs, 2, 6, 4, prefill_round=True) == 5
    # the budget: with 4 new tokens allowed (the output was cut there), a round drafts at most budget left - 1
    assert (
        fixed_length_calls(runs[:6], 2, 4, 4) == 1
    )  # anchor 1 drafts 3 (4 - 0 - 1), all accepted: 4 emitted
    # the output's end: an accepted run that reaches it emits no token after it (the engine drops the bonus)
    assert fixed_length_calls([0, 5, 0, 0], 2, 10, 4) == 1
    with pytest.raises(ValueError, match="prompt_length"):
        fixed_length_calls(runs, 0, 6, 4)
    # an output longer than the budget (answers re-tokenised from text, a wrong budget) is refused, not walked
    with pytest.raises(ValueError, match="more than max_new_tokens=5"):
        fixed_length_calls(runs, 2, 5, 4)


def test_lookup_candidates_are_vllm_blocks_and_the_hybrid_takes_them_first():
    tokens = torch.tensor([5, 6, 7, 5, 6])
    lookup = lookup_blocks(tokens, 1, 3, 3)[0]
    assert lookup[4].tolist() == [7, 5, 6]  # suffix 5 6 seen at 0: the three tokens after it
    assert lookup[0].tolist() == [NO_CANDIDATE] * 3  # a single token offers no earlier n-gram
    draft = torch.full((5, 3), 9)
    both = hybrid_candidates(lookup, draft)
    assert both[4].tolist() == [7, 5, 6] and both[0].tolist() == [9, 9, 9]


def test_the_console_lines_name_every_draft_and_the_decoded_figure():
    text = format_offline(
        {"adaspec": {1: 1.5, 2: 1.75}, "prompt_lookup": {1: None, 2: 1.1}}, {"adaspec": (2, 1.8)}
    )
    assert "adaspec" in text and "K=2 1.750" in text and "decoded K=2 1.800" in text and "K=1 -" in text


# -------------------------------------------------------------------------------- equal to decoding, every drafter


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_a_causal_lm_draft_offline_equals_decoded_at_every_k(arch):
    target, draft = tiny_pair(arch, V)
    sequences = _sequences(target)
    offline = _offline(
        lambda s: DraftKind().chain_candidates(draft, None, _batch(s), max(LENGTHS), V), sequences
    )
    decoded = {k: _decoded(target, draft, k) for k in LENGTHS}
    assert decoded[4] > 1.5  # the perturbed copy is accepted often: the walk has long runs to count
    for k in LENGTHS:
        assert offline[k] == pytest.approx(decoded[k], rel=1e-9), (k, offline, decoded)


def _fitted_head(target, sequences: list[torch.Tensor], steps: int = 3, iterations: int = 30):
    """A random head fitted by its unrolled steps to the target's greedy `sequences`: a head the target accepts."""
    torch.manual_seed(0)
    head = tiny_head(target, vocab=V, draft_vocab=V).train()
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    batches = [(_batch(s), fused_states(target, s[None])) for s in sequences]
    for _ in range(iterations):
        optimizer.zero_grad()
        for batch, features in batches:
            ids = batch["input_ids"]
            loss = 0.0
            for j, out in enumerate(head.unroll(features, ids, batch["attention_mask"], steps)):
                # step j at index p scores token p + j + 2
                logits = TargetVocabularyHead(head, V)(out.normed[0, : ids.shape[1] - j - 2])
                loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, j + 2 :])
            loss.backward()
        optimizer.step()
    return head.eval()


def test_an_eagle3_head_offline_equals_decoded_at_every_k():
    """The head's unroll (`Eagle3.chain_candidates`) is the chain it drafts, and its first round only prefills. The
    head is fitted only part way, so that its own steps and its step 0 on the target's states disagree: reading a
    causal LM's chain (step 0 at `t + j`) instead gives other figures here."""
    target = tiny_target("llama", vocab=V)
    sequences = _sequences(target)
    head = _fitted_head(target, sequences)
    offline = _offline(
        lambda s: Eagle3().chain_candidates(head, target, _batch(s), max(LENGTHS), V), sequences, prefill=True
    )
    without_prefill = _offline(
        lambda s: Eagle3().chain_candidates(head, target, _batch(s), max(LENGTHS), V),
        sequences,
        prefill=False,
    )
    for k in LENGTHS:
        assert offline[k] == pytest.approx(_decoded(target, Eagle3Proposer(head, V), k), rel=1e-9), k
    assert offline[4] > 1.5  # the fitted head is accepted: runs of several candidates were counted
    assert all(offline[k] < without_prefill[k] for k in LENGTHS)  # the prefill round emits a single token


def test_prompt_lookup_and_the_hybrid_offline_equal_decoded():
    target, draft = tiny_pair("llama", V)
    sequences = _sequences(target)
    depth = max(LENGTHS)

    def lookup(s):
        return lookup_blocks(s, 1, 3, depth)[0]

    def hybrid(s, draft_length=None):
        chain = DraftKind().chain_candidates(draft, None, _batch(s), depth, V)
        return hybrid_candidates(lookup(s), chain, draft_length)

    def chosen(s):  # lookup only where it matched two tokens or more (`lookup_lengths`), the draft elsewhere
        chain = DraftKind().chain_candidates(draft, None, _batch(s), depth, V)
        blocks, lengths = lookup_blocks(s, 1, 3, depth)
        return hybrid_candidates(blocks, chain, None, lookup_rows(lengths, {2, 3}))

    lookup_offline, hybrid_offline = _offline(lookup, sequences), _offline(hybrid, sequences)
    capped_offline = _offline(functools.partial(hybrid, draft_length=1), sequences)
    chosen_offline = _offline(chosen, sequences)
    proposer = PromptLookupProposer(V, torch.device("cpu"), 1, 3)
    for k in LENGTHS:
        assert lookup_offline[k] == pytest.approx(_decoded(target, proposer, k), rel=1e-9), k
        assert hybrid_offline[k] == pytest.approx(
            _decoded(target, HybridProposer(proposer, draft), k), rel=1e-9
        )
        # the draft's rounds capped at one candidate, lookup's at K: decoded and offline agree
        assert capped_offline[k] == pytest.approx(
            _decoded(target, HybridProposer(proposer, draft, draft_length=1), k), rel=1e-9
        )
        assert chosen_offline[k] == pytest.approx(
            _decoded(target, HybridProposer(proposer, draft, lookup_lengths=frozenset({2, 3})), k), rel=1e-9
        )
    assert lookup_offline[4] > 1.0  # lookup was accepted somewhere: the comparison counted its blocks
    assert capped_offline[4] != hybrid_offline[4]  # the cap changed some round: the comparison tested it
    assert chosen_offline[4] != hybrid_offline[4]  # so did the choice: some one-token match went to the draft


class _CountingKind(DraftKind):
    """The causal-LM kind, counting its teacher-forced passes."""

    passes = 0

    def chain_candidates(self, *args, **kwargs):
        type(self).passes += 1
        return super().chain_candidates(*args, **kwargs)


def test_the_evaluate_stage_runs_each_draft_once_per_sequence_for_its_row_and_its_hybrid_row():
    """`offline_estimate` with `prompt_lookup.hybrid`: the draft's row and its hybrid row read one teacher-forced pass
    per sequence, and both equal what the offline functions give on their own, the hybrid's with its choices."""
    from types import SimpleNamespace

    from specdistill.drafts.base import LoadedDraft
    from specdistill.stages.evaluate import offline_estimate

    target, draft = tiny_pair("llama", V)
    sequences = _sequences(target)
    report = SimpleNamespace(
        baseline=SimpleNamespace(
            outputs=[{"tokens": s[len(p) :].tolist()} for p, s in zip(PROMPTS, sequences, strict=True)]
        )
    )
    lookup = SimpleNamespace(min_ngram=1, max_ngram=3, hybrid=True)
    settings = SimpleNamespace(fixed_lengths=list(LENGTHS), prompt_lookup=lookup, max_new_tokens=NEW)
    prompts = [{"prompt_ids": p} for p in PROMPTS]
    _CountingKind.passes = 0
    table = offline_estimate(
        report,
        prompts,
        target,
        {"d": LoadedDraft(_CountingKind(), draft)},
        {},
        settings,
        V,
        {"d+prompt_lookup": {"draft_k": 2, "lookup_lengths": [2, 3]}},
    )
    assert _CountingKind.passes == len(PROMPTS)
    depth = max(LENGTHS)

    def chain(s):
        return DraftKind().chain_candidates(draft, None, _batch(s), depth, V)

    assert table["d"] == _offline(chain, sequences)

    # the hybrid's choice as evaluated: its draft rounds capped at 2, lookup only on matches of 2 or 3 tokens
    def hybrid(s):
        blocks, lengths = lookup_blocks(s, 1, 3, depth)
        return hybrid_candidates(blocks, chain(s), 2, lookup_rows(lengths, [2, 3]))

    assert table["d+prompt_lookup"] == _offline(hybrid, sequences)
