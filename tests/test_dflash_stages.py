"""The DFlash draft kind through the stages: its training rows (blocks at answer anchors, drawn from the batch), AdaSPEC
row by row against a reference drafter, the block tiling that rollouts and acceptance heads read (the states decoding
drafts with), and train.py: distill (live, resumed, from cached target states) -> adaspec -> rollout ->
acceptance_head -> evaluate, greedy outputs the target's; misconfigurations refused with the fix."""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose
from safetensors.torch import load_file

from specdistill.data.target_states import KEY_FILE
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts import KIND_FILE, load_draft, target_pass
from specdistill.drafts.base import target_states
from specdistill.drafts.dflash import DFlash
from specdistill.drafts.dflash.kind import block_anchors
from specdistill.drafts.dflash.proposer import DFlashProposer
from specdistill.errors import ConfigError
from specdistill.evaluation.offline import accepted_runs, fixed_length_calls
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.modules import DistillModule
from specdistill.rollout.run import run_rollouts
from specdistill.selection.reference import KindReference
from specdistill.selection.selectors import AdaSpecSelector
from specdistill.stages.model_loading import load_models, model_spec
from specdistill.utils.cluster import DEBUG_SIGNAL_ENV, PREEMPTED_EXIT_CODE
from tests.helpers import TINY, check_ok, evaluate_outputs, hydra_conf, run_train, stage_overrides
from tests.test_eagle3 import tiny_target
from tests.test_eagle3_kind import batch
from tests.test_engine import GREEDY
from tests.test_user_errors import validated
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 64
LAYERS = (1, 2, 3)  # output_hidden_states indices of tiny_target's 4 layers
SIZE = 4  # block size: 3 candidates per block


def built(vocab: int = V, size: int = SIZE, seed: int = 0, **settings):
    target = tiny_target("llama", vocab=vocab)
    kind = DFlash(block_size=size, target_layer_ids=list(LAYERS), blocks_per_sequence=3, **settings).resolve(
        target
    )
    torch.manual_seed(seed)
    return target, kind, kind.build(target, vocab_size=vocab)


def fused(target, batch_: dict) -> torch.Tensor:
    with torch.no_grad():
        _, states = target_states(target, batch_, LAYERS)
    return torch.cat([states[i] for i in LAYERS], dim=-1)


# -- training rows and AdaSPEC ----------------------------------------------------------------------------------------


def test_training_rows_are_the_block_positions_at_answer_anchors_drawn_from_the_batch():
    """Block `(b, i)` anchored at answer position `a`: its position `j >= 1` is a row when token `a + j` is an
    answer, scored against the target's row of that token with weight exp(-(j - 1) / loss_decay), its state the
    block's own (a single-block pass gives the same: blocks of one pass do not see each other)."""
    target, kind, draft = built(loss_decay=2.0)
    b = batch()
    keep = answer_mask(b["labels"])
    anchors = block_anchors(keep, b["input_ids"], kind.blocks_per_sequence, kind.anchor_seed)
    for row, chosen in zip(keep, anchors, strict=True):
        real = chosen[chosen >= 0]
        assert len(real) == min(3, int(row.sum())) and row[real].all()  # answer positions, distinct, sorted
        assert real.tolist() == sorted(set(real.tolist()))
    assert torch.equal(block_anchors(keep, b["input_ids"], 3, 0), anchors)  # a function of the batch
    assert not torch.equal(block_anchors(keep, b["input_ids"], 3, 1), anchors)  # and of anchor_seed
    assert not torch.equal(block_anchors(keep, batch(seed=1)["input_ids"], 3, 0), anchors)
    with torch.no_grad():
        passed = target_pass(target, b, keep, V, kind.target_layers)
        rows = kind.training_rows(draft, b, keep, passed, V)
        features = fused(target, b)
        answer_number = torch.full(keep.shape, -1, dtype=torch.long)
        answer_number[keep] = torch.arange(int(keep.sum()))
        expected_index, expected_weight, expected_hidden = [], [], []
        for s in range(keep.shape[0]):
            for a in anchors[s].tolist():
                if a < 0:
                    continue
                single = draft.blocks(features[s : s + 1], b["input_ids"][s : s + 1],
                                      b["attention_mask"][s : s + 1], torch.tensor([[a]]))[0, 0]  # fmt: skip
                for j in range(1, SIZE):
                    if a + j - 1 < keep.shape[1] and keep[s, a + j - 1]:
                        expected_index.append(int(answer_number[s, a + j - 1]))
                        expected_weight.append(math.exp(-(j - 1) / 2.0))
                        expected_hidden.append(single[j])
    assert rows.answer_index.tolist() == expected_index and len(expected_index) > 2 * keep.shape[0]
    torch.testing.assert_close(rows.weight, torch.tensor(expected_weight))
    torch.testing.assert_close(rows.draft.hidden, torch.stack(expected_hidden), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.target.hidden, passed.rows.hidden[rows.answer_index])


def adaspec_module(draft, target, kind, reference) -> DistillModule:
    return DistillModule(
        draft=draft, target=target, vocab_size=V, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), kind=kind, selector=AdaSpecSelector(k=0.5),
        reference=reference,
    )  # fmt: skip


def test_adaspec_compares_draft_and_reference_block_position_by_block_position():
    """The reference drafter scores the very blocks the draft trains on (same anchors, same `answer_index`): a copy
    of the draft scores its divergences exactly (every gap 0); another drafter's scores are its own rows'."""
    target, kind, draft = built()
    b = batch()
    keep = answer_mask(b["labels"])
    same = adaspec_module(draft, target, kind, KindReference(copy.deepcopy(draft), kind, ForwardKL(), V))
    same.training_step(b, 0)
    record = same.last_selection
    assert record.draft_divergence.numel() > int(keep.sum())  # several block positions per answer token
    torch.testing.assert_close(record.reference_divergence, record.draft_divergence)
    _, _, other = built(seed=7)
    module = adaspec_module(draft, target, kind, KindReference(other, kind, ForwardKL(), V))
    module.training_step(b, 0)
    record = module.last_selection
    with torch.no_grad():
        rows = kind.training_rows(other, b, keep, target_pass(target, b, keep, V, LAYERS), V)
    assert torch.equal(record.answer_index, rows.answer_index)
    torch.testing.assert_close(record.reference_divergence, ForwardKL().rows(rows.target, rows.draft))
    gap = record.draft_divergence - record.reference_divergence
    assert not torch.allclose(gap, torch.zeros_like(gap))
    torch.testing.assert_close(record.scores, gap)
    kept, dropped = gap[record.keep], gap[~record.keep]
    assert int(record.keep.sum()) == round(0.5 * gap.numel()) and kept.min() >= dropped.max()


def test_a_reference_whose_blocks_do_not_line_up_is_refused():
    target, kind, draft = built()
    _, _, two = built(size=2)
    with pytest.raises(
        ConfigError, match=r"block_size=2, the draft 4: train both with the same draft.block_size"
    ):
        kind.check_reference(draft, two)
    other_layers = DFlash(block_size=SIZE, target_layer_ids=[1, 3]).build(target, V)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        kind.check_reference(draft, other_layers)
    with pytest.raises(ConfigError, match=r"reference is a LlamaForCausalLM.*draft=dflash"):
        kind.check_reference(draft, tiny_target("llama", vocab=V, seed=1))
    kind.check_reference(draft, copy.deepcopy(draft))


def test_misconfigurations_are_refused_before_anything_loads():
    """The top-m target cache holds no hidden states; ZeRO-3 would shard the shared embeddings; the per-token score
    cache cannot score block rows."""
    with pytest.raises(
        ConfigError, match=r"distill\.target_cache=8 .* DFlash reads the target's hidden states"
    ):
        validated("stage=distill", "draft=dflash", "distill.target_cache=8")
    validated("stage=distill", "draft=dflash", "distill.target_cache=bfloat16")
    with pytest.raises(ConfigError, match=r"DFlash draft kind under DeepSpeed ZeRO-3: .*deepspeed_zero2"):
        validated("stage=distill", "draft=dflash", "trainer=deepspeed_zero3")
    pipeline = ("stage=pipeline", "draft=dflash", "distill.target_cache=null", "adaspec.target_cache=null")
    with pytest.raises(ConfigError, match=r"adaspec\.cached_scores=true .* set adaspec\.cached_scores=false"):
        validated(*pipeline, "adaspec.cached_scores=true")
    validated(*pipeline, "adaspec.cached_scores=false")


# -- the block tiling: rollouts, acceptance heads, decoding -----------------------------------------------------------


def test_teacher_forced_states_and_chains_are_the_blocks_decoding_drafts():
    """Decoding drafts the block anchored at the newest token `a` on the target's states of `< a`: the teacher-forced
    state at `t` is that block's position `t + 1 - a` for the tile anchor `a` (a multiple of block_size - 1), the chain
    after `t` the argmax of the block anchored at `t`; so the offline walk is the decoded one, target call for target
    call (a small vocabulary makes a random drafter's blocks often accepted)."""
    vocab = 16
    target, kind, draft = built(vocab=vocab)
    draft.eval()
    ids = torch.randint(0, vocab, (1, 13), generator=torch.Generator().manual_seed(1))
    one = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    states = kind.teacher_forced(draft, target, one, vocab)
    chains = kind.chain_candidates(draft, target, one, SIZE + 1, vocab)
    features = fused(target, one)
    assert (chains[0] == -1).all() and (chains[:, SIZE - 1 :] == -1).all()  # position 0; deeper than a block
    with torch.no_grad():
        for a in range(1, 13):
            cache = draft.new_cache()
            draft.extend_cache(cache, features[:, :a])
            block = draft.draft(cache, ids[0, a : a + 1])[0]
            assert chains[a, : SIZE - 1].tolist() == states.head(block[1:]).argmax(-1).tolist()
            if a % (SIZE - 1) == 0:
                n = min(SIZE - 1, 13 - a)
                torch.testing.assert_close(
                    states.hidden[0, a : a + n], block[1 : 1 + n], rtol=1e-5, atol=1e-5
                )
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(1, vocab, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = autoregressive(target, prompt, 16, GREEDY, None, vocab).tokens
        sequence = torch.tensor(prompt + reference)
        whole = {
            "input_ids": sequence[None],
            "attention_mask": torch.ones(1, len(sequence), dtype=torch.long),
        }
        for k in (2, SIZE - 1, 6):
            decoder = SpeculativeDecoder(
                target, DFlashProposer(draft, vocab), FixedLength(k), GREEDY, None, vocab
            )
            result = decoder.generate(prompt, 16)
            assert result.tokens == reference
            runs = accepted_runs(kind.chain_candidates(draft, target, whole, k, vocab), sequence)
            assert result.stats.target_forwards == fixed_length_calls(runs.tolist(), len(prompt), 16, k, True)
            accepted += result.stats.accepted_tokens
    assert accepted > 10


@torch.no_grad()
def _direct_labels(target, draft, prompt: list[int], response: list[int], tokens: list[int]) -> torch.Tensor:
    """min(1, p/q) at every response position from one unbatched pass per block: the token at `t + 1` is drafted by
    the tile block anchored at `a = t - t % (block_size - 1)`, position `t + 1 - a`."""
    ids = torch.tensor([prompt + response])
    mask = torch.ones_like(ids)
    features = fused(target, {"input_ids": ids, "attention_mask": mask})
    p_all = torch.softmax(target(input_ids=ids).logits[0].float(), dim=-1)
    head = draft.output_head(V)
    labels = []
    for i, token in enumerate(tokens):
        t = len(prompt) + i - 1
        a = t - t % (SIZE - 1)
        state = draft.blocks(features, ids, mask, torch.tensor([[a]]))[0, 0, t + 1 - a]
        q = torch.softmax(head(state).float(), dim=-1)
        labels.append(min(1.0, float(p_all[t, token] / q[token])))
    return torch.tensor(labels)


def test_rollouts_label_the_drafters_own_block_drafts(tmp_path):
    target, kind, draft = built()
    draft.eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, V, (int(n),), generator=gen).tolist()
        for n in torch.randint(2, 7, (6,), generator=gen)
    ]
    data = run_rollouts(
        target, draft, prompts, tmp_path / "rollouts", sampling=SamplingConfig(temperature=1.0), max_new_tokens=7,
        batch_size=3, shard_size=4, seed=3, vocab_size=V, eos_token_id=0, pad_token_id=0, kind=kind,
    )  # fmt: skip
    labelled = 0
    for row in data:
        tokens, labels = row["draft_tokens"], torch.tensor(row["labels"])
        assert len(tokens) == len(row["response_ids"]) == len(labels) > 0
        expected = _direct_labels(target, draft, row["prompt_ids"], row["response_ids"], tokens)
        torch.testing.assert_close(labels, expected, atol=2e-5, rtol=1e-4)
        labelled += len(tokens)
    assert labelled >= 20


def test_an_acceptance_head_on_the_block_states_decodes_losslessly():
    """The engine hands the head the block positions' states (what `teacher_forced` gives in training)."""
    vocab = 16
    target, _, draft = built(vocab=vocab)
    torch.manual_seed(0)
    head = AcceptanceHead(draft.config.hidden_size, 1)
    policy = AcceptanceHeadPolicy(head, threshold=0.9, min_draft_length=1)
    drafted = 0
    for seed in range(3):
        prompt = torch.randint(1, vocab, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = autoregressive(target, prompt, 12, GREEDY, None, vocab).tokens
        decoder = SpeculativeDecoder(target, DFlashProposer(draft.eval(), vocab), policy, GREEDY, None, vocab,
                                     max_draft_length=SIZE - 1)  # fmt: skip
        result = decoder.generate(prompt, 12)
        assert result.tokens == reference
        drafted += result.stats.drafted_tokens
    assert drafted > 0


# -- train.py -------------------------------------------------------------------------------------------------------

PAIR = [*TINY, "models.target.config.num_hidden_layers=4"]
DRAFT = ["draft=dflash", f"draft.block_size={SIZE}", "draft.blocks_per_sequence=4"]
STEPS = 4


def distill(run_dir: Path, *extra: str):
    return run_train(["stage=distill", *PAIR, *DRAFT, *stage_overrides("distill", STEPS), *extra,
                      f"hydra.run.dir={run_dir}"])  # fmt: skip


def draft_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A distill run on the live target, and an adaspec run with its export as reference (online, row by row)."""
    root = tmp_path_factory.mktemp("dflash")
    out = {"distill": root / "distill", "adaspec": root / "adaspec"}
    check_ok(distill(out["distill"]))
    check_ok(run_train(["stage=adaspec", *PAIR, *DRAFT, f"adaspec.reference={out['distill'] / 'export'}",
                        "adaspec.cached_scores=false", "adaspec.k=0.5", *stage_overrides("adaspec", 2),
                        f"hydra.run.dir={out['adaspec']}"]))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def run_target():
    """The tiny pair's target as train.py builds it (same seed), and the vocabulary."""
    with hydra_conf():
        cfg = compose("train", overrides=["stage=distill", *PAIR, *DRAFT])
    _, models, vocab = load_models(cfg, {"target": model_spec(cfg.models.target)})
    return models["target"], vocab


@pytest.mark.slow
def test_train_py_distils_a_dflash_drafter_and_its_export_loads_back(runs, run_target):
    result = json.loads((runs["distill"] / "result.json").read_text())
    assert result["val/kl"] > 0 and 0 < result["val/expected_acceptance"] <= 1
    assert result["target_cache"] is None
    export = runs["distill"] / "export"
    assert json.loads((export / KIND_FILE).read_text())["kind"] == "dflash"
    config = json.loads((export / "config.json").read_text())
    dflash = config["dflash_config"]
    assert dflash["block_size"] == SIZE and dflash["target_layer_ids"] == [0, 1, 2]  # decoder-layer outputs
    target, vocab = run_target
    with pytest.raises(ValueError, match="load it with the target"):
        load_draft(export, vocab)
    loaded = load_draft(export, vocab, target=target)
    assert (
        isinstance(loaded.kind, DFlash)
        and loaded.kind.block_size == SIZE
        and loaded.kind.target_layers == LAYERS
    )
    trained = torch.load(
        runs["distill"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    assert trained["global_step"] == STEPS
    weights = {k.removeprefix("draft."): v for k, v in trained["state_dict"].items()}
    back = loaded.model.state_dict()
    assert weights.keys() == back.keys() and all(torch.equal(weights[k], back[k]) for k in weights)


@pytest.mark.slow
def test_a_killed_distill_run_resumes_to_the_same_drafter(runs, tmp_path, monkeypatch):
    monkeypatch.setenv(DEBUG_SIGNAL_ENV, "2")  # train.py saves and exits at this step, as on a requeue signal
    killed = distill(tmp_path)
    monkeypatch.delenv(DEBUG_SIGNAL_ENV)
    assert killed.returncode == PREEMPTED_EXIT_CODE, killed.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "export").exists()
    resumed = distill(tmp_path)
    check_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    ours, uninterrupted = draft_weights(tmp_path), draft_weights(runs["distill"])
    assert ours.keys() == uninterrupted.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], uninterrupted[name], rtol=0, atol=0)


@pytest.mark.slow
def test_train_py_distils_from_the_cached_target_states(runs, tmp_path):
    """The states at target_layer_ids cached once in bfloat16: the same blocks scored as on the live target, up to
    the rounding."""
    check_ok(distill(tmp_path, "distill.target_cache=bfloat16"))
    result = json.loads((tmp_path / "result.json").read_text())
    key = json.loads((Path(result["target_cache"]) / KEY_FILE).read_text())
    assert key["layers"] == list(LAYERS) and key["dtype"] == "bfloat16"
    live = json.loads((runs["distill"] / "result.json").read_text())
    for name in ("val/kl_before", "val/kl", "val/expected_acceptance"):
        assert result[name] == pytest.approx(live[name], rel=0.05), name
    assert draft_weights(tmp_path).keys() == draft_weights(runs["distill"]).keys()


@pytest.mark.slow
def test_train_py_adaspec_trains_a_dflash_drafter_against_the_distill_export(runs, run_target):
    result = json.loads((runs["adaspec"] / "result.json").read_text())
    assert result["k"] == 0.5 and 0 < result["val/expected_acceptance"] <= 1
    assert (runs["adaspec"] / "selection_tokens.json").is_file()
    metadata = json.loads((runs["adaspec"] / "export" / "specdistill.json").read_text())
    assert metadata["reference"] == str(runs["distill"] / "export")
    target, vocab = run_target
    loaded = load_draft(runs["adaspec"] / "export", vocab, target=target)
    reference = load_draft(runs["distill"] / "export", vocab, target=target)
    loaded.kind.check_reference(loaded.model, reference.model)
    other = DFlash(block_size=2).build(target, vocab)
    with pytest.raises(ConfigError, match="block_size=4, the draft 2"):
        DFlash(block_size=2).check_reference(other, reference.model)


@pytest.mark.slow
def test_train_py_rolls_out_trains_a_head_and_evaluates_dflash_drafts(runs, tmp_path):
    """rollout labels the distill export's block drafts, acceptance_head trains on its block states, and evaluate
    decodes both exports under fixed K and the head's stopping rule: greedy outputs token for token the target's."""
    export = runs["distill"] / "export"
    rollout, heads_dir, evaluate = tmp_path / "rollout", tmp_path / "acceptance_head", tmp_path / "evaluate"
    check_ok(run_train(["stage=rollout", *PAIR, f"+rollout.drafts.df={export}", "rollout.num_prompts=8",
                        "rollout.max_new_tokens=8", "rollout.batch_size=4", "rollout.shard_size=4",
                        "sampling.greedy=false", f"hydra.run.dir={rollout}"]))  # fmt: skip
    assert 0 < json.loads((rollout / "result.json").read_text())["df/mean_acceptance_label"] <= 1
    check_ok(run_train(["stage=acceptance_head", *PAIR, f"+acceptance_head.drafts.df={export}",
                        f"+acceptance_head.rollouts.df={rollout / 'rollouts' / 'df'}",
                        *stage_overrides("acceptance_head", 3), f"hydra.run.dir={heads_dir}"]))  # fmt: skip
    heads = json.loads((heads_dir / "result.json").read_text())["heads"]
    check_ok(run_train(["stage=evaluate", *PAIR, f"+evaluate.drafts.df={export}",
                        f"+evaluate.drafts.df_adaspec={runs['adaspec'] / 'export'}", f"+evaluate.heads.df={heads['df']}",
                        "evaluate.num_prompts=2", "evaluate.selection_prompts=2", "evaluate.max_new_tokens=8",
                        f"evaluate.fixed_lengths=[2,{SIZE - 1}]", "evaluate.acceptance_head.thresholds=[0.5]",
                        "evaluate.acceptance_head.min_draft_length=1", "evaluate.prompt_lookup=null",
                        "evaluate.acceptance_head.stops=[plain,padded,withdrawn]",
                        f"hydra.run.dir={evaluate}"]))  # fmt: skip
    baseline, by_name = evaluate_outputs(evaluate)
    assert "df/df_acceptance_head_h0.5" in by_name, list(by_name)
    # and withdrawing the candidate it stops on, never padded (padding would add back what it takes out)
    assert "df/df_acceptance_head_h0.5_withdrawn" in by_name, list(by_name)
    assert not any(name.endswith("_withdrawn_padded") for name in by_name), list(by_name)
    # the head's policy padded by the target's measured curve, on the block drafter only (chains would pay for it)
    assert "df/df_acceptance_head_h0.5_padded" in by_name, list(by_name)
    assert not any(name.endswith("_padded") for name in by_name if not name.startswith("df/")), list(by_name)
    assert any(name.startswith("df/fixed_k") for name in by_name)
    assert any(name.startswith("df_adaspec/fixed_k") for name in by_name)
    assert baseline and all(outputs == baseline for outputs in by_name.values())
