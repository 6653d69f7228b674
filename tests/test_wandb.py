"""W&B logging without an account: offline runs whose history holds what Lightning logged, reports and exports."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from specdistill.utils.wandb_logger import has_api_key, log_export, log_report
from tests.wandb_files import NotARunFile, read_offline_run

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture
def no_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No API key anywhere: no env key, an empty netrc, no forced mode."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def wandb_logger_from_preset(save_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["logger=wandb", *overrides])
    return instantiate(cfg.logger, save_dir=str(save_dir))


def offline_run_dir(save_dir: Path) -> Path:
    runs = list((save_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def test_api_key_detection_reads_env_and_netrc(
    no_account, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not has_api_key()
    netrc = tmp_path / "netrc_with_key"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert has_api_key()
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", "y" * 40)
    assert has_api_key()


def test_without_an_account_the_run_goes_offline_and_keeps_the_logged_metrics(
    no_account, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="specdistill.utils.wandb_logger"):
        logger = wandb_logger_from_preset(tmp_path, "logger.tags=[unit]")
    assert "wandb sync" in caplog.text
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
    logger.log_hyperparams({"lr": 0.1})
    logger.experiment.finish()

    run = read_offline_run(offline_run_dir(tmp_path))
    losses = [row["train/loss"] for row in run["history"] if "train/loss" in row]
    assert len(losses) == 4 and all(isinstance(v, float) for v in losses)
    assert [row["trainer/global_step"] for row in run["history"] if "train/loss" in row] == [0, 1, 2, 3]
    assert run["config"]["lr"] == 0.1
    assert run["summary"]["train/loss"] == pytest.approx(losses[-1])
    assert run["run"]["project"] == "specdistill" and run["run"]["tags"] == ["unit"]
    assert run["run"]["name"] == tmp_path.name  # outside Hydra: the run directory's name
    # the run id is kept beside the run so that a requeued job continues the same W&B run
    assert (tmp_path / "wandb_run_id.txt").read_text() == run["run"]["id"]


def test_report_table_images_and_export_artifact(no_account, tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure()
    plt.plot([0.2, 0.4, 0.8], [0.61, 0.66, 0.70])
    png = tmp_path / "acceptance_vs_k.png"
    plt.savefig(png)
    plt.close()
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")

    logger = wandb_logger_from_preset(tmp_path / "run", "logger.log_model=true")
    report = {"acceptance_rate": 0.7, "speedup": 2.1, "per_task": [{"task": "arith", "acceptance_rate": 0.7}]}
    assert log_report(logger, report, images=[png])
    assert log_export(logger, export, {"stage": "distill"})
    logger.experiment.finish()

    run = read_offline_run(offline_run_dir(tmp_path / "run"))
    logged = {key for row in run["history"] for key in row}
    assert {"report/_type", "report/per_task/_type", "report/acceptance_vs_k/_type"} <= logged
    images = [
        row["report/acceptance_vs_k/format"]
        for row in run["history"]
        if "report/acceptance_vs_k/format" in row
    ]
    assert images == ["png"]
    assert run["summary"]["report/acceptance_rate"] == 0.7
    media = offline_run_dir(tmp_path / "run") / "files" / "media"
    assert list(media.rglob("*.png")) and list(media.rglob("*.table.json"))

    with pytest.raises(FileNotFoundError, match="does not exist"):
        log_report(logger, {"plot": str(tmp_path / "missing.png")})


def test_report_and_export_are_no_ops_for_other_loggers(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    csv = CSVLogger(str(tmp_path))
    assert log_report(csv, {"acceptance_rate": 0.5}) is False
    assert log_export(csv, tmp_path) is False


@pytest.fixture
def hydra_job(tmp_path: Path):
    """Sets HydraConfig as a job of `python train.py <overrides>` would (a multirun when `sweep` is given)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    def job(overrides: list[str], sweep: list[str] | None = None) -> Path:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        run_dir = tmp_path / "run"
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
            cfg.hydra.sweep.dir = str(tmp_path / "sweep")
            if (
                sweep is not None
            ):  # what Hydra's sweeper saves: the command line's overrides, sweeps unexpanded
                cfg.hydra.mode = "MULTIRUN"
                (tmp_path / "sweep").mkdir()
                OmegaConf.save(
                    {"hydra": {"overrides": {"task": sweep}}}, tmp_path / "sweep" / "multirun.yaml"
                )
        HydraConfig.instance().set_config(cfg)
        return run_dir

    yield job
    HydraConfig.instance().cfg = None


def test_run_names_are_the_stage_and_the_overrides_without_paths(hydra_job) -> None:
    from specdistill.utils.wandb_logger import RUN_NAME_LENGTH, run_name

    run_dir = hydra_job(
        ["stage=adaspec", "adaspec.k=0.4", "adaspec.reference=/data/runs/distill/export", "seed=1",
         "models.target.config.hidden_size=32", "models.draft.config.hidden_size=16"]
    )  # fmt: skip
    assert run_name(run_dir) == "adaspec k=0.4 seed=1 target.hidden_size=32 draft.hidden_size=16"
    # a logger in a sub-folder (a pipeline's step, an acceptance head's draft) names it
    assert run_name(run_dir / "adaspec_run").startswith("adaspec/adaspec_run k=0.4 seed=1 ")
    run_dir = hydra_job(["seed=1", "task.sizes.train=4800"])
    assert (
        run_name(run_dir / "acceptance_head" / "adaspec")
        == "pipeline/acceptance_head/adaspec seed=1 train=4800"
    )
    run_dir = hydra_job(["stage=sft", *(f"task.sizes.{s}={n}" for s, n in [("train", 4800), ("test", 800)]),
                         "scheduler@sft.scheduler=cosine", "sft.optimizer.lr=1e-4", "sft.batch_size=16",
                         "sft.eval_examples=20"])  # fmt: skip
    name = run_name(run_dir)
    assert len(name) == RUN_NAME_LENGTH and name.endswith("…")
    assert name.startswith("sft train=4800 test=800 scheduler=cosine lr=1e-4 batch_size=16 ")


def test_a_sweep_job_is_named_after_the_keys_the_sweep_varies(hydra_job) -> None:
    from specdistill.utils.wandb_logger import run_name

    common = ["stage=sft", "task.sizes.train=48", "models.target.pretrained_model_name_or_path=/x/sft/export"]
    run_dir = hydra_job([*common, "sft.optimizer.lr=0.001", "seed=2"],
                        sweep=[*common, "sft.optimizer.lr=1e-4,1e-3", "seed=range(3)"])  # fmt: skip
    assert run_name(run_dir) == "sft lr=0.001 seed=2"


def test_a_report_of_tables_only_logs_no_empty_table_and_fills_the_summary(
    no_account, tmp_path: Path
) -> None:
    from specdistill.evaluation.report import summary_metrics
    from specdistill.utils.wandb_logger import log_summary

    report = {
        "settings": {"task_metric_name": "accuracy"},
        "entries": [
            {"name": "autoregressive", "draft": None, "policy": None, "task_metric": 0.5,
             "metrics": {"acceptance_rate": None, "tokens_per_second": 100.0, "speedup": 1.0}},
            {"name": "d/fixed_k4", "draft": "d", "policy": "fixed_k4", "task_metric": 0.5,
             "metrics": {"acceptance_rate": 0.7, "tokens_per_second": 150.0, "speedup": 1.5}},
            {"name": "d/oracle", "draft": "d", "policy": "oracle", "task_metric": None,
             "metrics": {"acceptance_rate": 0.9, "tokens_per_second": 180.0, "speedup": 1.8}},
        ],
    }  # fmt: skip
    logger = wandb_logger_from_preset(tmp_path / "run")
    assert log_report(logger, {"entries": [{"name": "d/fixed_k4", "speedup": 1.5}]})
    assert log_summary(logger, summary_metrics(report, {"d/acceptance_head_over_oracle": 0.9}))
    logger.experiment.finish()

    run = read_offline_run(offline_run_dir(tmp_path / "run"))
    logged = {key for row in run["history"] for key in row}
    assert "report/entries/_type" in logged and not any(key.startswith("report/_") for key in logged)
    summary = run["summary"]
    assert summary["best/speedup"] == 1.8 and summary["best/name"] == "d/oracle"
    assert summary["d/fixed_k4/tokens_per_second"] == 150.0 and summary["d/fixed_k4/accuracy"] == 0.5
    assert (
        summary["autoregressive/tokens_per_second"] == 100.0
        and "autoregressive/acceptance_rate" not in summary
    )
    assert summary["d/acceptance_head_over_oracle"] == 0.9


@pytest.mark.parametrize("log_model", [True, False])
def test_a_head_export_goes_up_as_a_model_artifact_only_with_log_model(
    no_account, tmp_path: Path, log_model
) -> None:
    """An acceptance head leaves its run through specdistill/export/ like a draft: rank 0 writes it, and with
    `logger.log_model=true` it is logged as a `model` artifact (none without)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdistill.export.head import export_head
    from specdistill.models.acceptance_head import AcceptanceHead

    config = AutoConfig.for_model(
        "gpt_neox",
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    draft = AutoModelForCausalLM.from_config(config)
    save_dir = tmp_path / "run"
    logger = wandb_logger_from_preset(save_dir, f"logger.log_model={str(log_model).lower()}")
    trainer = L.Trainer(logger=logger, accelerator="cpu", devices=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    head = AcceptanceHead(hidden_size=16, num_blocks=0)
    metadata = {"stage": "acceptance_head", "draft": "adaspec"}
    export = export_head(trainer, head, save_dir / "export", draft, "drafts/adaspec", metadata)
    assert AcceptanceHead.read_config(export)["draft"]["source"] == "drafts/adaspec"
    logger.log_metrics({"done": 1.0})
    logger.experiment.finish()

    artifacts = read_offline_run(offline_run_dir(save_dir))["artifacts"]
    expected = [{"type": "model", "metadata": metadata}] if log_model else []
    assert [{"type": a["type"], "metadata": a["metadata"]} for a in artifacts] == expected


def test_exports_and_reports_need_no_wandb_without_a_wandb_logger():
    """`pip install -e .` has no wandb (it is the `wandb` extra): with the default CSV logger an export and a report
    must not import it (the Quickstart's run once ended in `No module named 'wandb'` at the first export)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['wandb'] = None  # any `import wandb` now raises ImportError\n"
        "from specdistill.utils.wandb_logger import log_export, log_report\n"
        "from lightning.pytorch.loggers import CSVLogger\n"
        "logger = CSVLogger('.')\n"
        "assert log_export(logger, '.') is False and log_report(logger, {'acceptance_rate': 0.5}) is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_run_file_reader_waits_for_the_exit_record_and_refuses_other_files(tmp_path: Path):
    """A run file is read once wandb's core has written its last record: one still being written (only the
    header so far) times out with a message instead of reading back an empty run; a file that is not a run file
    fails at once."""
    unfinished = tmp_path / "run-unfinished.wandb"
    unfinished.write_bytes(b":W&B" + (0xBEE1).to_bytes(2, "little") + b"\x00")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no exit record"):
        read_offline_run(unfinished, timeout=0.5)
    assert time.monotonic() - started >= 0.5
    other = tmp_path / "run-other.wandb"
    other.write_bytes(b"not a run file at all")
    with pytest.raises(NotARunFile, match="bad header"):
        read_offline_run(other, timeout=30)
