"""Block proposers: a proposer that drafts several candidates in one call, each with the distribution it was drawn
from, is lossless under every policy and on every architecture; prompt lookup is one (vLLM's n-gram rules, point
masses, empty blocks when the context offers nothing); a block that breaks the contract is refused."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import ConfidenceThreshold, FixedLength, HeuristicSchedule, Oracle
from specdistill.decoding.proposers import (
    BlockProposer,
    BlockRequest,
    DraftBlock,
    DraftLMProposer,
)
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.toy import toy_pair
from specdistill.drafts.prompt_lookup.hybrid import HybridProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer, lookup_match
from specdistill.models.acceptance_head import AcceptanceHead
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution
from tests.test_architectures import PROMPT, tiny_pair
from tests.test_engine import GREEDY, V, _all_policies, _prompts
from tests.test_proposers import _TargetLinear
from tests.test_vllm_backend import VLLM_PYTHON, needs_vllm
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

SMALL_V = 8
SMALL_SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
STAT_PROMPT = [1, 5, 2, 1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    return toy_pair(V)  # tests/test_engine.py's pair


# ---------------------------------------------------------------------------------------------- a test-only drafter


class _Stateless(BlockProposer):
    """A test proposer without state on the CPU: it covers nothing, so rollbacks have nothing to do."""

    forwards = 0

    @property
    def device(self) -> torch.device:
        return CPU

    @property
    def length(self) -> int:
        return 0

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self.forwards = 0

    def rollback(self, length: int) -> None:
        pass


class _IndependentBlock(_Stateless):
    """A block drafter as DFlash is one: every candidate of the block drawn from one forward pass, none seeing the
    others. Row i of the block's logits is the draft LM's next-token logits at the end of the context plus a fixed
    offset for block position i; its hidden rows are the draft's final-norm state there (what the acceptance heads
    of tests/test_engine.py read). No cache: each call runs the draft over the whole sequence.

    `lie`: draw from the offset logits but report the distribution without the offset (a broken proposer, to show
    that the distribution checks catch a q that is not the one the tokens were drawn from).
    """

    def __init__(self, draft: torch.nn.Module, vocab_size: int, block_size: int, lie: bool = False) -> None:
        self.draft, self.vocab_size, self.block_size, self.lie = draft, vocab_size, block_size, lie
        self.forwards = 0
        self.sizes: list[int] = []
        generator = torch.Generator().manual_seed(11)
        self.offsets = 0.7 * torch.randn(block_size, vocab_size, generator=generator)

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        out = self.draft(input_ids=tokens, output_hidden_states=True)
        self.forwards += 1
        size = min(self.block_size, request.max_length)
        logits = out.logits[0, -1, : self.vocab_size] + self.offsets[:size]
        drawn, q = request.draw(logits)
        if self.lie:
            _, q = request.draw(logits - self.offsets[:size])
        self.sizes.append(size)
        hidden = out.hidden_states[-1][0, -1].expand(size, -1) if request.with_hidden else None
        return DraftBlock(drawn, q, hidden)


# ---------------------------------------------------------------------------------------------- exactness


def test_a_block_drafter_is_lossless_in_greedy_mode_for_every_policy(pair):
    target, draft = pair
    prompts = _prompts(4)
    references = [autoregressive(target, p, 24, GREEDY, None, V).tokens for p in prompts]
    for name, (policy, max_draft_length) in _all_policies(draft).items():
        proposer = _IndependentBlock(draft, V, block_size=4)
        decoder = SpeculativeDecoder(
            target, proposer, policy, GREEDY, None, V, max_draft_length=max_draft_length
        )
        accepted = rejected = 0
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 24)
            assert result.tokens == reference, (
                f"the block drafter with {name} diverged from the target's greedy output"
            )
            accepted += result.stats.accepted_tokens
            rejected += result.stats.rejected_tokens
        assert accepted > 0 and (rejected > 0 or policy.withdraws_stop), name
        assert max(proposer.sizes) > 1  # candidates came several per call


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_a_block_drafter_is_lossless_on_llama_qwen2_and_gemma2(arch):
    target, draft = tiny_pair(arch, 32)
    reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)[
        0, len(PROMPT) :
    ].tolist()
    head = AcceptanceHead(draft.config.hidden_size, num_blocks=1)
    policies = [
        FixedLength(3),
        HeuristicSchedule(2),
        ConfidenceThreshold(0.3),
        Oracle(),
        AcceptanceHeadPolicy(head),
    ]
    for policy in policies:
        decoder = SpeculativeDecoder(
            target, _IndependentBlock(draft, 32, 5), policy, GREEDY, None, 32, max_draft_length=5
        )
        result = decoder.generate(PROMPT, 24)
        assert result.tokens == reference, f"{arch} with {type(policy).__name__} diverged from generate()"
        assert result.stats.accepted_tokens > 0


def _block_counts(proposer: BlockProposer, target: torch.nn.Module, samples: int = 500) -> torch.Tensor:
    """`(V, V)` counts of the first two tokens of 3-token generations: the first round drafts two candidates (a
    round emits at most its candidates and one more), both from one block, drawn without seeing each other."""
    decoder = SpeculativeDecoder(
        target, proposer, FixedLength(2), SMALL_SAMPLING, None, SMALL_V, max_draft_length=2
    )
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(SMALL_V, SMALL_V)
    for _ in range(samples):
        first, second, _ = decoder.generate(STAT_PROMPT, 3, generator).tokens
        counts[first, second] += 1
    return counts


def test_a_block_drafter_samples_the_target_distribution():
    target, draft = toy_pair(SMALL_V, hidden_size=16, num_heads=2, initializer_range=0.5, noise=1.0, seed=5)
    exact = exact_two_token_distribution(target, STAT_PROMPT, SMALL_SAMPLING, SMALL_V)
    honest = _IndependentBlock(draft, SMALL_V, block_size=2)
    assert matches_two_token_distribution(_block_counts(honest, target), exact)
    assert honest.sizes[0] == 2  # the first round's block held both tokens
    # the same drafter reporting a q its tokens were not drawn from is caught: the check has power
    liar = _IndependentBlock(draft, SMALL_V, block_size=2, lie=True)
    assert not matches_two_token_distribution(_block_counts(liar, target), exact)


# ---------------------------------------------------------------------------------------------- prompt lookup


def _lookup_by_definition(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule written out: the longest suffix n-gram (min_n..max_n) seen before, its earliest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(context) < n + 1:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_lookup_follows_the_longest_suffix_to_its_earliest_occurrence():
    context = torch.tensor([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3])
    assert lookup_match(context, 1, 3, 4)[1].tolist() == [4, 1, 2, 3]  # [1, 2, 3] first at 0
    assert lookup_match(context, 1, 3, 20)[1].tolist() == [
        4,
        1,
        2,
        3,
        9,
        1,
        2,
        3,
    ]  # cut at the context's end
    assert lookup_match(context, 4, 4, 4)[1].tolist() == []  # [9, 1, 2, 3] never came before
    assert lookup_match(torch.tensor([5]), 1, 3, 4)[1].tolist() == []
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        context = torch.randint(
            0, 4, (int(torch.randint(1, 30, (), generator=generator)),), generator=generator
        )
        for min_n, max_n in ((1, 1), (1, 3), (2, 4), (3, 3)):
            expected = _lookup_by_definition(context.tolist(), min_n, max_n, 5)
            assert lookup_match(context, min_n, max_n, 5)[1].tolist() == expected


@needs_vllm
def test_lookup_proposes_what_vllms_ngram_proposer_proposes():
    generator = torch.Generator().manual_seed(1)
    cases = []
    for _ in range(200):
        context = torch.randint(
            0, 5, (int(torch.randint(1, 40, (), generator=generator)),), generator=generator
        )
        min_n = int(torch.randint(1, 4, (), generator=generator))
        cases.append([context.tolist(), min_n, min_n + int(torch.randint(0, 3, (), generator=generator))])
    script = (
        "import json, sys\nimport numpy as np\n"
        "from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f\n"
        "cases = json.load(sys.stdin)\n"
        "print(json.dumps([f(np.array(c, dtype=np.int32), lo, hi, 10_000, 4).tolist() for c, lo, hi in cases]))\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", script], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [lookup_match(torch.tensor(c), lo, hi, 4)[1].tolist() for c, lo, hi in cases]
    assert ours == theirs
    assert sum(map(bool, ours)) > 50 and sum(not x for x in ours) > 50  # matches and misses both occurred


def _lookup_policies(draft):
    return {name: entry for name, entry in _all_policies(draft).items() if not entry[0].needs_hidden_states}


def test_prompt_lookup_is_lossless_in_greedy_mode_for_every_policy(pair):
    target, draft = pair
    # prompts that repeat themselves, so that lookup finds matches, and one that never does
    prompts = [[4, 7, 1, 4, 7, 1, 4, 7], [9, 3, 9, 3, 2, 9, 3], list(range(10))]
    references = [autoregressive(target, p, 30, GREEDY, None, V).tokens for p in prompts]
    for name, (policy, max_draft_length) in _lookup_policies(draft).items():
        decoder = SpeculativeDecoder(
            target, PromptLookupProposer(V, CPU), policy, GREEDY, None, V, max_draft_length=max_draft_length
        )
        drafted = 0
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 30)
            assert result.tokens == reference, (
                f"prompt lookup with {name} diverged from the target's greedy output"
            )
            assert result.stats.draft_forwards == 0
            drafted += result.stats.drafted_tokens
        assert drafted > 0, name


def test_prompt_lookup_samples_the_target_distribution():
    # STAT_PROMPT ends with the token it starts with: lookup proposes [5, 2], two point masses, every round
    target, _ = toy_pair(SMALL_V, hidden_size=16, num_heads=2, initializer_range=0.5, noise=1.0, seed=5)
    exact = exact_two_token_distribution(target, STAT_PROMPT, SMALL_SAMPLING, SMALL_V)
    counts = _block_counts(PromptLookupProposer(SMALL_V, CPU), target)
    assert matches_two_token_distribution(counts, exact)
    assert 0 < counts[5, 2] < counts.sum()  # both the acceptance and the residual paths ran


def test_a_round_with_nothing_to_propose_emits_one_target_token(pair):
    target, _ = pair
    prompt = list(range(12))  # no bigram repeats in it: nothing to look up at first
    decoder = SpeculativeDecoder(
        target, PromptLookupProposer(V, CPU, min_ngram=2), FixedLength(4), GREEDY, None, V
    )
    result = decoder.generate(prompt, 12)
    assert result.tokens == autoregressive(target, prompt, 12, GREEDY, None, V).tokens
    stats = result.stats
    assert (
        stats.draft_length_hist[0] > 0
    )  # the first round at least: nothing to verify, the target's token alone
    assert stats.rounds == stats.target_forwards
    # each round emits its accepted candidates and one more token
    assert stats.generated_tokens == stats.accepted_tokens + stats.rounds


# ---------------------------------------------------------------------------------------------- the hybrid


@pytest.mark.parametrize("inner", ["draft_lm", "target_states"])
def test_the_hybrid_is_lossless_and_drafts_from_both(pair, inner):
    target, draft = pair
    prompts = [[4, 7, 1, 4, 7, 1, 4, 7], [9, 3, 9, 3, 2, 9, 3], list(range(10)), [5, 11, 30, 2]]
    references = [autoregressive(target, p, 30, GREEDY, None, V).tokens for p in prompts]
    for name, (policy, max_draft_length) in _lookup_policies(draft).items():
        trained = DraftLMProposer(draft, V) if inner == "draft_lm" else _TargetLinear(target, V)
        hybrid = HybridProposer(PromptLookupProposer(V, CPU, min_ngram=2), trained)
        decoder = SpeculativeDecoder(
            target, hybrid, policy, GREEDY, None, V, max_draft_length=max_draft_length
        )
        lookup_rounds = draft_rounds = 0
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 30)
            assert result.tokens == reference, (
                f"the hybrid ({inner}) with {name} diverged from the target's output"
            )
            lookup_rounds += hybrid.lookup_rounds
            draft_rounds += hybrid.draft_rounds
        assert lookup_rounds > 0 and draft_rounds > 0, name


def test_the_hybrids_draft_rounds_stop_at_its_draft_length(pair):
    target, draft = pair
    prompts = [[4, 7, 1, 4, 7, 1, 4, 7], list(range(10)), [5, 11, 30, 2]]
    references = [autoregressive(target, p, 30, GREEDY, None, V).tokens for p in prompts]
    forwards = {}
    for cap in (None, 1):
        hybrid = HybridProposer(PromptLookupProposer(V, CPU, min_ngram=2), DraftLMProposer(draft, V), cap)
        decoder = SpeculativeDecoder(target, hybrid, FixedLength(4), GREEDY, None, V)
        forwards[cap] = rounds = 0
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 30)
            assert result.tokens == reference, cap
            forwards[cap] += result.stats.draft_forwards
            rounds += hybrid.draft_rounds
        assert rounds > 0, cap
    # a draft LM runs one forward per candidate: capped at one, its rounds cost a quarter of K = 4's, or less
    assert forwards[1] * 3 < forwards[None]
    with pytest.raises(ValueError, match="draft_length"):
        HybridProposer(PromptLookupProposer(V, CPU), DraftLMProposer(draft, V), draft_length=0)


def test_the_hybrids_lookup_lengths_choose_which_matches_lookup_drafts(pair):
    target, draft = pair
    prompts = [[4, 7, 1, 4, 7, 1, 4, 7], [9, 3, 9, 3, 2, 9, 3], list(range(10))]
    references = [autoregressive(target, p, 30, GREEDY, None, V).tokens for p in prompts]
    rounds = {}
    for lengths in (None, frozenset({2, 3}), frozenset()):
        hybrid = HybridProposer(
            PromptLookupProposer(V, CPU), DraftLMProposer(draft, V), lookup_lengths=lengths
        )
        decoder = SpeculativeDecoder(target, hybrid, FixedLength(4), GREEDY, None, V)
        rounds[lengths] = [0, 0]
        for prompt, reference in zip(prompts, references, strict=True):
            assert decoder.generate(prompt, 30).tokens == reference, lengths
            rounds[lengths][0] += hybrid.lookup_rounds
            rounds[lengths][1] += hybrid.draft_rounds
    # no kept length: every round is the draft's; only longer matches: fewer lookup rounds than every match
    assert rounds[frozenset()][0] == 0 and rounds[frozenset()][1] > 0
    assert 0 < rounds[frozenset({2, 3})][0] < rounds[None][0]
    with pytest.raises(ValueError, match="lookup_lengths"):
        HybridProposer(PromptLookupProposer(V, CPU), DraftLMProposer(draft, V), lookup_lengths=frozenset({0}))


def test_the_hybrid_samples_the_target_distribution_when_the_draft_proposes():
    target, draft = toy_pair(SMALL_V, hidden_size=16, num_heads=2, initializer_range=0.5, noise=1.0, seed=5)
    exact = exact_two_token_distribution(target, STAT_PROMPT, SMALL_SAMPLING, SMALL_V)
    # min_ngram 2: STAT_PROMPT's bigram suffix never came before, so the first round's two candidates are the draft's
    hybrid = HybridProposer(PromptLookupProposer(SMALL_V, CPU, min_ngram=2), DraftLMProposer(draft, SMALL_V))
    assert matches_two_token_distribution(_block_counts(hybrid, target), exact)
    assert hybrid.draft_rounds > 0


def test_the_hybrid_refuses_a_policy_that_reads_states_and_a_vocabulary_mismatch(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="vocab_size"):
        HybridProposer(PromptLookupProposer(V + 1, CPU), DraftLMProposer(draft, V))
    hybrid = HybridProposer(PromptLookupProposer(V, CPU), DraftLMProposer(draft, V))
    decoder = SpeculativeDecoder(target, hybrid, _all_policies(draft)["head"][0], GREEDY, None, V)
    with pytest.raises(ValueError, match="no hidden states for a policy to read"):
        decoder.generate([1, 2, 3, 4], 8)


# ---------------------------------------------------------------------------------------------- the contract


class _Broken(_Stateless):
    def __init__(self, make_block) -> None:
        self.vocab_size, self.make_block = V, make_block

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        return self.make_block(request)


@pytest.mark.parametrize(
    ("make_block", "match"),
    [
        (lambda r: DraftBlock(torch.zeros(r.max_length + 1, dtype=torch.long)), "at most 7 tokens"),
        (lambda r: DraftBlock(torch.zeros(1, 2, dtype=torch.long)), "a 1-D tensor"),
        (lambda r: [1, 2], "must return a DraftBlock"),
        (lambda r: DraftBlock(torch.zeros(2, dtype=torch.long), torch.rand(2, V - 1)), "q of shape"),
    ],
)
def test_a_block_that_breaks_the_contract_is_refused(pair, make_block, match):
    target, _ = pair
    decoder = SpeculativeDecoder(target, _Broken(make_block), FixedLength(3), GREEDY, None, V)
    with pytest.raises(ValueError, match=match):
        decoder.generate([1, 2, 3], 8)


def test_prompt_lookup_refuses_what_it_cannot_do(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="min_ngram must be an int >= 1"):
        PromptLookupProposer(V, CPU, min_ngram=0)
    with pytest.raises(ValueError, match=r"min_ngram \(3\) must be <= max_ngram \(2\)"):
        PromptLookupProposer(V, CPU, min_ngram=3, max_ngram=2)
    head_policy = _all_policies(draft)["head"][0]
    decoder = SpeculativeDecoder(target, PromptLookupProposer(V, CPU), head_policy, GREEDY, None, V)
    with pytest.raises(ValueError, match="no hidden states for a policy to read"):
        decoder.generate([1, 2, 1, 2], 8)
