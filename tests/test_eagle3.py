"""EAGLE-3 heads: the draft vocabulary, the head (its training-time unroll equals the decoded chain) on Llama, Qwen2
and Gemma-2 targets, and the proposer (lossless in greedy decoding for every policy and in sampling)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.eagle3.model import (
    Eagle3Cache,
    Eagle3Head,
    answer_token_counts,
    check_aux_layer_ids,
    draft_vocabulary,
    eagle3_config_for,
)
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from tests.architectures import ARCHITECTURES
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution, two_token_counts
from tests.test_engine import GREEDY, _all_policies
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 48
DRAFT_V = 32
LAYERS = 4
AUX = (1, 2, 3)  # output_hidden_states indices: the states entering decoder layers 1, 2 and 3
TARGETS = ("llama", "qwen2", "gemma2")


def tiny_target(name: str, vocab: int = V, seed: int = 0, **extra) -> torch.nn.Module:
    """tests/architectures.py's tiny config of `name` with `LAYERS` layers."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        **{**ARCHITECTURES[name], "num_hidden_layers": LAYERS, "vocab_size": vocab, **extra}
    )
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_head(
    target: torch.nn.Module, vocab: int = V, draft_vocab: int = DRAFT_V, seed: int = 0
) -> Eagle3Head:
    """A random head for `target` whose draft vocabulary is a random `draft_vocab` of the `vocab` tokens."""
    torch.manual_seed(seed)
    head = Eagle3Head(eagle3_config_for(target.config, vocab, draft_vocab, AUX))
    head.set_vocabulary(draft_vocabulary(torch.randperm(vocab), draft_vocab))
    head.attach_embeddings(target.get_input_embeddings())
    return head.eval()


def fused_states(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in AUX], dim=-1)


# ---------------------------------------------------------------------------------------------- draft vocabulary


def test_draft_vocabulary_keeps_the_most_frequent_tokens_ties_by_id():
    counts = torch.tensor([5, 1, 5, 0, 3, 1])
    vocab = draft_vocabulary(counts, 3)
    assert vocab.ids.tolist() == [0, 2, 4]
    assert vocab.d2t.tolist() == [0, 1, 2]  # target id = i + d2t[i]
    assert vocab.t2d.tolist() == [True, False, True, False, True, False]
    assert draft_vocabulary(counts, 4).ids.tolist() == [0, 1, 2, 4]  # 1 and 5 tie: the smaller id wins
    assert draft_vocabulary(counts, 6).ids.tolist() == list(range(6))  # unseen tokens fill it, by id
    for size in (0, 7, True):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            draft_vocabulary(counts, size)


def test_answer_token_counts_count_answer_labels_only():
    counts = answer_token_counts([[-100, 3, 3, 1], [-100, -100, 0]], vocab_size=5)
    assert counts.tolist() == [1, 1, 0, 2, 0]
    with pytest.raises(ValueError, match="outside"):
        answer_token_counts([[7]], vocab_size=5)


def test_aux_layer_ids_must_name_states_entering_decoder_layers():
    assert check_aux_layer_ids((2, 16, 29), 32) == (2, 16, 29)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        check_aux_layer_ids((2, 3, 4), 4)  # 4 is the last state, after the final norm
    for ids in [(2, 3, 3), (3, 2, 1), (1, 2)]:  # vLLM collects each layer once, in layer order
        with pytest.raises(ValueError, match="strictly increasing"):
            check_aux_layer_ids(ids, 8)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        eagle3_config_for(
            tiny_target("llama", num_hidden_layers=2).config, V, DRAFT_V, None
        )  # default (2, 1, -1)


# ---------------------------------------------------------------------------------------------- the head


@pytest.mark.parametrize("name", TARGETS)
def test_unroll_equals_the_decoded_chain(name):
    target = tiny_target(name)
    head = tiny_head(target)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a right-padded row
    features = fused_states(target, ids)
    steps = 3
    with torch.no_grad():
        unrolled = head.unroll(features, ids, mask, steps)
        for row, anchor in [
            (0, 0),
            (0, 5),
            (0, 8),
            (1, 4),
            (1, 5),
        ]:  # row 1: anchors whose chain stays in row
            cache = Eagle3Cache()
            real = torch.arange(anchor + 1)
            out = head(head.embed(ids[row : row + 1, 1 : anchor + 2]), head.fuse(features[row : row + 1, real]),
                       real, cache)  # fmt: skip
            for step in range(steps):
                torch.testing.assert_close(out.logits[0, -1], unrolled[step].logits[row, anchor])
                torch.testing.assert_close(out.normed[0, -1], unrolled[step].normed[row, anchor])
                if step == steps - 1:
                    break
                position = anchor + step + 1
                token = ids[row : row + 1, position + 1 : position + 2]
                out = head(head.embed(token), out.hidden[:, -1:], torch.tensor([position]), cache)
        for start in (1, 5, 11):  # later anchors only: the same outputs, every position still attended to
            late = head.unroll(features, ids, mask, steps, start)
            for step in range(steps):
                torch.testing.assert_close(late[step].normed, unrolled[step].normed[:, start:])
                torch.testing.assert_close(late[step].logits, unrolled[step].logits[:, start:])


def test_the_head_trains_its_own_weights_only():
    target = tiny_target("llama")
    head = tiny_head(target)
    ids = torch.randint(0, V, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row: its pad queries attend to themselves, never to nothing
    outs = head.unroll(fused_states(target, ids), ids, mask, 2)
    sum(out.logits[mask.bool()].square().sum() for out in outs).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    assert target.get_input_embeddings().weight.grad is None
    assert not any(
        "embed" in name for name in head.state_dict()
    )  # the target's embeddings are not the head's
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight"} <= set(head.state_dict())  # fmt: skip
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * head.config.hidden_size


# ---------------------------------------------------------------------------------------------- the proposer


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(2, 9, (), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]  # fmt: skip


def test_the_proposer_gives_no_mass_outside_the_draft_vocabulary():
    target = tiny_target("llama")
    head = tiny_head(target)
    proposer = Eagle3Proposer(head, V)
    decoder = SpeculativeDecoder(target, proposer, FixedLength(3), GREEDY, None, V)
    seen: list[torch.Tensor] = []
    original = proposer.propose

    def recording(tokens, with_hidden):
        proposal = original(tokens, with_hidden)
        seen.append(proposal.logits)
        return proposal

    proposer.propose = recording
    decoder.generate([3, 1, 4, 1, 5], 12)
    assert seen and not any(
        torch.all(logits == 0) for logits in seen
    )  # never asked before the target's states
    for logits in seen:
        assert torch.isinf(logits[~head.t2d]).all() and torch.isfinite(logits[head.t2d]).all()


def test_the_first_round_only_prefills_and_the_head_drafts_from_the_second():
    """Before the target has read the prompt the head has no states to draft from: the first round sends no
    candidates (the target's next token alone, as vLLM's EAGLE drafts after the prefill), the second drafts."""
    target = tiny_target("llama")
    proposer = Eagle3Proposer(tiny_head(target), V)
    decoder = SpeculativeDecoder(target, proposer, FixedLength(3), GREEDY, None, V)
    two = decoder.generate([3, 1, 4, 1, 5], 2).stats  # round 1 prefills, round 2 may emit only one token
    assert (two.rounds, two.drafted_tokens, two.draft_forwards, two.target_forwards) == (2, 0, 0, 2)
    more = decoder.generate([3, 1, 4, 1, 5], 12).stats
    # the first round empty, the last one too when a single token is left; the others draft up to 3
    assert more.draft_length_hist[0] in (1, 2) and more.draft_length_hist[3] >= 1


@pytest.mark.parametrize("name", TARGETS)
def test_greedy_decoding_equals_the_target_for_every_policy(name):
    target = tiny_target(name)
    head = tiny_head(target)
    proposer = Eagle3Proposer(head, V)
    prompts = _prompts(3)
    references = [autoregressive(target, p, 24, GREEDY, None, V).tokens for p in prompts]
    policies = {key: entry for key, entry in _all_policies(head).items() if key in
                ("fixed1", "fixed4", "heuristic", "confidence", "entropy", "oracle", "head")}  # fmt: skip
    stats = []
    for key, (policy, bound) in policies.items():
        decoder = SpeculativeDecoder(target, proposer, policy, GREEDY, None, V, max_draft_length=bound)
        results = [decoder.generate(prompt, 24) for prompt in prompts]
        assert [r.tokens for r in results] == references, (
            f"{name} with {key} diverged from the target's greedy output"
        )
        stats += [r.stats for r in results]
    assert sum(s.drafted_tokens for s in stats) > 0 and sum(s.rejected_tokens for s in stats) > 0


SMALL_V = 8
SMALL_SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)


def exact_third_and_fourth(target, prompt: list[int], sampling: SamplingConfig, vocab: int) -> torch.Tensor:
    """`(V, V)` exact probability of the third and fourth generated tokens (the first two enumerated): by then the
    target has verified once, so the head drafts from its states (the first round has none)."""
    first_two = exact_two_token_distribution(target, prompt, sampling, vocab)
    joint = torch.zeros(vocab, vocab, dtype=first_two.dtype)
    for a in range(vocab):
        for b in range(vocab):
            joint += first_two[a, b] * exact_two_token_distribution(target, [*prompt, a, b], sampling, vocab)
    return joint


@pytest.mark.parametrize("later", [False, True], ids=["tokens_1_2", "tokens_3_4"])
def test_sampling_follows_the_target_distribution(later):
    prompt = [1, 5, 2, 1]
    target = tiny_target("llama", vocab=SMALL_V, seed=5, initializer_range=0.1)
    head = tiny_head(target, vocab=SMALL_V, draft_vocab=5, seed=5)
    proposer = Eagle3Proposer(head, SMALL_V)
    decoder = SpeculativeDecoder(
        target, proposer, FixedLength(2), SMALL_SAMPLING, None, SMALL_V, max_draft_length=2
    )
    if not later:
        counts = two_token_counts(decoder, prompt, SMALL_V, samples=400)
        exact = exact_two_token_distribution(target, prompt, SMALL_SAMPLING, SMALL_V)
    else:
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros(SMALL_V, SMALL_V)
        head_forwards = 0
        for _ in range(500):
            result = decoder.generate(prompt, 4, gen)
            third, fourth = result.tokens[2:4]
            counts[third, fourth] += 1
            head_forwards += result.stats.draft_forwards
        assert head_forwards > 0  # the head drafted from the target's states
        exact = exact_third_and_fourth(target, prompt, SMALL_SAMPLING, SMALL_V)
    assert matches_two_token_distribution(counts, exact)
