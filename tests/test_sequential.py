"""Sequential multi-task distillation (specdistill/stages/sequential.py): the forgetting arithmetic on hand-made
rows, the phase configs, the settings' errors, and train.py killed mid-phase and relaunched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdistill.errors import ConfigError
from specdistill.stages.model_loading import draft_kind
from specdistill.stages.sequential import forgetting_of, forgetting_table, headline_numbers, phase_config
from specdistill.stages.settings import build_settings
from specdistill.tasks.stdlib_code import stdlib_dir
from specdistill.utils.cluster import DEBUG_SIGNAL_ENV, PREEMPTED_EXIT_CODE
from tests.helpers import ROOT


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["stage=sequential", *overrides])


def row(method: str, after: str, task: str, acceptance: float) -> dict:
    return {"method": method, "after": after, "task": task, "expected_acceptance": acceptance}


ROWS = [
    row("distillspec", "code", "code", 0.80), row("distillspec", "code", "math", 0.50),
    row("distillspec", "math", "code", 0.70), row("distillspec", "math", "math", 0.75),
    row("adaspec", "code", "code", 0.82), row("adaspec", "code", "math", 0.52),
    row("adaspec", "math", "code", 0.79), row("adaspec", "math", "math", 0.77),
]  # fmt: skip


def test_forgetting_is_the_drop_from_a_tasks_own_phase_to_the_last():
    forgetting = forgetting_of(ROWS, ["code", "math"])
    assert [(f["method"], f["task"]) for f in forgetting] == [("distillspec", "code"), ("adaspec", "code")]
    assert forgetting[0]["forgetting"] == pytest.approx(0.10) and forgetting[1][
        "forgetting"
    ] == pytest.approx(0.03)
    assert forgetting[0]["after_own_phase"] == 0.80 and forgetting[0]["after_last_phase"] == 0.70
    numbers = headline_numbers(ROWS, forgetting)
    assert numbers["adaspec/math/after_code/expected_acceptance"] == 0.52
    assert numbers["distillspec/code/forgetting"] == pytest.approx(0.10)
    table = forgetting_table(ROWS, forgetting, ["code", "math"]).splitlines()
    assert table[0].split() == [
        "method",
        "after",
        "phase",
        "acceptance",
        "on",
        "code",
        "acceptance",
        "on",
        "math",
    ]
    assert table[2].split() == ["distillspec", "1", "(code)", "0.8000", "0.5000"]
    assert table[-1].split() == ["adaspec", "forgetting", "+0.0300"]


def test_three_phases_measure_each_earlier_task_against_the_last_phase():
    rows = [row("m", after, task, value) for after, task, value in [
        ("a", "a", 0.9), ("a", "b", 0.1), ("a", "c", 0.1), ("b", "a", 0.6), ("b", "b", 0.8), ("b", "c", 0.2),
        ("c", "a", 0.5), ("c", "b", 0.7), ("c", "c", 0.9)]]  # fmt: skip
    forgetting = forgetting_of(rows, ["a", "b", "c"])
    assert [(f["task"], round(f["forgetting"], 6)) for f in forgetting] == [("a", 0.4), ("b", 0.1)]


def test_a_phase_trains_both_methods_on_its_task_continuing_each_methods_own_draft():
    cfg = composed()
    first = phase_config(cfg, "code", {"distillspec": None, "adaspec": None})
    assert first.task.name == "stdlib_code" and list(first.pipeline.steps) == ["distill", "adaspec"]
    assert first.distill.init is None and first.adaspec.init is None and first.adaspec.reference is None
    second = phase_config(
        cfg, "math", {"distillspec": "/runs/1/distill/export", "adaspec": "/runs/1/adaspec/export"}, epochs=2
    )
    assert second.distill.trainer.max_epochs == 2 and second.adaspec.trainer.max_epochs == 2
    assert second.task.name == "arith"
    assert second.distill.init == "/runs/1/distill/export" and second.adaspec.init == "/runs/1/adaspec/export"
    assert cfg.task.name == "arith" and cfg.distill.init is None  # the run's own config is left as it was
    spec = draft_kind(second, second.distill.init).spec
    assert spec.pretrained_model_name_or_path == "/runs/1/distill/export" and spec.config is None


def test_with_target_answers_a_phase_first_answers_its_own_tasks_prompts():
    cfg = composed("+sequential.tasks.math.answers_from=/elsewhere/answers")
    phase = phase_config(cfg, "math", {"distillspec": None, "adaspec": None}, target_answers=True)
    assert list(phase.pipeline.steps) == ["target_answers", "distill", "adaspec"]
    assert phase.task.name == "arith" and phase.task.answers_from is None  # its target_answers step fills it
    plain = phase_config(cfg, "math", {"distillspec": None, "adaspec": None})
    assert (
        list(plain.pipeline.steps) == ["distill", "adaspec"]
        and plain.task.answers_from == "/elsewhere/answers"
    )


def test_a_cut_draft_continues_from_its_export_and_an_eagle3_head_refuses():
    kind = draft_kind(composed("draft=cut_layers_3"), "/runs/1/distill/export")
    assert kind.continues == "/runs/1/distill/export" and kind.specs("draft")[
        "draft"
    ].pretrained_model_name_or_path == ("/runs/1/distill/export")
    with pytest.raises(ConfigError, match="cannot continue from an export"):
        draft_kind(composed("draft=eagle3"), "/runs/1/distill/export")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sequential.phases=[code]", r"at least two tasks"),
        ("sequential.phases=[code,code]", r"each named once"),
        ("sequential.phases=[code,poetry]", r"\['poetry'\].*holds \['code', 'math'\]"),
        ("sequential.split=test", r"sequential.split"),
    ],
)
def test_bad_phases_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        build_settings(composed(override), "sequential")


SMALL = [
    "stage=sequential",
    *(f"sequential.tasks.{t}.max_examples.{s}={n}" for t in ("code", "math") for s, n in (("train", 24), ("validation", 4))),
    # the code task reads one stdlib package (asyncio: 13 train and 3 validation functions of <= 400 characters),
    # not the whole library, which each step and each measurement reads again with ast (~15 s a time)
    f"sequential.tasks.code.root={stdlib_dir() / 'asyncio'}",
    "sequential.max_examples=4",
    "sequential.max_length=96",
    "models.target.config.hidden_size=32",
    "models.target.config.num_hidden_layers=1",
    "models.target.config.num_attention_heads=2",
    "models.target.config.intermediate_size=64",
    "models.draft.config.hidden_size=16",
    "models.draft.config.num_attention_heads=2",
    "models.draft.config.intermediate_size=32",
    *(f"{s}.{k}" for s in ("distill", "adaspec") for k in (
        "trainer.max_epochs=10", "batch_size=4", "max_length=96", "eval_batch_size=4")),
    "+distill.trainer.max_steps=3",
    "+adaspec.trainer.max_steps=3",
    "+trainer.enable_progress_bar=false",
]  # fmt: skip


def train(
    run_dir: Path, signal_at: int | None = None, extra: tuple[str, ...] | list[str] = ()
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop(DEBUG_SIGNAL_ENV, None)
    if signal_at is not None:
        env[DEBUG_SIGNAL_ENV] = str(signal_at)
    command = [sys.executable, "train.py", *SMALL, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_train_py_killed_mid_phase_resumes_and_reports_every_tasks_acceptance_after_every_phase(tmp_path):
    killed = train(tmp_path, signal_at=2)  # the first training step to reach step 2: phase 1's distill
    assert killed.returncode == PREEMPTED_EXIT_CODE, killed.stderr[-3000:]
    first = tmp_path / "1_code" / "distill"
    assert (first / "checkpoints" / "last.ckpt").is_file() and not (first / "result.json").exists()

    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"resuming from {first / 'checkpoints'}" in said
    # phase 2 continues each method's own phase-1 draft (what each of its steps loaded, before the measurement)
    phase2 = said[
        said.index(f"pipeline finished: {tmp_path / '1_code'}") : said.index(
            f"pipeline finished: {tmp_path / '2_math'}"
        )
    ]
    distill2, adaspec2 = phase2.split("pipeline step: adaspec")
    assert f"loading {tmp_path / '1_code' / 'distill' / 'export'}" in distill2
    assert f"loading {tmp_path / '1_code' / 'adaspec' / 'export'}" in adaspec2
    assert f"loading {tmp_path / '1_code' / 'distill' / 'export'}" not in adaspec2
    record = json.loads((tmp_path / "2_math" / "adaspec" / "run_fingerprint.json").read_text())
    assert record["config"]["adaspec"]["init"] == str(tmp_path / "1_code" / "adaspec" / "export")
    assert record["config"]["task"]["name"] == "arith"
    # and phase 2's AdaSPEC is scored against phase 2's DistillSpec draft, its reference
    assert f"loading {tmp_path / '2_math' / 'distill' / 'export'}" in adaspec2

    report = json.loads((tmp_path / "forgetting.json").read_text())
    assert {(r["method"], r["after"], r["task"]) for r in report["rows"]} == {
        (m, a, t) for m in ("distillspec", "adaspec") for a in ("code", "math") for t in ("code", "math")
    }
    assert all(0 < r["expected_acceptance"] <= 1 and r["positions"] > 0 for r in report["rows"])
    result = json.loads((tmp_path / "result.json").read_text())
    for f in report["forgetting"]:
        assert result[f"{f['method']}/code/forgetting"] == pytest.approx(
            f["after_own_phase"] - f["after_last_phase"]
        )
    assert result["exports"]["adaspec"] == str(tmp_path / "2_math" / "adaspec" / "export")
    assert "acceptance on code" in (tmp_path / "forgetting.txt").read_text()


ANSWER_TOKENS = 6


@pytest.mark.slow
def test_with_target_answers_each_phase_trains_and_is_measured_on_the_targets_answers_to_its_task(tmp_path):
    """`sequential.target_answers=true`: each phase's training steps read its own target_answers folder, and each
    task is measured on those answers (short: ANSWER_TOKENS tokens each), not on the dataset's."""
    overrides = ["sequential.target_answers=true", f"target_answers.max_new_tokens={ANSWER_TOKENS}"]
    done = train(tmp_path, extra=overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    report = json.loads((tmp_path / "forgetting.json").read_text())
    for folder, task in (("1_code", "code"), ("2_math", "math")):
        answers = tmp_path / folder / "target_answers" / "answers"
        assert (answers / "validation.jsonl").is_file() and report["answers"][task] == str(answers)
        name = {"code": "stdlib_code", "math": "arith"}[task]
        # the train split is read by the phase's training steps only (the measurement reads validation)
        assert re.search(
            rf"{name}/train: training on \d+ generated answers from {re.escape(str(answers))}", said
        )
        rows = [r for r in report["rows"] if r["task"] == task]
        # re-tokenised, a decoded answer can take more tokens than were generated (byte fallbacks): a bound of
        # twice as many; four stdlib bodies (the code task's own answers) are hundreds of tokens
        assert len(rows) == 4 and all(0 < r["positions"] <= 4 * 2 * (ANSWER_TOKENS + 1) for r in rows)
