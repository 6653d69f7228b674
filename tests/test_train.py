"""End-to-end runs of train.py in subprocesses, as a user runs it: sft -> distill -> adaspec, exports and errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import TINY, check_ok, run_train, stage_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """One tiny sft run, a distill run on its export, an adaspec run on both: the stages as separate jobs."""
    root = tmp_path_factory.mktemp("chain")
    sft = root / "sft"
    proc = run_train(
        ["stage=sft", *TINY, *stage_overrides("sft", steps=4), "sft.eval_examples=2", "sft.eval_max_new_tokens=4",
         "scheduler=constant", "sft.scheduler={_target_: specdistill.utils.schedules.cosine, _partial_: true, warmup_fraction: 0.25}",
         "trainer.log_every_n_steps=1", f"hydra.run.dir={sft}"]
    )  # fmt: skip
    check_ok(proc)
    target = f"models.target.pretrained_model_name_or_path={sft / 'export'}"
    distill = root / "distill"
    check_ok(
        run_train(["stage=distill", *TINY, target, *stage_overrides("distill"), f"hydra.run.dir={distill}"])
    )
    adaspec = root / "adaspec"
    proc = run_train(
        ["stage=adaspec", *TINY, target, *stage_overrides("adaspec"), f"adaspec.reference={distill / 'export'}", "adaspec.cached_scores=true",
         f"hydra.run.dir={adaspec}"]
    )  # fmt: skip
    check_ok(proc)
    return {"sft": sft, "distill": distill, "adaspec": adaspec}


@pytest.mark.parametrize("stage", ["sft", "distill", "adaspec"])
def test_stage_writes_a_loadable_hugging_face_export(chain, stage):
    export = chain[stage] / "export"
    assert (export / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("Tom has 3 apples.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_sft_follows_its_own_schedule_and_logs_it(chain):
    """`sft.scheduler` (cosine, 1 warmup step of 4) wins over the root `scheduler=constant`, and every step's rate
    is logged."""
    import csv

    from omegaconf import OmegaConf

    from specdistill.utils.schedules import cosine

    lr = OmegaConf.load(chain["sft"] / ".hydra" / "config.yaml").sft.lr
    with (chain["sft"] / "csv" / "metrics.csv").open() as f:
        logged = [float(row["lr-AdamW"]) for row in csv.DictReader(f) if row.get("lr-AdamW")]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = cosine(optimizer, total_steps=4, warmup_fraction=0.25)
    expected = []
    for _ in range(4):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert logged == pytest.approx(expected)
    assert len(set(expected)) == 3  # a constant schedule would fail this


def test_distill_reports_validation_before_and_after(chain):
    result = json.loads((chain["distill"] / "result.json").read_text())
    for name in ("val/kl", "val/expected_acceptance", "val/kl_before", "val/expected_acceptance_before"):
        assert name in result
    assert 0.0 <= result["val/expected_acceptance"] <= 1.0


def test_checkpoints_hold_only_trainable_weights(chain):
    ckpt = torch.load(chain["distill"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all(k.startswith("draft.") for k in keys), keys[:5]
    assert ckpt["optimizer_states"]


def test_adaspec_caches_reference_scores_and_writes_selection_report(chain):
    out = chain["adaspec"]
    assert (out / "reference_scores" / "specdistill_scores.json").is_file()
    assert (out / "selection_tokens.json").is_file()
    assert (out / "gap_histogram.png").is_file()
    assert json.loads((out / "result.json").read_text())["k"] == pytest.approx(0.4)


def test_relaunch_resumes_instead_of_starting_over(chain):
    """A second launch into a finished run directory resumes from last.ckpt and adds no optimizer steps."""
    proc = run_train(
        ["stage=distill", *TINY, f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}",
         *stage_overrides("distill"), f"hydra.run.dir={chain['distill']}"]
    )  # fmt: skip
    check_ok(proc)
    assert "resuming from" in proc.stdout + proc.stderr


def test_mismatched_tokenizer_is_refused(chain, tmp_path):
    proc = run_train(
        ["stage=distill", *TINY, "models.tokenizer.vocab_size=300",
         f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}", f"hydra.run.dir={tmp_path}"]
    )  # fmt: skip
    assert proc.returncode != 0
    assert "does not match" in proc.stderr


def test_adaspec_without_reference_says_how_to_fix(tmp_path):
    proc = run_train(["stage=adaspec", *TINY, f"hydra.run.dir={tmp_path}"])
    assert proc.returncode != 0
    assert "adaspec.reference" in proc.stderr


def test_missing_data_file_is_a_clear_error(tmp_path):
    proc = run_train(
        [
            "stage=sft",
            "task=gsm8k",
            f"task.data_files={tmp_path / 'missing.jsonl'}",
            *TINY[3:],
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert proc.returncode != 0
    assert "missing.jsonl" in proc.stderr


def test_unknown_task_lists_the_options(tmp_path):
    proc = run_train(["task=not_a_task", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode != 0
    assert "gsm8k" in proc.stderr  # Hydra lists the available task options
