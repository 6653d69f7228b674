"""Draft kinds (`specdistill.drafts`): the cut-layer draft is the target's first layers, trains through
DistillModule, exports with its kind and loads back; exports without a record load as standalone causal LMs; bad
records and out-of-range settings are clear errors; the config group picks the kind."""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose
from hydra.errors import InstantiationException
from omegaconf import open_dict
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.drafts import KIND_FILE, Standalone, exported_kind, load_draft, target_pass
from specdistill.drafts.cut_layers.kind import CutLayers
from specdistill.errors import ConfigError, InputFileError
from specdistill.export.hf import export_pretrained
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.rows import answer_rows
from specdistill.models.loading import ModelSpec
from specdistill.modules import DistillModule
from specdistill.stages.model_loading import draft_kind, model_spec
from tests.helpers import TINY, check_ok, hydra_conf, run_train, stage_overrides

LAYERS = 3


@pytest.fixture(scope="module")
def tokenizer():
    return arith_tokenizer(vocab_size=300, train_size=200)


def causal_lm(model_type: str, vocab: int, layers: int = LAYERS, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, **extra,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def batch(vocab: int, size: int = 2, length: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, length), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "window_answer_tokens": (labels[:, 1:] != -100).sum()}  # fmt: skip


def early_exit_logits(target: torch.nn.Module, ids: torch.Tensor, layers: int) -> torch.Tensor:
    """The target's embeddings -> its first `layers` layers -> its final norm -> its output head, by hand."""
    body = target.base_model
    hidden = body.get_input_embeddings()(ids)
    positions = torch.arange(ids.shape[1])[None]
    rotary = body.rotary_emb(hidden, positions)  # GPT-NeoX and Llama give every layer the rotary angles
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]  # causal
    for layer in body.layers[:layers]:
        out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    norm = body.norm if hasattr(body, "norm") else body.final_layer_norm
    return target.get_output_embeddings()(norm(hidden))


@pytest.mark.parametrize("model_type", ["gpt_neox", "llama"])
def test_the_cut_draft_is_the_targets_first_layers(model_type):
    target = causal_lm(model_type, vocab=64)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = CutLayers(num_layers=2).build(target, vocab_size=64)
    assert type(draft) is type(target) and draft.config.num_hidden_layers == 2
    assert target.config.num_hidden_layers == LAYERS  # the target's config is not changed
    assert all(p.dtype == torch.float32 and p.requires_grad for p in draft.parameters())
    assert not any(p.data_ptr() == q.data_ptr() for p in draft.parameters() for q in target.parameters())
    ids = batch(64)["input_ids"]
    with torch.no_grad():
        logits = draft(input_ids=ids).logits
        manual = early_exit_logits(target, ids, 2)
        full = target(input_ids=ids).logits
    torch.testing.assert_close(logits, manual, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, full, atol=1e-3)  # two of three layers: not the target itself
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_the_cut_draft_trains_through_distill_module(tmp_path):
    target = causal_lm("gpt_neox", vocab=64)
    kind = CutLayers(num_layers=1)
    draft = kind.build(target, vocab_size=64)
    start = {k: v.clone() for k, v in draft.state_dict().items()}
    module = DistillModule(
        draft=draft, target=target, vocab_size=64, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), kind=kind,
    )  # fmt: skip
    batches = [batch(64, seed=s) for s in range(2)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert any(not torch.equal(start[k], v) for k, v in draft.state_dict().items())
    assert list(module.state_dict()) and all(k.startswith("draft.") for k in module.state_dict())


def test_the_standalone_kind_gives_the_rows_distill_module_always_computed():
    target, draft = causal_lm("gpt_neox", vocab=64, seed=1), causal_lm("gpt_neox", vocab=64, layers=1, seed=2)
    b = batch(64)
    keep = answer_mask(b["labels"])
    with torch.no_grad():
        passed = target_pass(target, b, keep, 64)
        rows = Standalone().rows(draft, b, keep, passed, 64)
        assert (
            torch.equal(passed.rows.hidden, answer_rows(target, b, keep, 64).hidden)
            and not passed.hidden_states
        )
        assert torch.equal(rows.hidden, answer_rows(draft, b, keep, 64).hidden)
        # a kind that reads target hidden states gets them from the same pass, with the same rows
        layered = target_pass(target, b, keep, 64, layers=(1, LAYERS))
        states = target(**{k: b[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
        torch.testing.assert_close(layered.rows.hidden, passed.rows.hidden)
        assert torch.equal(layered.hidden_states[1], states.hidden_states[1])
    with pytest.raises(ValueError, match="target layers"):
        target_pass(target, b, keep, 64, layers=(LAYERS + 1,))


def test_a_cut_export_records_its_kind_and_loads_back_identical(tokenizer, tmp_path: Path):
    vocab = len(tokenizer)
    target = causal_lm("gpt_neox", vocab=vocab)
    kind = CutLayers(num_layers=2)
    draft = kind.build(target, vocab_size=vocab)
    out = kind.export(draft, tokenizer, tmp_path / "export", {"stage": "distill"})
    assert json.loads((out / KIND_FILE).read_text()) == {"kind": "cut_layers", "settings": {"num_layers": 2}}
    assert json.loads((out / "specdistill.json").read_text()) == {"stage": "distill"}
    loaded = load_draft(out, vocab_size=vocab)
    assert isinstance(loaded.kind, CutLayers) and loaded.kind.num_layers == 2 and loaded.source == str(out)
    assert type(loaded.model) is type(draft) and loaded.model.config.num_hidden_layers == 2
    saved, back = draft.state_dict(), loaded.model.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    assert loaded.proposer(vocab) is loaded.model  # a causal-LM draft drafts with the model itself


def test_a_cut_continued_from_its_export_trains_on_from_the_exported_weights(tokenizer, tmp_path: Path):
    """`<stage>.init` with a cut draft (stage=sequential's later phases): the exported weights, not a new cut of the
    target; trainable, exported again as a cut; an export of another depth or model class is refused."""
    vocab = len(tokenizer)
    target = causal_lm("gpt_neox", vocab=vocab)
    kind = CutLayers(num_layers=2)
    trained = kind.build(target, vocab_size=vocab)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)  # as if trained: no longer the target's weights
    out = kind.export(trained, tokenizer, tmp_path / "phase1", {"stage": "distill"})
    continued = kind.continued_from(str(out))
    assert continued.specs("draft") == {"draft": ModelSpec(pretrained_model_name_or_path=str(out))}
    draft = continued.build(target, vocab_size=vocab)
    assert type(draft) is type(target) and draft.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in draft.parameters())
    saved, back = trained.state_dict(), draft.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    fresh = kind.build(target, vocab_size=vocab).state_dict()
    assert not torch.equal(
        fresh["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
        back["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
    )
    again = continued.export(draft, tokenizer, tmp_path / "phase2", {"stage": "distill"})
    assert json.loads((again / KIND_FILE).read_text())["settings"] == {"num_layers": 2}
    with pytest.raises(ConfigError, match=r"a cut of 2 layers, but draft.num_layers=1"):
        CutLayers(num_layers=1).continued_from(str(out)).build(target, vocab_size=vocab)
    with pytest.raises(ConfigError, match=r"not a cut of this target \(LlamaForCausalLM\)"):
        continued.build(causal_lm("llama", vocab=vocab), vocab_size=vocab)


def test_an_export_without_a_kind_record_loads_as_standalone(tokenizer, tmp_path: Path):
    model = causal_lm("gpt_neox", vocab=len(tokenizer), layers=1)
    export_pretrained(model, tokenizer, tmp_path / "old")  # as every export before draft kinds
    assert not (tmp_path / "old" / KIND_FILE).exists()
    loaded = load_draft(tmp_path / "old", vocab_size=len(tokenizer))
    assert type(loaded.kind) is Standalone
    assert all(torch.equal(model.state_dict()[k], v) for k, v in loaded.model.state_dict().items())
    # the standalone kind's own export records it
    Standalone().export(model, tokenizer, tmp_path / "new")
    assert json.loads((tmp_path / "new" / KIND_FILE).read_text()) == {"kind": "standalone", "settings": {}}
    assert type(exported_kind(tmp_path / "new")) is Standalone


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"_target_": "specdistill.drafts.no_such_kind.Missing"}, "not one of specdistill's draft kinds"),
        ({"_target_": "collections.OrderedDict"}, "not one of specdistill's draft kinds"),
        ({"num_layers": 2}, "holds the keys"),
        ({"kind": "no_such_kind"}, "not registered"),
    ],
)
def test_a_bad_kind_record_is_a_clear_error(tokenizer, tmp_path: Path, record, message):
    export_pretrained(causal_lm("gpt_neox", vocab=len(tokenizer), layers=1), tokenizer, tmp_path)
    (tmp_path / KIND_FILE).write_text(json.dumps(record))
    with pytest.raises(InputFileError, match=message):
        load_draft(tmp_path)


@pytest.mark.parametrize("num_layers", [0, LAYERS, LAYERS + 2])
def test_num_layers_out_of_range_names_the_key(num_layers):
    with pytest.raises(ConfigError, match=rf"draft\.num_layers={num_layers}"):
        CutLayers(num_layers).build(causal_lm("gpt_neox", vocab=64), vocab_size=64)


def test_the_config_group_picks_the_kind_and_the_default_is_the_pairs_draft():
    with hydra_conf():
        default = compose("train", overrides=["stage=distill"])
        explicit = compose("train", overrides=["stage=distill", "draft=standalone"])
        cut = compose("train", overrides=["stage=distill", "draft=cut_layers", "draft.num_layers=1"])
    assert "draft" not in default  # no kind chosen: existing configs compose exactly as before
    kind = draft_kind(default)
    assert type(kind) is Standalone and kind.spec == model_spec(default.models.draft)
    assert draft_kind(explicit).spec == kind.spec
    assert type(draft_kind(cut)) is CutLayers and draft_kind(cut).num_layers == 1
    with open_dict(cut):
        cut.draft.num_layers = 0
    with pytest.raises(
        InstantiationException, match=r"draft\.num_layers=0"
    ):  # train.py prints the ConfigError
        draft_kind(cut)


@pytest.mark.slow
def test_train_py_distils_a_cut_draft_and_evaluates_its_export(tmp_path: Path):
    """`stage=distill draft=cut_layers` exports a cut draft that `stage=evaluate` loads back by path."""
    pair = [*TINY, "models.target.config.num_hidden_layers=2"]
    distill = tmp_path / "distill"
    check_ok(run_train(["stage=distill", *pair, "draft=cut_layers", "draft.num_layers=1",
                        *stage_overrides("distill", 2), f"hydra.run.dir={distill}"]))  # fmt: skip
    export = distill / "export"
    assert json.loads((export / KIND_FILE).read_text())["settings"] == {"num_layers": 1}
    assert AutoConfig.from_pretrained(export).num_hidden_layers == 1
    assert AutoConfig.from_pretrained(export).hidden_size == 32  # the target's width, not models.draft's (16)
    evaluate = tmp_path / "evaluate"
    check_ok(run_train(["stage=evaluate", *pair, f"+evaluate.drafts.cut={export}", "evaluate.num_prompts=2",
                        "evaluate.selection_prompts=2", "evaluate.max_new_tokens=6", "evaluate.fixed_lengths=[2]",
                        f"hydra.run.dir={evaluate}"]))  # fmt: skip
    names = [e["name"] for e in json.loads((evaluate / "report.json").read_text())["entries"]]
    assert "cut/fixed_k2" in names


def _modules_importing(package: str, root: Path) -> set[str]:
    """The files under `root`'s code (specdistill/, benchmarks/, train.py) that import `package` or a module in it."""
    files = [*(root / "specdistill").rglob("*.py"), *(root / "benchmarks").rglob("*.py"), root / "train.py"]
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(name == package or name.startswith(package + ".") for name in names):
                found.add(path.relative_to(root).as_posix())
    return found


@pytest.mark.parametrize("kind", ["dflash", "cut_layers"])
def test_a_kind_added_in_its_own_folder_is_reached_through_the_registry_alone(kind):
    """DFlash and the cut-layer draft live in `specdistill/drafts/<kind>/`: outside that folder only the registry
    imports them, so stages, evaluation and export reach them through the kind interface, not by name."""
    root = Path(__file__).resolve().parents[1]
    importers = _modules_importing(f"specdistill.drafts.{kind}", root)
    outside = {path for path in importers if not path.startswith(f"specdistill/drafts/{kind}/")}
    assert outside == {"specdistill/drafts/registry.py"}
