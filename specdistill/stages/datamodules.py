"""A stage's data module: the task's `TaskDataModule`, and for a training stage its global batch split over the
Trainer's devices into micro-batch and gradient accumulation (specdistill/utils/batching.py)."""

from __future__ import annotations

import logging
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from transformers import PreTrainedTokenizerBase

from specdistill.data.datamodule import TaskDataModule
from specdistill.data.packing import padding_share
from specdistill.stages.settings import TaskTrainingSettings, TrainingSettings
from specdistill.utils.batching import BatchPlan, batch_plan, world_size

log = logging.getLogger(__name__)


def build_datamodule(
    cfg: DictConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    batch_size: int = 1,
    eval_batch_size: int | None = None,
    accumulate_grad_batches: int = 1,
    task: Any = None,
    packing: bool = False,
) -> TaskDataModule:
    """The task's data module; stages that only read prompts (rollout, evaluate) leave the batch sizes at 1.

    `task` is a conf/task/ node to use instead of the run's `cfg.task` (evaluate's `test_task`).
    """
    return TaskDataModule(
        task=instantiate(cfg.task if task is None else task),
        tokenizer=tokenizer,
        max_length=max_length,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size or batch_size,
        accumulate_grad_batches=accumulate_grad_batches,
        seed=cfg.seed,
        packing=packing,
    )


def stage_batch_plan(settings: TrainingSettings, trainer_cfg: DictConfig) -> BatchPlan:
    """Split the stage's global `batch_size` over the Trainer's devices (specdistill/utils/batching.py) and write the
    derived gradient accumulation into `trainer_cfg`."""
    plan = batch_plan(
        int(settings.batch_size),
        world_size(trainer_cfg),
        settings.micro_batch_size,
        trainer_cfg.get("accumulate_grad_batches"),
    )
    with open_dict(trainer_cfg):
        trainer_cfg.accumulate_grad_batches = plan.accumulate_grad_batches
    log.info(
        "global batch %d = %d devices x micro-batch %d x accumulation %d",
        plan.global_batch_size, plan.world_size, plan.micro_batch_size, plan.accumulate_grad_batches,
    )  # fmt: skip
    return plan


def training_datamodule(
    cfg: DictConfig,
    tokenizer: PreTrainedTokenizerBase,
    settings: TaskTrainingSettings,
    trainer_cfg: DictConfig,
) -> TaskDataModule:
    """The data module of a training stage: its length and batch plan (`settings.batch_size` is the global batch;
    the micro-batch and the Trainer's gradient accumulation follow from the world size, see `stage_batch_plan`)."""
    plan = stage_batch_plan(settings, trainer_cfg)
    datamodule = build_datamodule(
        cfg,
        tokenizer,
        max_length=settings.max_length,
        batch_size=plan.micro_batch_size,
        eval_batch_size=settings.eval_batch_size,
        accumulate_grad_batches=plan.accumulate_grad_batches,
        packing=bool(getattr(settings, "packing", False)),
    )
    if datamodule.packing_collator is not None:
        lengths = [len(ids) for ids in datamodule.tokenized("train")["input_ids"]]
        plain, packed, rows = padding_share(lengths, plan.micro_batch_size, settings.max_length)
        log.info(
            "packing: the %d training examples in %d rows of at most %d tokens, %.0f%% padding (%.0f%% unpacked)",
            len(lengths), rows, settings.max_length, 100 * packed, 100 * plain,
        )  # fmt: skip
    return datamodule
