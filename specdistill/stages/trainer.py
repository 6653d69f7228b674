"""A training stage's Lightning Trainer: its settings (the preset, the stage's `trainer:` block, the command line's
`trainer.*`), the Trainer with its checkpoints and callbacks, fit with resume from `checkpoints/last.ckpt`, and
restoring the best checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from specdistill.callbacks.fingerprint import RunFingerprint
from specdistill.callbacks.progress import training_progress_bar
from specdistill.callbacks.scaleout import scaleout_callbacks
from specdistill.models.precision import MasterWeightsCheck, check_training_precision
from specdistill.utils.checkpoint_io import use_atomic_checkpoints
from specdistill.utils.run_dir import check_checkpoint
from specdistill.utils.strategy import check_devices

log = logging.getLogger(__name__)


def command_line_trainer_keys() -> list[str]:
    """The `trainer.<key>` settings given as overrides on the command line (or by a sweep) of this Hydra job."""
    if not HydraConfig.initialized():
        return []
    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return [o.key_or_group for o in overrides if o.key_or_group.startswith("trainer.") and not o.is_delete()]


def trainer_config(cfg: DictConfig, stage: str) -> DictConfig:
    """`cfg.trainer` with the stage's own `trainer:` block merged in, then the command line's `trainer.*` on top.

    The one place where a stage's trainer values (e.g. `sft.trainer.max_steps`) meet the trainer preset: a value a
    user types (`trainer.max_steps=7`) reaches the Lightning Trainer of every stage.
    """
    # merged into a fresh (non-struct) node, so a stage block may add keys the preset does not list
    # (the stage's block resolved in place first: it may interpolate stage keys, e.g. `${adaspec.optimal_epochs}`)
    stage_block = OmegaConf.to_container(cfg[stage].get("trainer") or OmegaConf.create(), resolve=True)
    merged = OmegaConf.merge(OmegaConf.create(), cfg.trainer, stage_block)
    for key in command_line_trainer_keys():
        OmegaConf.update(merged, key.removeprefix("trainer."), OmegaConf.select(cfg, key), force_add=True)
    if merged.get("max_epochs") is None and merged.get("max_steps", -1) in (None, -1):
        raise ValueError(
            f"the {stage} stage sets neither trainer.max_epochs nor trainer.max_steps (Lightning would train 1000 "
            f"epochs): set {stage}.trainer.max_epochs; the optimal-epoch regime reads {stage}.optimal_epochs, "
            f"which conf/tuning/<models>_<task>/{stage}.yaml gives for the pairs and tasks the paper ran"
        )
    return merged


def build_trainer(
    cfg: DictConfig,
    stage: str,
    out_dir: Path,
    trainer_cfg: DictConfig,
    callbacks: list[L.Callback] | None = None,
    select_best: str | None = None,
) -> L.Trainer:
    """A Lightning Trainer from `trainer_cfg` (see `trainer_config`), writing logs and checkpoints under `out_dir`.

    Fails early on missing GPUs/nodes or another run's directory (specdistill/utils/cluster.py, strategy.py), and on a
    precision that would train 16-bit parameters (specdistill/models/precision.py; checked again at train start); saves
    `checkpoints/last.ckpt` every `checkpoint_every_n_steps` optimizer steps if asked, and on the cluster's signal.
    `select_best` (a validation metric, higher is better) also keeps `checkpoints/best.ckpt`: the optimal-epoch regime.
    """
    check_devices(trainer_cfg)
    pure_bf16 = bool(cfg.get("pure_bf16", False))
    check_training_precision(trainer_cfg.get("precision"), pure_bf16)
    scaleout = scaleout_callbacks(cfg, out_dir, stage)
    logger = instantiate(cfg.logger, save_dir=str(out_dir)) if cfg.get("logger") else False
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        save_last=True,
        save_top_k=0,
        every_n_train_steps=cfg.get("checkpoint_every_n_steps"),
    )
    # the schedule each optimizer step used, next to the losses (`lr-<Optimizer>` in CSV and W&B)
    lr_monitor = [LearningRateMonitor(logging_interval="step")] if logger else []
    best = []
    if select_best:
        best = [ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="best", monitor=select_best, mode="max",
                                save_top_k=1)]  # fmt: skip
    # the training bar ends where the run stops (max_steps, accumulation, limit_train_batches, epochs)
    progress = [training_progress_bar()] if trainer_cfg.get("enable_progress_bar", True) else []
    trainer = instantiate(
        trainer_cfg,
        default_root_dir=str(out_dir),
        logger=logger,
        callbacks=[
            checkpoint,
            *best,
            *progress,
            *lr_monitor,
            *scaleout,
            MasterWeightsCheck(pure_bf16),
            *(callbacks or []),
        ],
    )
    # checkpoint files are written beside themselves and renamed: a kill or a full disk keeps the previous one
    return use_atomic_checkpoints(trainer)


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule) -> None:
    """Fit, resuming from `<out_dir>/checkpoints/last.ckpt` when a previous run left one."""
    last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    # a DeepSpeed checkpoint is a directory
    ckpt_path = str(last) if last.exists() else None
    if ckpt_path:
        signed = [c.fingerprint for c in trainer.callbacks if isinstance(c, RunFingerprint)]
        check_checkpoint(last, signed[0] if signed else None)  # complete, and (a directory) this run's
        log.info("resuming from %s", ckpt_path)
    # resuming reads the checkpoint with torch.load(weights_only=True): tensors and plain containers only
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    # a run that stops on max_steps mid-epoch writes no last.ckpt by itself; without it a relaunch would redo steps.
    # (Lightning's weights_only here means "leave out optimizer and loop state": a resumable checkpoint needs them.)
    trainer.save_checkpoint(last, weights_only=False)


def restore_best(trainer: L.Trainer, module: L.LightningModule) -> str | None:
    """Load the weights of the best checkpoint (see `select_best`) into `module`; returns its path, or None."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.monitor and callback.best_model_path:
            path = Path(callback.best_model_path)
            if path.is_dir():
                raise ValueError(
                    f"select_best cannot restore the sharded checkpoint {path}; convert it first "
                    "(specdistill.utils.strategy.deepspeed_checkpoint_to_hf) or leave select_best unset."
                )
            state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
            module.load_state_dict(state)
            log.info(
                "restored the best checkpoint %s (%s = %s)", path, callback.monitor, callback.best_model_score
            )
            return str(path)
    return None
