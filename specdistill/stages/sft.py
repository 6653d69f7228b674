"""Stage `sft`: fine-tune the target on the task's answers (prompt tokens masked), then export it."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.modules.sft import SFTModule
from specdistill.stages.common import (
    build_datamodule,
    build_trainer,
    export_trained,
    fit,
    load_models,
    logged_metrics,
    model_spec,
    seed_everything,
    stage_dir,
    write_result,
)
from specdistill.stages.generation import greedy_texts, task_metric


def run(cfg: DictConfig) -> dict:
    settings = cfg.sft
    out_dir = stage_dir(cfg, "sft")
    seed_everything(cfg)
    tokenizer, models, _ = load_models(cfg, {"target": model_spec(cfg.models.target)})
    datamodule = build_datamodule(cfg, tokenizer, settings)
    module = SFTModule(
        model=models["target"],
        optimizer=instantiate(cfg.optimizer, lr=settings.lr),
        scheduler=instantiate(settings.scheduler),
        accumulate_grad_batches=settings.accumulate_grad_batches,
    )
    trainer = build_trainer(cfg, out_dir, settings)
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
