"""End-to-end runs of train.py in subprocesses, as a user runs it: sft -> distill -> adaspec, exports and errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import TINY, check_ok, run_train, stage_overrides

pytestmark = pytest.mark.slow


STEPS = {"sft": 4, "distill": 2, "adaspec": 2, "acceptance_head": 3}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Every stage as a separate job, each on the exports of the earlier ones: sft -> distill -> adaspec -> rollout ->
    acceptance_head -> evaluate. Each training stage gets `trainer.max_steps` from the command line."""
    root = tmp_path_factory.mktemp("chain")
    runs = {
        name: root / name for name in ["sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate"]
    }
    check_ok(run_train(
        ["stage=sft", *TINY, *stage_overrides("sft", STEPS["sft"]), "sft.eval_examples=2", "sft.eval_max_new_tokens=4",
         "scheduler@sft.scheduler=cosine", "sft.scheduler.warmup_fraction=0.25", "trainer.log_every_n_steps=1",
         f"hydra.run.dir={runs['sft']}"]
    ))  # fmt: skip
    target = f"models.target.pretrained_model_name_or_path={runs['sft'] / 'export'}"
    check_ok(run_train(
        ["stage=distill", *TINY, target, *stage_overrides("distill", STEPS["distill"]), f"hydra.run.dir={runs['distill']}"]
    ))  # fmt: skip
    check_ok(run_train(
        ["stage=adaspec", *TINY, target, *stage_overrides("adaspec", STEPS["adaspec"]),
         f"adaspec.reference={runs['distill'] / 'export'}", "adaspec.cached_scores=true",
         f"hydra.run.dir={runs['adaspec']}"]
    ))  # fmt: skip
    draft = runs["adaspec"] / "export"
    check_ok(run_train(
        ["stage=rollout", *TINY, target, f"+rollout.drafts.adaspec={draft}", "rollout.num_prompts=8",
         "rollout.max_new_tokens=8", "rollout.batch_size=4", "rollout.shard_size=4", f"hydra.run.dir={runs['rollout']}"]
    ))  # fmt: skip
    check_ok(run_train(
        ["stage=acceptance_head", *TINY, f"+acceptance_head.drafts.adaspec={draft}",
         f"+acceptance_head.rollouts.adaspec={runs['rollout'] / 'rollouts' / 'adaspec'}",
         *stage_overrides("acceptance_head", STEPS["acceptance_head"]), f"hydra.run.dir={runs['acceptance_head']}"]
    ))  # fmt: skip
    check_ok(run_train(
        ["stage=evaluate", *TINY, target, f"+evaluate.drafts.adaspec={draft}",
         f"+evaluate.heads.adaspec={runs['acceptance_head'] / 'adaspec' / 'export'}", "evaluate.num_prompts=2",
         "evaluate.selection_prompts=2", "evaluate.max_new_tokens=6", "evaluate.fixed_lengths=[2]",
         "evaluate.acceptance_head.thresholds=[0.5]", "evaluate.acceptance_head.min_draft_length=1",
         f"hydra.run.dir={runs['evaluate']}"]
    ))  # fmt: skip
    return runs


@pytest.mark.parametrize("stage", sorted(STEPS))
def test_command_line_max_steps_reaches_every_training_stage(chain, stage):
    """`trainer.max_steps=N` on the command line wins over the stage's own `trainer:` block (the tiny tuning sets
    600 / 300 steps), so each run stopped after exactly N optimizer steps."""
    run_dir = chain[stage] / "adaspec" if stage == "acceptance_head" else chain[stage]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS[stage]


def test_evaluate_reports_every_policy_and_the_acceptance_head_ratios(chain):
    result = json.loads((chain["evaluate"] / "result.json").read_text())
    assert (
        "adaspec/acceptance_head_over_best_fixed_k" in result
        and "adaspec/acceptance_head_over_oracle" in result
    )
    names = [e["name"] for e in json.loads((chain["evaluate"] / "report.json").read_text())["entries"]]
    assert any("acceptance_head_h0.5" in n for n in names) and any(n.endswith("fixed_k2") for n in names)
    assert (chain["evaluate"] / "report.txt").is_file()


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
    """`sft.scheduler` (cosine, 1 warmup step of 4) drives the target's learning rate, and every step's rate is
    logged."""
    import csv

    from omegaconf import OmegaConf

    from specdistill.utils.schedules import cosine

    lr = OmegaConf.load(chain["sft"] / ".hydra" / "config.yaml").sft.optimizer.lr
    with (chain["sft"] / "csv" / "metrics.csv").open() as f:
        logged = [float(row["lr-AdamW/decay"]) for row in csv.DictReader(f) if row.get("lr-AdamW/decay")]
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
         *stage_overrides("distill", STEPS["distill"]), f"hydra.run.dir={chain['distill']}"]
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
