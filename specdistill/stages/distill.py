"""Stage `distill`: DistillSpec-style distillation of the draft on all answer tokens; its export is the reference.

With `distill.target_cache=<m>` the target's top-m answer distributions are cached once (`target_cache/`, or
`distill.target_cache_dir`; one target pass over train and validation at fit start, where the Trainer placed the
target) and training runs without it (docs/METHODS.md section 2, "Cached target distributions"). The result names
the cache's folder (`target_cache`), which a pipeline hands to the adaspec step. With `distill.target_cache=<dtype>`
(a kind that reads the target's hidden states, draft=eagle3) those states are cached instead, in the same folder
(`specdistill.data.target_states`), and likewise handed on; `specdistill.data.target_source` reads the setting.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from specdistill.data.datamodule import TaskDataModule
from specdistill.modules.distill import DistillModule
from specdistill.stages.datamodules import training_datamodule
from specdistill.stages.model_loading import draft_kind, load_models, model_spec
from specdistill.stages.outputs import export_trained, logged_metrics, write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import build_settings
from specdistill.stages.trainer import build_trainer, fit, restore_best, trainer_config

VAL_METRICS = ["val/kl", "val/expected_acceptance"]
TRAINED_ROLES = ("draft",)  # built by the draft kind with fp32 master weights; the target stays frozen


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "distill")
    trainer_cfg = trainer_config(cfg, "distill")
    seed_everything(cfg)
    kind = draft_kind(cfg, settings.init)
    specs = {"target": model_spec(cfg.models.target)}
    tokenizer, models, vocab_size = load_models(cfg, specs, drafts=dict.fromkeys(TRAINED_ROLES, kind))
    kind = kind.resolve(models["target"])  # what it leaves to the target, fixed once (DraftKind.resolve)
    datamodule = training_datamodule(cfg, tokenizer, settings, trainer_cfg)
    kind.prepare(models["draft"], datamodule)
    source = settings.target_source(kind)
    training = source.build(
        models.pop("target"), settings.target_cache_path(out_dir), tokenizer, datamodule, vocab_size, kind
    )
    module = DistillModule(
        draft=models["draft"],
        target=training.target,
        vocab_size=vocab_size,
        divergence=instantiate(cfg.divergence),
        optimizer=instantiate(settings.optimizer),
        scheduler=instantiate(settings.scheduler),
        kind=kind,
        target_states=training.states,
    )
    # its `frozen` holder would keep the target in memory after the cache's fit-start pass releases it
    del training
    trainer = build_trainer(cfg, "distill", out_dir, trainer_cfg, select_best=settings.select_best)
    metadata = {"stage": "distill", "task": cfg.task.name}
    trained = train_and_export(trainer, module, datamodule, tokenizer, out_dir, metadata)
    # the cache's folder, or None: the pipeline hands it to the adaspec step (conf/step/distill.yaml)
    cache = str(settings.target_cache_path(out_dir)) if source.cached else None
    # the data it learned from, as a data-size study reads it (benchmarks/scaling_study.py)
    data = {
        "train/examples": len(datamodule.records("train")),
        "train/answer_tokens": sum(datamodule.answer_tokens("train")),
    }
    return write_result(out_dir, {"stage": "distill", **trained, **data, "target_cache": cache})


def train_and_export(
    trainer: L.Trainer,
    module: DistillModule,
    datamodule: TaskDataModule,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    metadata: dict,
) -> dict:
    """Validate, fit (resuming if a checkpoint exists), keep the best epoch if asked, validate again, export the draft.

    Returns the validation metrics before (`<name>_before`) and after training, and the export path.
    """
    before = {f"{k}_before": v for k, v in validate(trainer, module, datamodule).items()}
    fit(trainer, module, datamodule)
    restore_best(trainer, module)
    after = validate(trainer, module, datamodule)
    export = export_trained(
        trainer, module.draft, tokenizer, out_dir / "export", {**metadata, **after}, module.kind
    )
    return {**before, **after, "export": str(export)}


def validate(trainer: L.Trainer, module: DistillModule, datamodule: TaskDataModule) -> dict[str, float]:
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return logged_metrics(trainer, VAL_METRICS)
