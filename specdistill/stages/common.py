"""Pieces every stage shares: tokenizer and models with vocabulary checks, data module, trainer, results."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.models import ModelSpec, check_model_covers_vocab, check_same_tokenizer, load_model
from specdistill.models.tokenizer import ensure_pad_token, load_tokenizer

log = logging.getLogger(__name__)


def stage_dir(cfg: DictConfig, name: str) -> Path:
    """The directory a stage writes into: the Hydra run directory, or a sub-directory per stage in a pipeline."""
    root = Path(cfg.paths.output_dir)
    out = root / name if cfg.get("stage", {}).get("name") == "pipeline" else root
    out.mkdir(parents=True, exist_ok=True)
    return out


def model_spec(node: DictConfig | ModelSpec) -> ModelSpec:
    return node if isinstance(node, ModelSpec) else instantiate(node)


def shared_tokenizer(cfg: DictConfig, specs: dict[str, ModelSpec]) -> PreTrainedTokenizerBase:
    """The pair's tokenizer, checked against the tokenizer of every pretrained model in `specs`.

    Models built from a config take the shared tokenizer; a pretrained model (hub id or an earlier export) brings its
    own tokenizer, which must map the same strings to the same ids.
    """
    tokenizer = ensure_pad_token(instantiate(cfg.models.tokenizer))
    tokenizers = {"models.tokenizer": tokenizer}
    for role, spec in specs.items():
        if spec.is_pretrained:
            tokenizers[role] = load_tokenizer(
                spec.pretrained_model_name_or_path, spec.revision, spec.trust_remote_code
            )
    check_same_tokenizer(tokenizers)
    return tokenizer


def load_models(
    cfg: DictConfig, specs: dict[str, ModelSpec]
) -> tuple[PreTrainedTokenizerBase, dict[str, PreTrainedModel], int]:
    """Load the tokenizer and each model once; return `(tokenizer, models, real_vocab_size)`."""
    tokenizer = shared_tokenizer(cfg, specs)
    vocab_size = len(tokenizer)
    models = {}
    for role, spec in specs.items():
        model = load_model(spec, vocab_size=vocab_size)
        check_model_covers_vocab(role, model, vocab_size)
        models[role] = model
    return tokenizer, models, vocab_size


def named_drafts(cfg: DictConfig, paths: DictConfig | None) -> dict[str, ModelSpec]:
    """`paths` (draft name -> export directory) as model specs, or the pair's draft (`draft`) when none is given."""
    if not paths:
        return {"draft": model_spec(cfg.models.draft)}
    dtype = cfg.models.draft.dtype
    return {name: ModelSpec(pretrained_model_name_or_path=path, dtype=dtype) for name, path in paths.items()}


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU; any other value is a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_frozen_target_and_drafts(
    cfg: DictConfig, drafts: dict[str, ModelSpec], device: torch.device
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, dict[str, PreTrainedModel], int]:
    """For stages without training (rollout, evaluate): `(tokenizer, target, drafts, vocab_size)`, all frozen on
    `device`, after the same tokenizer checks as every other stage."""
    from specdistill.models import freeze

    tokenizer, models, vocab_size = load_models(cfg, {"target": model_spec(cfg.models.target), **drafts})
    for model in models.values():
        freeze(model).to(device)
    target = models.pop("target")
    return tokenizer, target, models, vocab_size


def build_datamodule(cfg: DictConfig, tokenizer: PreTrainedTokenizerBase, settings: DictConfig):
    from specdistill.data.datamodule import TaskDataModule

    task = instantiate(cfg.task)
    return TaskDataModule(
        task=task,
        tokenizer=tokenizer,
        max_length=settings.max_length,
        batch_size=settings.batch_size,
        eval_batch_size=settings.get("eval_batch_size") or settings.batch_size,
        accumulate_grad_batches=settings.accumulate_grad_batches,
        seed=cfg.seed,
    )


def build_trainer(
    cfg: DictConfig, out_dir: Path, settings: DictConfig, callbacks: list[L.Callback] | None = None
) -> L.Trainer:
    """A Lightning Trainer from `conf/trainer`, writing logs and checkpoints under `out_dir`."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    # scale-out (specdistill/utils/cluster.py, strategy.py): fail early on missing GPUs/nodes or another run's
    # directory; checkpoint every N optimizer steps if asked, and on the cluster's requeue signal.
    from specdistill.utils.cluster import scaleout_callbacks
    from specdistill.utils.strategy import check_devices

    check_devices(cfg.trainer)
    scaleout = scaleout_callbacks(cfg, out_dir)
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
    if settings.get("select_best"):
        # the "optimal-epoch" regime: keep the checkpoint with the best validation metric and export that one
        best = [ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="best", monitor=settings.select_best,
                                mode=settings.get("select_best_mode", "max"), save_top_k=1)]  # fmt: skip
    return instantiate(
        cfg.trainer,
        default_root_dir=str(out_dir),
        logger=logger,
        callbacks=[checkpoint, *best, *lr_monitor, *scaleout, *(callbacks or [])],
        max_epochs=settings.max_epochs,
        max_steps=settings.max_steps,
        accumulate_grad_batches=settings.accumulate_grad_batches,
        val_check_interval=settings.get("val_check_interval"),
        limit_val_batches=settings.get("limit_val_batches"),
    )


def export_trained(
    trainer: L.Trainer,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    metadata: dict[str, Any],
) -> Path:
    """Write the Hugging Face export of a trained model (gathering ZeRO-3 shards first; rank 0 writes) and, when
    the logger is W&B with `log_model`, upload it as an artifact."""
    from specdistill.export.hf import export_pretrained
    from specdistill.utils.strategy import full_weights
    from specdistill.utils.wandb_logger import log_export

    with full_weights(model, trainer):
        if trainer.is_global_zero:
            export_pretrained(model, tokenizer, out_dir, metadata)
    trainer.strategy.barrier()
    log_export(trainer.logger, out_dir, metadata)
    return out_dir


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule) -> None:
    """Fit, resuming from `<out_dir>/checkpoints/last.ckpt` when a previous run left one."""
    last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    # a DeepSpeed checkpoint is a directory
    ckpt_path = str(last) if last.exists() else None
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    # resuming reads the checkpoint with torch.load(weights_only=True): tensors and plain containers only
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    # a run that stops on max_steps mid-epoch writes no last.ckpt by itself; without it a relaunch would redo steps.
    # (Lightning's weights_only here means "leave out optimizer and loop state": a resumable checkpoint needs them.)
    trainer.save_checkpoint(last, weights_only=False)


def restore_best(trainer: L.Trainer, module: L.LightningModule) -> str | None:
    """Load the weights of the best checkpoint (see `select_best`) into `module`; returns its path, or None."""
    from lightning.pytorch.callbacks import ModelCheckpoint

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


def logged_metrics(trainer: L.Trainer, names: list[str]) -> dict[str, float]:
    metrics = trainer.callback_metrics
    return {name: float(metrics[name]) for name in names if name in metrics}


def write_result(out_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def resolved(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def seed_everything(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")
