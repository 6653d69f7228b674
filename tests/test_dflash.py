"""DFlash block drafters: decoding a block equals training it (bidirectional within the block, blind to the context
at and after its anchor), the proposer is lossless on Llama, Qwen2 and Gemma-2 targets under every policy (greedy,
random and briefly trained drafters) and in sampling, honours the block proposer contract; the kind's training rows,
teacher-forced states, chain candidates, export and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.proposers import BlockRequest
from specdistill.decoding.proposers.base import TargetHidden
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts import KIND_FILE, load_draft, target_pass
from specdistill.drafts.base import NO_CANDIDATE
from specdistill.drafts.dflash import DFlash, DFlashConfig, DFlashDrafter, DFlashProposer
from specdistill.drafts.dflash.export import export_config
from specdistill.drafts.dflash.kind import ANCHORS_PER_PASS, block_anchors
from specdistill.errors import ConfigError
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.divergence import forward_kl
from specdistill.models.loading import ModelSpec, freeze
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution
from tests.test_eagle3 import LAYERS, TARGETS, V, tiny_target
from tests.test_engine import GREEDY, _all_policies
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

LAYER_IDS = (1, 2, 3)  # what DFlash's default spreads over a 4-layer target


def dflash(
    target: torch.nn.Module, block_size: int = 4, num_layers: int = 1, seed: int = 0, **settings
) -> tuple[DFlash, DFlashDrafter]:
    """The kind resolved for `target` and a random drafter it builds, in eval mode."""
    kind = DFlash(block_size=block_size, num_layers=num_layers, **settings).resolve(target)
    torch.manual_seed(seed)
    drafter = kind.build(target, int(target.get_input_embeddings().weight.shape[0]))
    return kind, drafter.eval()


def livelier(drafter: DFlashDrafter, std: float = 0.3, seed: int = 1) -> DFlashDrafter:
    """Larger random weights: at the built initialisation (std 0.02) every attention is nearly uniform, so what a
    block position sees would barely show in its state."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
    return drafter


def features(target: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`(B, T, 3 H)` the target's states at `LAYER_IDS`, concatenated (what `fc` reads)."""
    with torch.no_grad():
        states = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in LAYER_IDS], dim=-1)


def padded_batch(vocab: int = V, length: int = 12, real: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two rows, the second right-padded after `real` tokens; the first 4 tokens of each are the prompt."""
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, real:] = 0
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, real:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def block(drafter: DFlashDrafter, feats: torch.Tensor, batch, anchor: int, row: int = 0) -> torch.Tensor:
    """`(block_size, H)`: the one block anchored at `anchor` in `row`, alone in its `blocks` pass."""
    anchors = torch.full((feats.shape[0], 1), -1)
    anchors[row, 0] = anchor
    with torch.no_grad():
        return drafter.blocks(feats, batch["input_ids"], batch["attention_mask"], anchors)[row, 0]


# ---------------------------------------------------------------------------------------------- the drafter


@pytest.mark.parametrize("name", TARGETS)
def test_decoding_a_block_equals_training_it(name):
    """`draft()` after `extend_cache` with the target's states of positions < a (from an unpadded run of the row,
    fed in two pieces) is the block `blocks()` anchored at a, for several anchors per row, in a right-padded row
    too, with two layers (each layer's cached keys and values)."""
    target = tiny_target(name)
    _, drafter = dflash(target, block_size=4, num_layers=2)
    livelier(drafter)
    batch = padded_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # 11: the block runs past the row's end; 8: row 1's last real token
    anchors = torch.tensor([[1, 4, 7, 11], [2, 5, 8, -1]])
    with torch.no_grad():
        trained = drafter.blocks(features(target, ids, mask), ids, mask, anchors)
    assert trained.shape == (2, 4, 4, drafter.config.hidden_size)
    checked = 0
    for row, real in ((0, 12), (1, 9)):
        context = features(target, ids[row : row + 1, :real])
        for i, anchor in enumerate(anchors[row].tolist()):
            if anchor < 0:
                continue
            cache = drafter.new_cache()
            with torch.no_grad():
                drafter.extend_cache(cache, context[:, : anchor // 2])
                drafter.extend_cache(cache, context[:, anchor // 2 : anchor])
                assert len(cache) == anchor
                decoded = drafter.draft(cache, ids[row, anchor : anchor + 1])[0]
            torch.testing.assert_close(decoded, trained[row, i], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == 7
    # the states differ from block to block: the comparison above is not between constants
    assert (trained[0, 0] - trained[0, 1]).abs().max() > 1e-2


def test_a_block_sees_its_whole_block_and_no_context_at_or_after_its_anchor():
    target = tiny_target("llama")
    _, drafter = dflash(target, block_size=4, num_layers=2)
    livelier(drafter)
    batch = padded_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    feats = features(target, ids, mask)
    anchors = torch.tensor([[3, 7], [4, -1]])

    def run(f: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return drafter.blocks(f, ids, mask, anchors)

    base = run(feats)
    later = feats.clone()
    later[:, 5:] += 3 * torch.randn(later[:, 5:].shape, generator=torch.Generator().manual_seed(0))
    moved = run(later)
    torch.testing.assert_close(moved[0, 0], base[0, 0])  # anchored at 3: positions >= 5 unseen
    torch.testing.assert_close(moved[1, 0], base[1, 0])  # anchored at 4, in the padded row
    # anchored at 7: sees positions 5 and 6, at every block position
    assert (moved[0, 1] - base[0, 1]).abs().amax(-1).min() > 1e-3
    earlier = feats.clone()
    earlier[:, 2] += 3.0
    # position 2 is context of all three blocks
    assert (run(earlier) - base)[anchors >= 0].abs().amax(-1).min() > 1e-3

    # bidirectional within the block: another input at the last block position changes every earlier one
    cache = drafter.new_cache()
    with torch.no_grad():
        drafter.extend_cache(cache, feats[:1, :6])
        decoded = drafter.draft(cache, ids[0, 6:7])[0]
        inputs = drafter.embed(torch.tensor([[int(ids[0, 6])] + [drafter.config.mask_token_id] * 3]))
        positions = torch.arange(6, 10)
        contexts = [kv for kv in cache.layers if kv is not None]
        torch.testing.assert_close(drafter.run(inputs, positions, contexts, None)[0], decoded)
        inputs[0, 3] = drafter.embed(torch.tensor([[5]]))[0, 0]
        changed = drafter.run(inputs, positions, contexts, None)[0]
    assert (changed[:3] - decoded[:3]).abs().amax(-1).min() > 1e-3


def test_the_layers_are_qwen3_layers_of_the_exported_config():
    """vLLM's `qwen3_dflash` runs the export as Qwen3 decoder layers: a layer's keys and values are those of the fused
    context (no input norm) followed by the block's, its queries the block's, all attended to. Transformers' own
    Qwen3 layers built from the exported `config.json`, with our weights, give the drafted states (GQA grouping,
    `q_norm`/`k_norm`, RoPE, residuals as vLLM computes them)."""
    target = tiny_target("llama")
    _, drafter = dflash(target, block_size=4, num_layers=2)
    livelier(drafter)
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Qwen3Config.from_dict(export_config(drafter, tokenizer))
    # eager attention without a mask attends to every key, as vLLM's non-causal DFlash layers do
    config._attn_implementation = "eager"
    weights = drafter.state_dict()
    layers = []
    for i in range(2):
        layer = Qwen3DecoderLayer(config, i).eval()
        layer.load_state_dict(
            {k.removeprefix(f"layers.{i}."): v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        )
        layers.append(layer)
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(5))
    feats, start = features(target, ids), 6
    norms = {}
    for name in ("hidden_norm", "norm"):
        norms[name] = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].load_state_dict({"weight": weights[f"{name}.weight"]})
    with torch.no_grad():
        cache = drafter.new_cache()
        drafter.extend_cache(cache, feats[:, :start])
        ours = drafter.draft(cache, ids[0, start : start + 1])[0]
        context = norms["hidden_norm"](feats[:, :start] @ weights["fc.weight"].T)  # DFlash's fused context
        x = target.get_input_embeddings()(
            torch.tensor([[int(ids[0, start])] + [drafter.config.mask_token_id] * 3])
        )
        rotary = Qwen3RotaryEmbedding(config)(x, torch.arange(start + 4)[None])
        for layer in layers:
            attended, _ = layer.self_attn(torch.cat([context, layer.input_layernorm(x)], dim=1), rotary, None)
            x = x + attended[:, start:]  # the context's own queries are not part of the block
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        theirs = norms["norm"](x)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- losslessness


def _target_text(target: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """The target's greedy continuations of `prompts` (what the engine must reproduce), prompts included."""
    return torch.tensor([p + autoregressive(target, p, new_tokens, GREEDY, None, V).tokens for p in prompts])


def _train(kind: DFlash, drafter: DFlashDrafter, target, text: torch.Tensor, prompt: int, steps: int) -> None:
    """A few optimizer steps of `kind.training_rows` with ForwardKL on `text`, its continuations the answers."""
    batch = {"input_ids": text, "attention_mask": torch.ones_like(text)}
    keep = torch.zeros(text.shape[0], text.shape[1] - 1, dtype=torch.bool)
    keep[:, prompt - 1 :] = True
    with torch.no_grad():
        passed = target_pass(target, batch, keep, V, kind.target_layers)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=0.03)
    drafter.train()
    for _ in range(steps):
        rows = kind.training_rows(drafter, batch, keep, passed, V)
        loss = (ForwardKL().rows(rows.target, rows.draft) * rows.weight).sum() / rows.weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()


@pytest.mark.parametrize("name", TARGETS)
def test_greedy_decoding_equals_the_target_for_every_policy(name):
    """A random drafter (nearly every candidate rejected) and one trained for 60 steps on the target's own greedy
    text (decoded from that text's prompts: whole blocks get accepted) both give the target's greedy output."""
    target = tiny_target(name, initializer_range=0.3)  # peaked distributions: a greedy choice is no near-tie
    prompts = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(3)).tolist()
    text = _target_text(target, prompts, 24)
    kind, random_drafter = dflash(target)
    _, trained = dflash(target, seed=1, blocks_per_sequence=32)  # every answer position anchors a block
    _train(kind, trained, target, text, prompt=4, steps=60)
    acceptance, whole_blocks = {}, {}
    for label, drafter, used in (("random", random_drafter, prompts[:2]), ("trained", trained, prompts[:3])):
        proposer = kind.proposer(drafter, V)
        assert isinstance(proposer, DFlashProposer)
        stats = []
        for key, (policy, bound) in _all_policies(drafter).items():
            decoder = SpeculativeDecoder(target, proposer, policy, GREEDY, None, V, max_draft_length=bound)
            for prompt, reference in zip(used, text.tolist(), strict=False):
                result = decoder.generate(prompt, 24)
                assert result.tokens == reference[4:], (
                    f"{name}, {label} drafter, {key}: diverged from the target"
                )
                stats.append(result.stats)
        assert sum(s.rejected_tokens for s in stats) > 0, label
        acceptance[label] = sum(s.accepted_tokens for s in stats) / sum(s.drafted_tokens for s in stats)
        whole_blocks[label] = sum(s.accepted_by_position[2] for s in stats if len(s.accepted_by_position) > 2)
    # some of the trained drafter's whole blocks (3 candidates) were accepted: the bonus after a full block ran
    assert whole_blocks["trained"] > 0, whole_blocks
    assert acceptance["trained"] > max(0.2, 3 * acceptance["random"]), acceptance


SMALL_V = 8
SMALL_SAMPLING = SamplingConfig(temperature=0.7, top_k=5)  # a q off the warped one puts mass where p has none
STAT_PROMPT = [1, 5, 2, 1]


class _Liar(DFlashProposer):
    """Draws as DFlash does but reports each candidate's q sharpened (a q its token was not drawn from)."""

    def propose_block(self, tokens, request):
        drafted = super().propose_block(tokens, request)
        if drafted.q is None:
            return drafted
        sharp = drafted.q.pow(4)
        return type(drafted)(drafted.tokens, sharp / sharp.sum(-1, keepdim=True), drafted.hidden)


def _second_and_third(proposer, target, samples: int = 500) -> tuple[torch.Tensor, int, int]:
    """`(V, V)` counts of the 2nd and 3rd generated tokens, and the accepted and rejected candidates: the first round
    only prefills (DFlash drafts from the target's states), the second drafts both from one block."""
    decoder = SpeculativeDecoder(
        target, proposer, FixedLength(2), SMALL_SAMPLING, None, SMALL_V, max_draft_length=2
    )
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(SMALL_V, SMALL_V)
    accepted = rejected = 0
    for _ in range(samples):
        result = decoder.generate(STAT_PROMPT, 4, generator)
        counts[result.tokens[1], result.tokens[2]] += 1
        assert result.stats.draft_length_hist[2] == 1  # one block of two (after the prefill round)
        accepted += result.stats.accepted_tokens
        rejected += result.stats.rejected_tokens
    return counts, accepted, rejected


def test_sampling_follows_the_target_distribution():
    target = tiny_target("llama", vocab=SMALL_V, seed=5, initializer_range=0.1)
    _, drafter = dflash(target)
    livelier(drafter, std=0.1)
    first = exact_two_token_distribution(target, STAT_PROMPT, SMALL_SAMPLING, SMALL_V).sum(1)
    exact = sum(
        first[a] * exact_two_token_distribution(target, [*STAT_PROMPT, a], SMALL_SAMPLING, SMALL_V)
        for a in range(SMALL_V)
    )
    counts, accepted, rejected = _second_and_third(DFlashProposer(drafter, SMALL_V), target)
    assert matches_two_token_distribution(counts, exact)
    assert accepted > 100 and rejected > 100  # both the acceptance and the residual paths ran
    # the same drafter reporting a q its tokens were not drawn from is caught: the check has power
    counts, _, _ = _second_and_third(_Liar(drafter, SMALL_V), target)
    assert not matches_two_token_distribution(counts, exact)


# ---------------------------------------------------------------------------------------------- the proposer contract


def _greedy_request(max_length: int, with_hidden: bool) -> BlockRequest:
    def draw(logits):
        return logits.argmax(-1), logits.softmax(-1)

    return BlockRequest(max_length, with_hidden, False, draw)


def _observed(target, ids: torch.Tensor, start: int, verified: int, candidates: int = 0, accepted: int = 0):
    """The `TargetHidden` of a verification pass over positions `start ..` of `ids` `(1, T)`."""
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    rows = tuple(states[i][0, start:] for i in LAYER_IDS)
    return TargetHidden(start, rows, candidates, accepted, verified)


def _round(proposer: DFlashProposer, tokens: torch.Tensor, with_hidden: bool, cap: int = 10):
    """Ask for candidates one call at a time (as the engine asks a `chained` proposer) until an empty block or
    `cap`: the blocks, and the tokens with the candidates appended."""
    blocks = []
    while len(blocks) < cap:
        block = proposer.propose_block(tokens, _greedy_request(cap - len(blocks), with_hidden))
        if not len(block):
            break
        blocks.append(block)
        tokens = torch.cat([tokens, block.tokens.view(1, -1)], dim=1)
    return blocks, tokens


class _CountingRows:
    """Wraps a proposer's output layer and counts the rows it scores."""

    def __init__(self, head) -> None:
        self.head, self.rows = head, 0

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        self.rows += states.shape[0]
        return self.head(states)


def test_the_proposer_honours_the_block_contract():
    target = tiny_target("llama")
    _, drafter = dflash(target, block_size=4, num_layers=2)
    livelier(drafter)
    proposer = DFlashProposer(drafter, V)
    assert proposer.target_hidden_layers == LAYER_IDS and proposer.drafts_after_prefill
    assert proposer.chained and proposer.drafts_in_one_pass
    scored = proposer._head = _CountingRows(proposer._head)
    seq = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(2))
    prompt = 6
    proposer.start(seq[:, :prompt], 32, "dynamic")
    # before the first verification: nothing to draft from, an empty block and no forward
    empty = proposer.propose_block(seq[:, :prompt], _greedy_request(3, True))
    assert len(empty) == 0 and proposer.forwards == 0 and proposer.length == 0

    proposer.observe_target(_observed(target, seq[:, :prompt], 0, prompt))  # the prefill
    proposer.rollback(0)
    tokens = seq[:, : prompt + 1]  # the target's token after the prompt is the newest
    with torch.no_grad():
        cache = drafter.new_cache()
        drafter.extend_cache(cache, features(target, seq[:, :prompt]))
        states = drafter.draft(cache, seq[0, prompt : prompt + 1])[0]
        logits = drafter.output_head(V)(states)
    first = proposer.propose_block(tokens, _greedy_request(2, True))
    # one candidate per call, and only its row scored: a round the policy stops here scored one row, not three
    assert len(first) == 1 and proposer.forwards == 1 and proposer.length == prompt and scored.rows == 1
    torch.testing.assert_close(first.hidden, states[1:2])  # row i: the state that scored candidate i
    torch.testing.assert_close(first.q.sum(-1), torch.ones(1))
    assert first.q.shape == (1, V) and first.tokens.tolist() == logits[1:2].argmax(-1).tolist()
    proposer.rollback(prompt)  # the round is over: the next call runs a new block
    blocks, _ = _round(proposer, tokens, True)
    # the rest of the block comes from the same pass, then an empty block: 3 candidates, 4 rows scored in all
    assert [len(b) for b in blocks] == [1, 1, 1] and proposer.forwards == 2 and scored.rows == 4
    torch.testing.assert_close(torch.cat([b.hidden for b in blocks]), states[1:])
    assert torch.cat([b.tokens for b in blocks]).tolist() == logits[1:].argmax(-1).tolist()
    without = proposer.propose_block(tokens, _greedy_request(10, False))
    assert without.hidden is None and without.tokens.tolist() == first.tokens.tolist()

    # the rollback crops the context cache, every layer of it; the next block re-reads the states it dropped
    proposer.rollback(prompt - 2)
    assert proposer.length == prompt - 2
    assert all(kv[0].shape[2] == kv[1].shape[2] == prompt - 2 for kv in proposer._cache.layers)
    again = proposer.propose_block(tokens, _greedy_request(2, True))
    torch.testing.assert_close(again.hidden, first.hidden, rtol=1e-5, atol=1e-6)
    assert proposer.length == prompt
    with pytest.raises(ValueError, match="rollback"):
        proposer.rollback(prompt + 1)

    # a verification of the newest token and 3 candidates, 1 accepted: 2 more verified positions
    proposer.observe_target(_observed(target, seq, prompt, prompt + 2, candidates=3, accepted=1))
    proposer.rollback(prompt)
    after, _ = _round(proposer, seq[:, : prompt + 3], True)
    with torch.no_grad():
        fresh = drafter.new_cache()
        drafter.extend_cache(fresh, features(target, seq[:, : prompt + 2]))
        expected = drafter.draft(fresh, seq[0, prompt + 2 : prompt + 3])[0, 1:]
    torch.testing.assert_close(torch.cat([b.hidden for b in after]), expected, rtol=1e-4, atol=1e-5)
    assert proposer.length == prompt + 2
    proposer.rollback(prompt + 2)
    with pytest.raises(ValueError, match="the target's states cover 8"):
        proposer.propose_block(seq[:, : prompt + 4], _greedy_request(3, False))


def test_the_engine_counts_one_drafter_pass_per_round():
    target = tiny_target("qwen2")
    kind, drafter = dflash(target, block_size=8)
    proposer = kind.proposer(drafter, V)
    scored = proposer._head = _CountingRows(proposer._head)
    decoder = SpeculativeDecoder(target, proposer, FixedLength(5), GREEDY, None, V)
    prompt = [3, 1, 4, 1, 5]
    result = decoder.generate(prompt, 30)
    assert result.tokens == autoregressive(target, prompt, 30, GREEDY, None, V).tokens
    stats = result.stats
    drafting_rounds = stats.rounds - stats.draft_length_hist[0]
    assert stats.draft_length_hist[0] in (1, 2)  # the prefill round, and the last one when one token is left
    assert stats.draft_forwards == drafting_rounds > 1
    assert stats.drafted_tokens >= 4 * stats.draft_forwards  # most rounds drafted 5 candidates in one pass
    # the policy's 5 of the block's 7 candidates: only the rows drafted were scored
    assert scored.rows == stats.drafted_tokens < 7 * stats.draft_forwards


def test_a_drafter_in_float32_drafts_on_a_bfloat16_target():
    """`DFlash.build` makes an fp32 drafter whatever the target's dtype: its states go through the bf16 target's
    output layer when decoding and in the teacher-forced states, outside autocast."""
    target = tiny_target("llama").to(torch.bfloat16)
    kind, drafter = dflash(target)
    assert drafter.fc.weight.dtype == torch.float32
    result = SpeculativeDecoder(target, kind.proposer(drafter, V), FixedLength(3), GREEDY, None, V).generate(
        [3, 1, 4, 1], 8
    )
    assert result.stats.draft_forwards > 0
    batch = padded_batch()
    states = kind.teacher_forced(drafter, target, batch, V)
    logits = states.head(states.hidden)
    assert logits.shape == (2, 12, V) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------- training rows


def _rows_by_definition(keep: torch.Tensor, anchors: torch.Tensor, size: int, decay: float):
    """`(answer_index, weight)` of every row the blocks at `anchors` score, in order: block position `j` of the block
    anchored at `a` scores token `a + j`, the answer row `a + j - 1` when that is an answer, weighted
    `exp(-(j - 1) / decay)`."""
    answer_of = {tuple(p): i for i, p in enumerate(keep.nonzero().tolist())}  # row-major answer index
    index, weight = [], []
    for row, row_anchors in enumerate(anchors.tolist()):
        for anchor in row_anchors:
            for j in range(1, size):
                if anchor >= 0 and (row, anchor + j - 1) in answer_of:
                    index.append(answer_of[row, anchor + j - 1])
                    weight.append(math.exp(-(j - 1) / decay))
    return index, weight


def test_training_rows_weight_each_block_position_and_point_at_its_answer_token():
    target = tiny_target("llama")
    kind, drafter = dflash(target, block_size=4, blocks_per_sequence=16, loss_decay=2.0)
    livelier(drafter)
    batch = padded_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        full = target(input_ids=ids, attention_mask=mask).logits[..., :V]
    state = block(drafter, features(target, ids, mask), batch, 5)  # the block anchored at 5 in row 0, alone
    # answers after a 4-token prompt (row 0: positions 3..10, row 1: 3..7, padded from 9), or every real token
    after_prompt = answer_mask(batch["labels"])
    everything = answer_mask(torch.where(mask.bool(), ids, -100))
    for keep, answers in (
        (after_prompt, [range(3, 11), range(3, 8)]),
        (everything, [range(0, 11), range(0, 8)]),
    ):
        with torch.no_grad():
            rows = kind.training_rows(drafter, batch, keep, target_pass(target, batch, keep, V, LAYER_IDS), V)
            per_row = ForwardKL().rows(rows.target, rows.draft)
        # more blocks per sequence than answers: every answer position anchors one, -1 fills the shorter row
        anchors = block_anchors(keep, ids, 16, kind.anchor_seed)
        width = anchors.shape[1]
        assert anchors.tolist() == [[*span] + [-1] * (width - len(span)) for span in answers]
        expected_index, expected_weight = _rows_by_definition(keep, anchors, 4, 2.0)
        assert rows.answer_index.tolist() == expected_index
        torch.testing.assert_close(rows.weight, torch.tensor(expected_weight))
        # each row's last two blocks reach past its answer (padding, the end): 3 of their rows are left out
        assert len(rows.draft) == len(rows.target) == len(expected_index) == 3 * int(keep.sum()) - 2 * 3

        # by hand for the block anchored at 5 in row 0: position j against the target's row 5 + j - 1
        answer_of = {tuple(p): i for i, p in enumerate(keep.nonzero().tolist())}
        for j in range(1, 4):
            (i,) = [
                i
                for i, (a, w) in enumerate(zip(expected_index, expected_weight, strict=True))
                if a == answer_of[0, 5 + j - 1] and w == math.exp(-(j - 1) / 2.0)
            ]
            torch.testing.assert_close(rows.draft.hidden[i], state[j], rtol=1e-4, atol=1e-5)
            target_logits = rows.target.head(rows.target.hidden[i])
            torch.testing.assert_close(target_logits, full[0, 5 + j - 1], rtol=1e-4, atol=1e-5)
            by_hand = forward_kl(full[0, 5 + j - 1][None], drafter.output_head(V)(state[j])[None])
            torch.testing.assert_close(per_row[i : i + 1], by_hand, rtol=1e-4, atol=1e-6)


def test_anchors_are_the_same_for_the_same_batch_and_differ_for_another():
    target = tiny_target("llama")
    kind, drafter = dflash(target, blocks_per_sequence=3)
    batch = padded_batch()
    keep = answer_mask(batch["labels"])
    anchors = block_anchors(keep, batch["input_ids"], 3, 0)
    for row, chosen in enumerate(anchors.tolist()):
        assert len(set(chosen)) == 3 and chosen == sorted(chosen) and all(keep[row, a] for a in chosen)
    assert torch.equal(block_anchors(keep, batch["input_ids"], 3, 0), anchors)
    other = padded_batch(seed=2)
    assert not torch.equal(block_anchors(keep, other["input_ids"], 3, 0), anchors)
    assert not torch.equal(block_anchors(keep, batch["input_ids"], 3, 1), anchors)  # anchor_seed
    assert block_anchors(torch.zeros_like(keep), batch["input_ids"], 3, 0).tolist() == [[-1], [-1]]

    # the same rows twice, and for a reference drafter too (AdaSPEC's KindReference compares them row by row)
    _, reference = dflash(target, seed=7)
    with torch.no_grad():
        passed = target_pass(target, batch, keep, V, kind.target_layers)
        first = kind.training_rows(drafter, batch, keep, passed, V)
        second = kind.training_rows(drafter, batch, keep, passed, V)
        theirs = kind.training_rows(reference, batch, keep, passed, V)
        moved = kind.training_rows(
            drafter, other, keep, target_pass(target, other, keep, V, kind.target_layers), V
        )
    assert torch.equal(first.answer_index, second.answer_index) and torch.equal(first.weight, second.weight)
    torch.testing.assert_close(first.draft.hidden, second.draft.hidden)
    assert torch.equal(first.answer_index, theirs.answer_index)
    assert not torch.equal(first.answer_index, moved.answer_index)


def test_a_gradient_step_reduces_the_weighted_divergence():
    target = freeze(tiny_target("gemma2", initializer_range=0.3))  # as the stages load it
    kind, drafter = dflash(target, blocks_per_sequence=4)
    drafter.train()
    batch = padded_batch()
    keep = answer_mask(batch["labels"])
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    with torch.no_grad():
        passed = target_pass(target, batch, keep, V, kind.target_layers)

    def loss() -> torch.Tensor:
        rows = kind.training_rows(drafter, batch, keep, passed, V)
        return (ForwardKL().rows(rows.target, rows.draft) * rows.weight).sum() / rows.weight.sum()

    optimizer = torch.optim.SGD(drafter.parameters(), lr=0.05)
    before = loss()
    before.backward()
    for parameter in drafter.parameters():  # every weight of the drafter learns
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all() and parameter.grad.any()
    optimizer.step()
    with torch.no_grad():
        after = loss()
    assert after < before - 1e-4
    # the target, its embeddings and output layer included, is untouched
    assert all(torch.equal(v, frozen[k]) for k, v in target.state_dict().items())
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_norm.weight"} <= names


# ---------------------------------------------------------------------------------------------- teacher forcing


def test_teacher_forced_states_tile_the_sequence_with_blocks():
    target = tiny_target("qwen2")
    kind, drafter = dflash(target, block_size=4)
    livelier(drafter)
    batch = padded_batch(length=11, real=8)
    states = kind.teacher_forced(drafter, target, batch, V)
    assert states.hidden.shape == (2, 11, drafter.config.hidden_size)
    feats = features(target, batch["input_ids"], batch["attention_mask"])
    for row in range(2):
        for t in range(11 if row == 0 else 8):
            # position t proposes token t + 1: the block anchored at a, its position t + 1 - a
            anchor = (t // 3) * 3
            torch.testing.assert_close(
                states.hidden[row, t],
                block(drafter, feats, batch, anchor, row)[t + 1 - anchor],
                rtol=1e-4,
                atol=1e-5,
            )
    assert states.head(states.hidden).shape == (2, 11, V)


def test_chain_candidates_are_the_greedy_tokens_of_a_block_at_every_position():
    target = tiny_target("llama")
    kind, drafter = dflash(target, block_size=4)
    livelier(drafter)
    length = ANCHORS_PER_PASS + 6  # anchors at 1 .. 69: two drafter passes
    ids = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    candidates = kind.chain_candidates(drafter, target, batch, 5, V)
    assert candidates.shape == (length, 5)
    assert (candidates[0] == NO_CANDIDATE).all() and (candidates[:, 3:] == NO_CANDIDATE).all()
    assert (candidates[1:, :3] != NO_CANDIDATE).all()
    feats = features(target, ids)
    head = drafter.output_head(V)
    for t in (1, 2, 17, ANCHORS_PER_PASS, ANCHORS_PER_PASS + 1, length - 1):
        with torch.no_grad():
            logits = head(block(drafter, feats, batch, t)[1:])  # position j + 1: candidate j after t
        picked = logits.gather(-1, candidates[t, :3, None])[:, 0]
        torch.testing.assert_close(picked, logits.max(-1).values, rtol=0, atol=1e-5)  # the argmax, up to ties


# ---------------------------------------------------------------------------------------------- export and errors


def test_export_loads_back_on_its_target_only(tmp_path: Path):
    target = tiny_target("llama")
    kind, drafter = dflash(target, block_size=4, num_layers=2)
    livelier(drafter)
    tokenizer = SimpleNamespace(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, save_pretrained=lambda out: None
    )
    out = kind.export(drafter, tokenizer, tmp_path / "export", {"stage": "distill"})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {
        "mask_token_id": V - 1,
        "target_layer_ids": [0, 1, 2],  # DFlash counts decoder-layer outputs: ours minus one
        "block_size": 4,
        "causal": False,
    }
    weights = load_file(str(out / "model.safetensors"))
    assert not any("embed" in name or "lm_head" in name for name in weights)
    assert json.loads((out / KIND_FILE).read_text())["kind"] == "dflash"
    with pytest.raises(ValueError, match="load it with the target"):
        load_draft(out, vocab_size=V)
    loaded = load_draft(out, vocab_size=V, target=target)
    assert isinstance(loaded.kind, DFlash) and loaded.kind.target_layers == LAYER_IDS
    assert loaded.kind.block_size == 4 and loaded.kind.num_layers == 2
    saved, back = drafter.state_dict(), loaded.model.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    assert loaded.model.config == drafter.config
    prompt = [3, 7, 1, 9, 4]
    decoded = SpeculativeDecoder(target, loaded.proposer(V), FixedLength(3), GREEDY, None, V).generate(
        prompt, 12
    )
    assert decoded.tokens == autoregressive(target, prompt, 12, GREEDY, None, V).tokens
    with pytest.raises(ConfigError, match="vocabulary"):
        load_draft(out, vocab_size=V, target=tiny_target("llama", vocab=V + 16))
    with pytest.raises(ConfigError, match=r"fuses target states \[1, 2, 3\].*3 layers"):
        load_draft(out, vocab_size=V, target=tiny_target("llama", num_hidden_layers=3))


def test_bad_settings_are_refused_naming_the_setting(tmp_path: Path):
    target = tiny_target("llama")
    assert LAYERS == 4
    for ids in ([1, 2, 4], [0, 1, 2], [2, 1], [1, 1, 2], []):
        with pytest.raises(ConfigError, match=r"draft\.target_layer_ids=.*\[1, 3\]"):
            DFlash(target_layer_ids=ids).resolve(target)
    with pytest.raises(ConfigError, match=r"draft\.target_layer_ids"):
        DFlash(target_layer_ids=[1, 2, 4]).build(target, V)
    for mask in (V, -1):
        with pytest.raises(ConfigError, match=rf"draft\.mask_token_id={mask} .*{V} input embeddings"):
            DFlash(mask_token_id=mask).resolve(target)
    padded = tiny_target("llama")
    with torch.no_grad():
        padded.get_input_embeddings().weight[V - 1] = 0.0  # a padding row: masked positions would be alike
    with pytest.raises(ConfigError, match=rf"draft\.mask_token_id={V - 1} is an all-zero row"):
        DFlash().resolve(padded)
    assert DFlash(mask_token_id=3).resolve(padded).mask_token_id == 3
    for size in (5, 1, 32):
        with pytest.raises(ConfigError, match=rf"draft\.block_size={size}"):
            DFlash(block_size=size)
    with pytest.raises(ConfigError, match="draft.loss_decay"):
        DFlash(loss_decay=0)
    with pytest.raises(ValueError, match="this stage loads no target"):
        DFlash().resolve(None)
    with pytest.raises(ValueError, match="load it with the target"):
        DFlash().load(ModelSpec(pretrained_model_name_or_path=str(tmp_path)), V)
    resolved = DFlash(target_layer_ids=[2, 3], mask_token_id=0).resolve(target)
    assert resolved.target_layer_ids == (2, 3) and resolved.mask_token_id == 0
    assert DFlash().resolve(target).target_layer_ids == LAYER_IDS
    # the drafter's own shape checks
    shape = resolved.build(target, V).config.to_dict()
    with pytest.raises(ValueError, match="block_size=5"):
        DFlashConfig(**{**shape, "block_size": 5})
    with pytest.raises(ValueError, match="mask_token_id=48"):
        DFlashConfig(**{**shape, "mask_token_id": V})
    unattached = DFlashDrafter(DFlashConfig(**shape))
    with pytest.raises(ValueError, match="no target attached"):
        DFlashProposer(unattached, V)
    with pytest.raises(ValueError, match="attach the target it was built for"):
        unattached.attach_target(tiny_target("llama", vocab=V + 16))
