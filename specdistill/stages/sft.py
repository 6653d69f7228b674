"""Stage `sft`: fine-tune the target on the task's answers (prompt tokens masked), then export it."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.evaluation.generation import greedy_texts, task_metric
from specdistill.modules.sft import SFTModule
from specdistill.stages.datamodules import training_datamodule
from specdistill.stages.model_loading import load_models, model_spec
from specdistill.stages.outputs import export_trained, logged_metrics, write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import build_settings
from specdistill.stages.trainer import build_trainer, fit, trainer_config

TRAINED_ROLES = ("target",)  # loaded with fp32 master weights


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "sft")
    trainer_cfg = trainer_config(cfg, "sft")
    seed_everything(cfg)
    tokenizer, models, _ = load_models(
        cfg, {"target": model_spec(cfg.models.target)}, trainable=TRAINED_ROLES
    )
    datamodule = training_datamodule(cfg, tokenizer, settings, trainer_cfg)
    module = SFTModule(
        model=models["target"],
        optimizer=instantiate(settings.optimizer),
        scheduler=instantiate(settings.scheduler),
    )
    trainer = build_trainer(cfg, "sft", out_dir, trainer_cfg)
    fit(trainer, module, datamodule)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    result = {"stage": "sft", **logged_metrics(trainer, ["val/loss"])}
    export = export_trained(
        trainer, module.model, tokenizer, out_dir / "export", {"stage": "sft", "task": cfg.task.name}
    )
    result["export"] = str(export)
    if settings.eval_examples and datamodule.task.scoring_available:
        prompts = datamodule.prompts("test")[: settings.eval_examples]
        texts = greedy_texts(
            module.model, tokenizer, [p["prompt_ids"] for p in prompts], settings.eval_max_new_tokens
        )
        result[f"target_{datamodule.task.metric_name}"] = task_metric(
            datamodule.task, [p["record"] for p in prompts], texts
        )
    return write_result(out_dir, result)
