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

from specdistill.utils.wandb_logger import has_api_key, log_export, log_report, read_offline_run

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

    run = read_finished_run(offline_run_dir(tmp_path))
    losses = [row["train/loss"] for row in run["history"] if "train/loss" in row]
    assert len(losses) == 4 and all(isinstance(v, float) for v in losses)
    assert [row["trainer/global_step"] for row in run["history"] if "train/loss" in row] == [0, 1, 2, 3]
    assert run["config"]["lr"] == 0.1
    assert run["summary"]["train/loss"] == pytest.approx(losses[-1])
    assert run["run"]["project"] == "specdistill" and run["run"]["tags"] == ["unit"]
    assert run["run"]["name"] == tmp_path.name  # outside Hydra: the run directory's name
    # the run id is kept beside the run so that a requeued job continues the same W&B run
    assert (tmp_path / "wandb_run_id.txt").read_text() == run["run"]["id"]


def read_finished_run(path: Path, timeout_s: float = 30.0) -> dict:
    """Read an offline run once W&B's service process has written its summary.

    `finish()` hands the last records to a separate service process that writes the run file; on a loaded machine
    the file can lag behind by a moment (seen once in a full-suite run), so wait for the summary record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        run = read_offline_run(path)
        if run["summary"] or time.monotonic() > deadline:
            return run
        time.sleep(0.5)


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

    run = read_finished_run(offline_run_dir(tmp_path / "run"))
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
