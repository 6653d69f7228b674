"""SpecDec++ on an EAGLE-3 head: rollouts label the head's own drafts (its teacher-forced step 0 over the target's
states, q on target ids through d2t, 0 outside the draft vocabulary) with min(1, p/q), and an acceptance head trains
on the EAGLE layer's output after the final norm."""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.head_data import HiddenCache, RolloutDataModule
from specdistill.head_data.inputs import judged_head_inputs
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.modules.acceptance_head import AcceptanceHeadModule
from specdistill.rollout.run import run_rollouts
from tests.helpers import TINY, check_ok, evaluate_outputs, run_train, stage_overrides
from tests.test_eagle3 import AUX, V, fused_states, tiny_head, tiny_target
from tests.test_engine import GREEDY
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

SAMPLING = SamplingConfig(temperature=1.0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, V, (int(n),), generator=gen).tolist()
        for n in torch.randint(2, 6, (count,), generator=gen)
    ]


def _rollouts(tmp_path, target, head, prompts):
    return run_rollouts(
        target, head, prompts, tmp_path / "rollouts", sampling=SAMPLING, max_new_tokens=6, batch_size=3,
        shard_size=4, seed=3, vocab_size=V, eos_token_id=0, pad_token_id=0, kind=Eagle3(aux_layer_ids=list(AUX)),
    )  # fmt: skip


@torch.no_grad()
def _direct_labels(target, head, prompt: list[int], response: list[int], tokens: list[int]) -> torch.Tensor:
    """min(1, p/q) at every response position from one unbatched pass: q from the head's EAGLE position `P + i - 2`
    (reading the target's states of `P + i - 2` and token `P + i - 1`), scattered onto target ids."""
    ids = torch.tensor([prompt + response])
    out = head.unroll(fused_states(target, ids), ids, torch.ones_like(ids), 1)[0]
    p_all = torch.softmax(target(input_ids=ids).logits[0].float(), dim=-1)
    labels = []
    for i, token in enumerate(tokens):
        at = len(prompt) + i
        q = torch.zeros(V)
        q[head.target_ids] = torch.softmax(out.logits[0, at - 2].float(), dim=-1)
        assert q[token] > 0, "a drafted token must lie in the draft vocabulary"
        labels.append(min(1.0, float(p_all[at - 1, token] / q[token])))
    return torch.tensor(labels)


def test_rollouts_label_the_heads_own_drafts_with_min_one_p_over_q(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target)
    prompts = _prompts(7)
    data = _rollouts(tmp_path, target, head, prompts)
    outside = ~head.t2d
    drafted = 0
    for row in data:
        tokens, labels = row["draft_tokens"], torch.tensor(row["labels"])
        assert len(tokens) == len(row["response_ids"]) == len(labels) > 0
        assert not outside[tokens].any()  # q is 0 outside the draft vocabulary: never drafted
        expected = _direct_labels(target, head, row["prompt_ids"], row["response_ids"], tokens)
        torch.testing.assert_close(labels, expected, atol=2e-5, rtol=1e-4)
        drafted += len(tokens)
    assert drafted >= 20


def test_head_inputs_are_the_eagle_layer_output_after_the_final_norm():
    """Candidate inputs at position t: EAGLE position t - 1's normed output (it read token t and proposes t + 1);
    proposer inputs: the state that proposed Y_i with q(Y_i) on target ids, q = 0 outside the draft vocabulary."""
    target = tiny_target("llama")
    head = tiny_head(target)
    ids = torch.tensor([[5, 7, 9, 11, 2, 4], [3, 8, 6, 1, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    keep = torch.zeros(2, 6, dtype=torch.bool)
    keep[0, 2:] = keep[1, 2:4] = True
    drafted = head.target_ids[torch.arange(12) % head.config.draft_vocab_size].view(2, 6)
    drafted[1, 3] = int((~head.t2d).nonzero()[0])  # a token the head cannot draft: q = 0
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": keep, "draft_tokens": drafted}
    kind, greedy = Eagle3(aux_layer_ids=list(AUX)), SamplingConfig(greedy=True)
    candidate = judged_head_inputs(head, batch, "candidate", greedy, kind, target)
    with torch.no_grad():
        normed = head.unroll(fused_states(target, ids), ids, mask, 1)[0].normed
    rows, cols = keep.nonzero(as_tuple=True)
    torch.testing.assert_close(candidate, normed[rows, cols - 1])
    sampling = SamplingConfig(temperature=0.7)
    proposer = judged_head_inputs(head, batch, "proposer", sampling, kind, target)
    q = torch.zeros(len(rows), V)
    q[:, head.target_ids] = torch.softmax(head.lm_head(normed[rows, cols - 1]) / 0.7, dim=-1)
    expected = q.gather(-1, drafted[keep][:, None])
    torch.testing.assert_close(proposer, torch.cat([normed[rows, cols - 1], expected], dim=-1))
    assert proposer[-1, -1] == 0
    with pytest.raises(ValueError, match="target"):
        judged_head_inputs(head, batch, "candidate", greedy, kind, None)


def _head_module(head, kind, target, hidden_cache=None):
    torch.manual_seed(0)
    return AcceptanceHeadModule(
        head=AcceptanceHead(head.config.hidden_size, 2), draft=None if hidden_cache else head,
        optimizer=partial(torch.optim.AdamW, lr=1e-2), cache_hidden_states=hidden_cache is not None,
        hidden_cache=hidden_cache, draft_kind=kind, target=target,
    )  # fmt: skip


def _trainer(root, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(root),
                     enable_checkpointing=False, **kwargs)  # fmt: skip


def test_an_acceptance_head_trains_on_the_heads_rollouts_and_decoding_stays_lossless(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target)
    kind = Eagle3(aux_layer_ids=list(AUX))
    _rollouts(tmp_path, target, head, _prompts(12, seed=1))
    rollouts = tmp_path / "rollouts"

    def data(cache=None):
        return RolloutDataModule(str(rollouts), batch_size=4, mixing_ratio=0.15, val_fraction=0.25, seed=0,
                                 pad_token_id=0, hidden_cache=cache)  # fmt: skip

    module = _head_module(head, kind, target)
    before = _trainer(tmp_path).validate(module, datamodule=data(), verbose=False)[0]
    trainer = _trainer(tmp_path, max_steps=15, check_val_every_n_epoch=1000)
    trainer.fit(module, datamodule=data())
    after = trainer.validate(module, datamodule=data(), verbose=False)[0]
    assert after["val/head_bce"] < before["val/head_bce"]
    assert all(not p.requires_grad for p in [*head.parameters(), *target.parameters()])
    # the hidden cache holds what running the head gives (its key records the target's weights)
    cache = HiddenCache(head, rollouts, tmp_path / "cache", seed=0, batch_size=4, pad_token_id=0,
                        dtype="float32", kind=kind, target=target)  # fmt: skip
    assert "target_weights" in cache.key
    cached = _head_module(head, kind, target, hidden_cache=cache)
    live = _trainer(tmp_path).validate(_head_module(head, kind, target), datamodule=data(), verbose=False)[0]
    on_cache = _trainer(tmp_path).validate(cached, datamodule=data(cache), verbose=False)[0]
    for key, value in live.items():
        assert on_cache[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    with pytest.raises(ValueError, match="target"):
        _head_module(head, kind, None)
    # paired with the EAGLE-3 proposer, the trained head stops drafts and greedy decoding stays the target's
    proposer = Eagle3Proposer(head, V)
    policy = AcceptanceHeadPolicy(module.head.eval(), threshold=0.5, min_draft_length=1)
    prompts = _prompts(3, seed=2)
    references = [autoregressive(target, p, 16, GREEDY, None, V).tokens for p in prompts]
    decoder = SpeculativeDecoder(target, proposer, policy, GREEDY, None, V, max_draft_length=4)
    results = [decoder.generate(p, 16) for p in prompts]
    assert [r.tokens for r in results] == references
    assert sum(r.stats.drafted_tokens for r in results) > 0


@pytest.mark.slow
def test_train_py_rolls_out_trains_a_head_and_evaluates_it_with_the_eagle3_draft(tmp_path):
    """distill (draft=eagle3) -> rollout -> acceptance_head -> evaluate with the head, all through train.py: the
    rollouts label the head's drafts, the acceptance head trains on them, and the evaluated entries (fixed K and the
    head's stopping rule) decode the target's greedy output token for token."""
    pair = [*TINY, "models.target.config.num_hidden_layers=4"]
    runs = {stage: tmp_path / stage for stage in ("distill", "rollout", "acceptance_head", "evaluate")}
    check_ok(run_train(["stage=distill", *pair, "draft=eagle3", "draft.draft_vocab_size=128", "draft.ttt_steps=2",
                        "draft.aux_layer_ids=[0,1,3]", *stage_overrides("distill", 2),
                        f"hydra.run.dir={runs['distill']}"]))  # fmt: skip
    export = runs["distill"] / "export"
    check_ok(run_train(["stage=rollout", *pair, f"+rollout.drafts.eagle={export}", "rollout.num_prompts=8",
                        "rollout.max_new_tokens=8", "rollout.batch_size=4", "rollout.shard_size=4",
                        "sampling.greedy=false",  # soft labels (greedy ones of a barely trained head may all be 0)
                        f"hydra.run.dir={runs['rollout']}"]))  # fmt: skip
    rollout = json.loads((runs["rollout"] / "result.json").read_text())
    assert 0 < rollout["eagle/mean_acceptance_label"] <= 1
    check_ok(run_train(["stage=acceptance_head", *pair, f"+acceptance_head.drafts.eagle={export}",
                        f"+acceptance_head.rollouts.eagle={runs['rollout'] / 'rollouts' / 'eagle'}",
                        *stage_overrides("acceptance_head", 3), f"hydra.run.dir={runs['acceptance_head']}"]))  # fmt: skip
    heads = json.loads((runs["acceptance_head"] / "result.json").read_text())["heads"]
    check_ok(run_train(["stage=evaluate", *pair, f"+evaluate.drafts.eagle={export}",
                        f"+evaluate.heads.eagle={heads['eagle']}", "evaluate.num_prompts=2",
                        "evaluate.selection_prompts=2", "evaluate.max_new_tokens=8", "evaluate.fixed_lengths=[2]",
                        "evaluate.acceptance_head.thresholds=[0.5]", "evaluate.acceptance_head.min_draft_length=1",
                        f"hydra.run.dir={runs['evaluate']}"]))  # fmt: skip
    baseline, by_name = evaluate_outputs(runs["evaluate"])
    assert any("head" in name for name in by_name), list(by_name)
    assert baseline and all(outputs == baseline for outputs in by_name.values())
