"""The EAGLE-3 draft kind: its draft vocabulary from the training answers, training-time-test rows in DistillModule,
the vLLM/SGLang export layout, export -> load round trip, and train.py distill -> evaluate by path."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.drafts import KIND_FILE, load_draft, target_pass
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.errors import ConfigError
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.divergence import forward_kl
from specdistill.modules import DistillModule
from specdistill.selection.reference import KindReference, OnlineReference
from specdistill.selection.selectors import AdaSpecSelector, DraftLossSelector
from tests.helpers import TINY, check_ok, evaluate_outputs, run_train, stage_overrides
from tests.test_eagle3 import AUX, tiny_target
from tests.test_engine import GREEDY
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 64


class _Data:
    """The one thing `Eagle3.prepare` reads of a `TaskDataModule`: the training split's labels."""

    def __init__(self, labels: list[list[int]]) -> None:
        self.labels = labels

    def tokenized(self, split: str) -> dict[str, list[list[int]]]:
        assert split == "train"
        return {"labels": self.labels}


def batch(vocab: int = V, size: int = 2, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, length), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100
    mask = torch.ones_like(ids)
    mask[1, length - 3 :] = 0  # right padding
    labels[1, length - 3 :] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "window_answer_tokens": (labels[:, 1:] != -100).sum()}  # fmt: skip


def built(vocab: int = V, draft_vocab: int = 40, steps: int = 3):
    target = tiny_target("llama", vocab=vocab)
    kind = Eagle3(draft_vocab_size=draft_vocab, aux_layer_ids=list(AUX), ttt_steps=steps)
    head = kind.build(target, vocab_size=vocab)
    labels = [[-100, *torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(2)).tolist()]]
    kind.prepare(head, _Data(labels))
    return target, kind, head


def test_the_draft_vocabulary_is_the_training_answers_most_frequent_tokens():
    target, kind, head = built()
    labels = [[-100, -100, 5, 5, 5, 9, 9, 1], [-100, 9, 2]]
    kind.prepare(head, _Data(labels))
    assert head.config.draft_vocab_size == 40 and head.t2d.sum() == 40
    assert head.t2d[[5, 9, 1, 2]].all()  # every answer token (fewer than 40) is in it
    assert head.target_ids.tolist() == sorted(head.target_ids.tolist())
    assert torch.equal(head.target_ids, head.t2d.nonzero().squeeze(-1))
    assert kind.target_layers == AUX
    # capped at the tokenizer's vocabulary; bad settings are clear errors
    assert (
        Eagle3(draft_vocab_size=10**6, aux_layer_ids=list(AUX)).build(target, V).config.draft_vocab_size == V
    )
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        Eagle3(aux_layer_ids=[1, 2, 4]).build(target, V)
    with pytest.raises(ConfigError, match="ttt_steps"):
        Eagle3(ttt_steps=0)


def test_training_rows_are_the_unrolled_steps_weighted_and_masked():
    target, kind, head = built(steps=3)
    b = batch()
    keep = answer_mask(b["labels"])
    with torch.no_grad():
        passed = target_pass(target, b, keep, V, kind.target_layers)
        rows = kind.training_rows(head, b, keep, passed, V)
        unrolled = head.unroll(torch.cat([passed.hidden_states[i] for i in AUX], -1), b["input_ids"],
                               b["attention_mask"], 3)  # fmt: skip
        full = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1][keep][
            :, :V
        ]
    n = int(keep.sum())
    in_vocab = head.t2d[full.argmax(-1)]
    assert not in_vocab.all() and in_vocab.any()  # the mask is exercised
    assert len(rows.draft) == len(rows.target) == rows.weight.numel() == 3 * int(in_vocab.sum())
    assert sorted(set(rows.weight.tolist())) == pytest.approx([0.8**2, 0.8, 1.0])
    torch.testing.assert_close(
        rows.weight, torch.cat([torch.full((int(in_vocab.sum()),), 0.8**j) for j in range(3)])
    )
    # each row: KL(target softmax on the draft vocabulary || the head's step j at index s - 1 - j)
    per_row = ForwardKL().rows(rows.target, rows.draft)
    answer_rows, answer_positions = keep.nonzero(as_tuple=True)
    columns = head.target_ids
    for i in [0, 5, len(per_row) - 1]:
        a = int(rows.answer_index[i])
        step = round(torch.log(rows.weight[i]).item() / torch.log(torch.tensor(0.8)).item())
        r, s = answer_rows[a], answer_positions[a]
        expected = forward_kl(full[a : a + 1, columns], unrolled[step].logits[r, s - 1 - step][None])
        torch.testing.assert_close(per_row[i : i + 1], expected, rtol=1e-4, atol=1e-5)
    assert n > 0


def test_the_head_trains_through_distill_module(tmp_path):
    target, kind, head = built()
    embeddings = target.get_input_embeddings().weight.clone()
    start = {k: v.clone() for k, v in head.state_dict().items()}
    module = DistillModule(
        draft=head, target=target, vocab_size=V, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), kind=kind,
    )  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=0.5, default_root_dir=tmp_path)  # fmt: skip
    batches = [batch(seed=s) for s in range(3)]
    trainer.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None))
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert 0 < float(trainer.callback_metrics["val/expected_acceptance"]) <= 1
    assert any(not torch.equal(start[k], v) for k, v in head.state_dict().items() if k not in ("d2t", "t2d"))
    assert torch.equal(start["d2t"], head.d2t) and torch.equal(
        target.get_input_embeddings().weight, embeddings
    )
    assert all(k.startswith("draft.") and "embed" not in k for k in module.state_dict())
    assert (
        module.last_selection.token_ids.numel() == module.last_selection.keep.numel()
    )  # one per unrolled row


def test_a_selector_selects_among_the_unrolled_rows():
    target, kind, head = built()
    module = DistillModule(
        draft=head, target=target, vocab_size=V, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), kind=kind, selector=DraftLossSelector(k=0.5),
    )  # fmt: skip
    b = batch()
    loss = module.training_step(b, 0)
    record = module.last_selection
    steps_rows = len(kind.training_rows(head, b, answer_mask(b["labels"]),
                                        target_pass(target, b, answer_mask(b["labels"]), V, AUX), V).draft)  # fmt: skip
    assert record.keep.numel() == record.token_ids.numel() == steps_rows > int(answer_mask(b["labels"]).sum())
    assert 0 < int(record.keep.sum()) < steps_rows and torch.isfinite(loss)


def adaspec_module(head, target, kind, reference) -> DistillModule:
    return DistillModule(
        draft=head, target=target, vocab_size=V, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), kind=kind, selector=AdaSpecSelector(k=0.5),
        reference=reference,
    )  # fmt: skip


def test_adaspec_ranks_each_unrolled_row_by_the_gap_to_a_reference_head_on_the_same_row():
    """The reference head is unrolled on the same target pass: its row i is the draft's row i (a copy of the draft
    scores exactly the draft's divergences, so every gap is 0), and a different head's scores are its own rows'
    divergences, which the selector subtracts row by row."""
    target, kind, head = built()
    b = batch()
    keep = answer_mask(b["labels"])
    same = adaspec_module(head, target, kind, KindReference(copy.deepcopy(head), kind, ForwardKL(), V))
    same.training_step(b, 0)
    record = same.last_selection
    assert record.reference_divergence.shape == record.draft_divergence.shape
    assert record.draft_divergence.numel() > int(keep.sum())  # several rows per answer token
    torch.testing.assert_close(record.reference_divergence, record.draft_divergence)
    torch.manual_seed(7)
    other = kind.build(target, vocab_size=V)
    other.d2t.copy_(head.d2t)  # the same draft vocabulary (prepare on the same data)
    other.t2d.copy_(head.t2d)
    module = adaspec_module(head, target, kind, KindReference(other, kind, ForwardKL(), V))
    module.training_step(b, 0)
    record = module.last_selection
    with torch.no_grad():
        rows = kind.training_rows(other, b, keep, target_pass(target, b, keep, V, AUX), V)
        expected = ForwardKL().rows(rows.target, rows.draft)
    torch.testing.assert_close(record.reference_divergence, expected)
    assert not torch.allclose(record.reference_divergence, record.draft_divergence)
    gap = record.draft_divergence - record.reference_divergence
    torch.testing.assert_close(record.scores, gap)
    kept, dropped = gap[record.keep], gap[~record.keep]
    assert int(record.keep.sum()) == round(0.5 * gap.numel()) and kept.min() >= dropped.max()


def test_adaspec_on_eagle3_refuses_a_per_token_reference_and_a_reference_that_does_not_line_up():
    target, kind, head = built()
    with pytest.raises(ValueError, match="several rows per answer token.*KindReference"):
        adaspec_module(
            head, target, kind, OnlineReference(tiny_target("llama", vocab=V, seed=1), ForwardKL(), V)
        )
    _, _, other_vocabulary = built(draft_vocab=24)
    with pytest.raises(ConfigError, match="draft vocabulary .* same draft.draft_vocab_size"):
        kind.check_reference(head, other_vocabulary)
    other_layers = Eagle3(draft_vocab_size=40, aux_layer_ids=[0, 1, 2], ttt_steps=3).build(
        target, vocab_size=V
    )
    with pytest.raises(ConfigError, match="fuses target layers"):
        kind.check_reference(head, other_layers)
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM.*draft=eagle3"):
        kind.check_reference(head, tiny_target("llama", vocab=V, seed=1))
    kind.check_reference(head, copy.deepcopy(head))


@pytest.fixture(scope="module")
def tokenizer():
    return arith_tokenizer(vocab_size=300, train_size=200)


def test_export_is_the_vllm_layout_and_loads_back_identical(tokenizer, tmp_path: Path):
    vocab = len(tokenizer)
    target, kind, head = built(vocab=vocab, draft_vocab=200)
    out = kind.export(head, tokenizer, tmp_path / "export", {"stage": "distill"})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == 200 and config["vocab_size"] == vocab
    assert config["target_hidden_size"] == target.config.hidden_size and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["norm_before_residual"] is False
    weights = load_file(str(out / "model.safetensors"))
    assert not any("embed" in name for name in weights)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(weights)
    assert all(name.startswith(("fc.", "norm.", "lm_head.", "midlayer.", "d2t", "t2d")) for name in weights)
    assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64
    assert json.loads((out / KIND_FILE).read_text())["kind"] == "eagle3"
    with pytest.raises(ValueError, match="load it with the target"):
        load_draft(out, vocab_size=vocab)
    loaded = load_draft(out, vocab_size=vocab, target=target)
    assert isinstance(loaded.kind, Eagle3) and loaded.kind.target_layers == AUX
    saved, back = head.state_dict(), loaded.model.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    assert loaded.model.config == head.config
    proposer = loaded.proposer(vocab)
    assert isinstance(proposer, Eagle3Proposer)
    prompt = [3, 7, 1, 9, 4]
    reference = autoregressive(target, prompt, 16, GREEDY, None, vocab).tokens
    assert SpeculativeDecoder(target, proposer, FixedLength(3), GREEDY, None, vocab).generate(prompt, 16).tokens \
        == reference  # fmt: skip


@pytest.mark.slow
def test_train_py_distils_an_eagle3_head_and_evaluates_its_export(tmp_path: Path):
    """`stage=distill draft=eagle3` trains and exports a head, `stage=adaspec draft=eagle3` trains a second one
    selected against it, and `stage=evaluate` loads both by path and decodes losslessly (greedy: every entry's
    outputs equal the target's)."""
    pair = [*TINY, "models.target.config.num_hidden_layers=4"]
    head = ["draft=eagle3", "draft.draft_vocab_size=128", "draft.ttt_steps=3", "draft.aux_layer_ids=[0,1,3]"]
    distill = tmp_path / "distill"
    check_ok(run_train(["stage=distill", *pair, *head,
                        *stage_overrides("distill", 3), f"hydra.run.dir={distill}"]))  # fmt: skip
    export = distill / "export"
    adaspec = tmp_path / "adaspec"
    check_ok(run_train(["stage=adaspec", *pair, *head, f"adaspec.reference={export}", "adaspec.cached_scores=false",
                        "adaspec.k=0.5", *stage_overrides("adaspec", 2), f"hydra.run.dir={adaspec}"]))  # fmt: skip
    selected = json.loads((adaspec / "result.json").read_text())
    assert selected["k"] == 0.5 and 0 < selected["val/expected_acceptance"] <= 1
    assert json.loads((adaspec / "export" / "config.json").read_text())["draft_vocab_size"] == 128
    config = json.loads((export / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert config["draft_vocab_size"] == 128
    result = json.loads((distill / "result.json").read_text())
    assert 0 < result["val/expected_acceptance"] <= 1
    evaluate = tmp_path / "evaluate"
    check_ok(run_train(["stage=evaluate", *pair, f"+evaluate.drafts.eagle={export}",
                        f"+evaluate.drafts.eagle_adaspec={adaspec / 'export'}", "evaluate.num_prompts=2",
                        "evaluate.selection_prompts=2", "evaluate.max_new_tokens=8", "evaluate.fixed_lengths=[2]",
                        f"hydra.run.dir={evaluate}"]))  # fmt: skip
    report = json.loads((evaluate / "report.json").read_text())
    names = [e["name"] for e in report["entries"]]
    assert {"eagle/fixed_k2", "eagle_adaspec/fixed_k2"} <= set(names)
    baseline, by_name = evaluate_outputs(evaluate)
    assert baseline and any(name.startswith("eagle/") for name in by_name)
    assert all(outputs == baseline for outputs in by_name.values())  # greedy: token for token the target's
