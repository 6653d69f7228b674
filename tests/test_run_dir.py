"""Run folders: every stage and pipeline step is checked before anything is written; nothing is silently reused,
overwritten or locked by a run that never started (specdistill/utils/run_dir.py, stages/pipeline.py, train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdistill.errors import EX_CANTCREAT, InputFileError, RunDirConflictError
from specdistill.stages import pipeline
from specdistill.utils.cluster import FINGERPRINT_FILE, run_fingerprint, sign_checkpoint_dir
from specdistill.utils.run_dir import check_checkpoint, check_stage_dir, write_record
from tests.helpers import ROOT, TINY, check_ok, run_train, stage_overrides

STEPS = ["sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate", "analyse"]
FAKE = [f"stage.steps.{s}.run._target_=tests.fake_stage.run" for s in STEPS]


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run_pipeline(out_dir: Path, *overrides: str) -> list[str]:
    """Run the pipeline (fast stand-in steps) and return the steps that ran."""
    calls = out_dir / "calls.log"
    calls.unlink(missing_ok=True)
    pipeline.run(composed(*FAKE, *overrides), out_dir)
    return calls.read_text().split() if calls.is_file() else []


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "calls.log"}  # fmt: skip


# -- pipeline steps -------------------------------------------------------------------------------------------------


def test_a_new_draft_producing_step_reaches_every_later_step_that_takes_drafts(tmp_path):
    """A step declared only by this test (provides a draft) reaches evaluate's drafts, keyed by its name, after the
    drafts of distill (labelled distillspec) and adaspec; evaluate's declaration and settings are not edited."""
    extra = "+stage.steps.extra={run: {_target_: tests.fake_stage.run, _partial_: true}, provides: {draft: export}}"
    cfg = composed(*FAKE, extra, "pipeline.steps=[sft,distill,adaspec,extra,rollout,evaluate]")
    pipeline.run(cfg, tmp_path)
    drafts = {name: str(tmp_path / name / "export") for name in ("distill", "adaspec", "extra")}
    expected = {"distillspec": drafts["distill"], "adaspec": drafts["adaspec"], "extra": drafts["extra"]}
    assert dict(cfg.evaluate.drafts) == expected and dict(cfg.rollout.drafts) == expected
    assert (
        dict(cfg.acceptance_head.drafts) == {}
    )  # the acceptance_head step does not run: nothing is wired to it
    assert cfg.adaspec.reference == drafts["distill"]  # a literal output, as before


def test_every_step_is_declared_once_and_a_stage_alone_composes_the_groups_its_step_reads():
    pipe = composed()
    for name, step in pipe.stage.steps.items():
        alone = composed(f"stage={name}")
        assert alone.stage.run == step.run and alone.stage.name == name
        shared = {"divergence", "selector", "sampling"}
        reads = set(step.get("reads") or [])
        assert {g for g in shared if g in alone} == reads & shared, name
        assert all(group in alone for group in reads), (
            name
        )  # e.g. sequential reads its phases' distill, adaspec


def test_pipeline_relaunch_with_the_same_settings_reuses_every_step(tmp_path):
    assert run_pipeline(tmp_path) == STEPS
    assert run_pipeline(tmp_path) == []
    assert json.loads((tmp_path / "results.json").read_text())["adaspec"]["stage"] == "adaspec"


def test_pipeline_relaunch_with_another_k_is_refused_listing_the_differences_and_writes_nothing(tmp_path):
    run_pipeline(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(
        RunDirConflictError, match=r"adaspec \(adaspec\.k\).*evaluate.*pipeline\.on_change=rerun"
    ):
        run_pipeline(tmp_path, "adaspec.k=0.8")
    assert snapshot(tmp_path) == before


def test_pipeline_relaunch_with_another_divergence_reruns_from_distill_keeping_the_old_folders(tmp_path):
    run_pipeline(tmp_path)
    old_adaspec = json.loads((tmp_path / "adaspec" / FINGERPRINT_FILE).read_text())
    ran = run_pipeline(tmp_path, "divergence=reverse_kl", "pipeline.on_change=rerun")
    assert ran == STEPS[1:]  # sft does not read the divergence; every step after distill builds on it
    kept = sorted(p.name for p in tmp_path.glob("*.replaced-*"))
    assert [k.split(".")[0] for k in kept] == sorted(STEPS[1:])
    aside = next(tmp_path.glob("adaspec.replaced-*"))
    assert json.loads((aside / FINGERPRINT_FILE).read_text()) == old_adaspec  # nothing lost
    assert run_pipeline(tmp_path, "divergence=reverse_kl") == []  # and now the folder is that run


def test_pipeline_relaunch_with_another_draft_size_is_refused_at_the_first_step(tmp_path):
    run_pipeline(tmp_path)
    with pytest.raises(RunDirConflictError, match=r"sft \(models\.draft\.config\.hidden_size\)"):
        run_pipeline(tmp_path, "models.draft.config.hidden_size=48")


def test_pipeline_finished_step_trained_for_other_max_steps_is_not_reused(tmp_path):
    run_pipeline(tmp_path)
    with pytest.raises(RunDirConflictError, match=r"distill \(distill\.trainer\.max_steps\)"):
        run_pipeline(tmp_path, "++distill.trainer.max_steps=7")


def test_pipeline_unfinished_step_resumes_and_later_steps_run(tmp_path):
    run_pipeline(tmp_path)
    (tmp_path / "adaspec" / "result.json").unlink()  # killed after its checkpoint, before its result
    (tmp_path / "adaspec" / "checkpoints").mkdir()
    (tmp_path / "adaspec" / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(RunDirConflictError, match=r"rollout \(<step adaspec, which runs again>\)"):
        run_pipeline(tmp_path)  # rollout and later were built on the unfinished adaspec: not reused silently
    assert run_pipeline(tmp_path, "pipeline.on_change=rerun") == STEPS[2:]
    assert (tmp_path / "adaspec" / "checkpoints" / "last.ckpt").is_file()  # resumed in place, not moved


def test_pipeline_into_another_stages_folder_is_refused(tmp_path):
    cfg = composed("stage=distill")
    record = run_fingerprint(cfg)
    write_record(tmp_path, record)
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(RunDirConflictError, match="holds a 'distill' run"):
        run_pipeline(tmp_path)


# -- one stage ------------------------------------------------------------------------------------------------------


def test_stage_into_a_pipeline_folder_is_refused(tmp_path):
    run_pipeline(tmp_path)
    with pytest.raises(RunDirConflictError, match="holds a 'pipeline' run"):
        check_stage_dir(tmp_path, run_fingerprint(composed("stage=distill")))


def test_folder_with_results_but_no_record_is_refused(tmp_path):
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(RunDirConflictError, match="no run_fingerprint.json"):
        check_stage_dir(tmp_path, run_fingerprint(composed("stage=sft")))


def test_run_that_stopped_before_producing_results_does_not_lock_its_folder(tmp_path):
    write_record(tmp_path, run_fingerprint(composed("stage=sft", "sft.optimizer.lr=1.0")))
    (tmp_path / ".hydra").mkdir()
    assert check_stage_dir(tmp_path, run_fingerprint(composed("stage=sft"))) == "fresh"


# -- through train.py -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A fixed-directory sft run whose first launch died before training (a bad model setting), relaunched fixed."""
    run_dir = tmp_path_factory.mktemp("runs") / "sft"
    common = ["stage=sft", *TINY, *stage_overrides("sft", 1), "sft.eval_examples=2", "sft.eval_max_new_tokens=2",
              f"hydra.run.dir={run_dir}"]  # fmt: skip
    broken = run_train([*common, "models.target.config.num_attention_heads=3"])  # 32 is not a multiple of 3
    assert broken.returncode != 0 and (run_dir / FINGERPRINT_FILE).is_file()
    check_ok(run_train(common))
    return run_dir


@pytest.mark.slow
def test_fixed_relaunch_into_the_folder_of_a_run_that_died_before_training_runs(sft_run):
    assert json.loads((sft_run / "result.json").read_text())["stage"] == "sft"
    overrides = (sft_run / ".hydra" / "overrides.yaml").read_text()
    assert "num_attention_heads=3" not in overrides  # the record and .hydra/ are the run that trained


def test_resumed_relaunch_keeps_the_earlier_launchs_hydra_files(tmp_path):
    from hydra.core.hydra_config import HydraConfig

    from specdistill.cli import save_hydra_files

    def launch(*overrides: str) -> None:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            save_hydra_files(cfg, tmp_path)
        finally:
            HydraConfig.instance().cfg = None

    launch("stage=sft", "trainer.max_steps=3")
    launch("stage=sft", "trainer.max_steps=9")  # the same run, resumed to train longer
    assert "trainer.max_steps=9" in (tmp_path / ".hydra" / "overrides.yaml").read_text()
    (earlier,) = (tmp_path / ".hydra" / "earlier").iterdir()
    assert "trainer.max_steps=3" in (earlier / "overrides.yaml").read_text()
    assert (earlier / "config.yaml").is_file() and (earlier / "hydra.yaml").is_file()


@pytest.mark.slow
def test_refused_relaunch_does_not_rewrite_hydra_files(sft_run):
    before = snapshot(sft_run)
    proc = run_train(["stage=sft", *TINY, "sft.optimizer.lr=0.5", f"hydra.run.dir={sft_run}"])
    assert proc.returncode == EX_CANTCREAT
    assert "sft.optimizer.lr" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(sft_run) == before


@pytest.mark.slow
def test_evaluate_launched_into_a_training_runs_folder_is_refused(sft_run):
    before = snapshot(sft_run)
    proc = run_train(["stage=evaluate", *TINY, f"+evaluate.drafts.mine={sft_run / 'export'}",
                      f"hydra.run.dir={sft_run}"])  # fmt: skip
    assert proc.returncode == EX_CANTCREAT and "holds a 'sft' run" in proc.stderr
    assert snapshot(sft_run) == before  # result.json and .hydra/ of the sft run are untouched


# -- checkpoints ----------------------------------------------------------------------------------------------------


def test_corrupted_last_ckpt_is_refused_naming_the_file_and_the_fix(tmp_path):
    import torch

    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, ckpt)
    check_checkpoint(ckpt, None)  # a complete archive passes
    ckpt.write_bytes(ckpt.read_bytes()[:700])  # the job was killed while saving
    with pytest.raises(InputFileError, match=r"last\.ckpt is not a readable checkpoint.*last\.ckpt\.broken"):
        check_checkpoint(ckpt, None)
    ckpt.write_bytes(b"garbage")
    with pytest.raises(InputFileError, match="not a readable checkpoint"):
        check_checkpoint(ckpt, None)


def test_deepspeed_checkpoint_directory_loads_only_with_this_runs_fingerprint(tmp_path):
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    with pytest.raises(InputFileError, match="no specdistill_fingerprint.json.*weights_only=False"):
        check_checkpoint(ckpt, "abc")  # unsigned: DeepSpeed would unpickle it
    sign_checkpoint_dir(ckpt, {"fingerprint": "other", "models": "m"})
    with pytest.raises(RunDirConflictError, match="written by another run"):
        check_checkpoint(ckpt, "abc")
    sign_checkpoint_dir(ckpt, {"fingerprint": "abc", "models": "m"})
    check_checkpoint(ckpt, "abc")


def test_deepspeed_conversion_refuses_a_checkpoint_of_another_run(tmp_path):
    from specdistill.utils.strategy import deepspeed_checkpoint_to_hf

    pytest.importorskip("deepspeed")
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    write_record(tmp_path, run_fingerprint(composed("stage=distill")))
    sign_checkpoint_dir(ckpt, {"fingerprint": "another run", "models": "m"})
    with pytest.raises(RunDirConflictError, match="written by another run"):
        deepspeed_checkpoint_to_hf(ckpt, lambda: None, tmp_path / "export")  # before DeepSpeed reads a byte


@pytest.mark.slow
def test_refused_pipeline_relaunch_leaves_hydra_files_and_results_untouched(tmp_path):
    run_dir = tmp_path / "pipeline"
    check_ok(run_train([*FAKE, f"hydra.run.dir={run_dir}"]))
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "evaluate" / "result.json").is_file()
    before = snapshot(run_dir)
    proc = run_train([*FAKE, "adaspec.k=0.8", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == EX_CANTCREAT and "adaspec (adaspec.k)" in proc.stderr
    assert snapshot(run_dir) == before  # .hydra/ still records the settings the steps ran with


def test_the_distill_steps_target_cache_reaches_the_adaspec_step_and_a_null_output_fills_nothing(tmp_path):
    """conf/step/distill.yaml wires the target cache's folder into adaspec.target_cache_dir; a step that made no
    cache returns None for it, which leaves the key (a user's own folder) as it was."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["adaspec.target_cache_dir=/mine"])
    step = cfg.stage.steps.distill
    pipeline.wire_outputs(cfg, "distill", step, {"export": "/run/distill/export", "target_cache": None})
    assert cfg.adaspec.reference == "/run/distill/export" and cfg.adaspec.target_cache_dir == "/mine"
    pipeline.wire_outputs(cfg, "distill", step, {"export": "/e", "target_cache": "/run/distill/target_cache"})
    assert cfg.adaspec.target_cache_dir == "/run/distill/target_cache"
    with pytest.raises(KeyError, match="returned no 'target_cache'"):
        pipeline.wire_outputs(cfg, "distill", step, {"export": "/e"})
