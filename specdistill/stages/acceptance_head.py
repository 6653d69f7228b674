"""Stage `acceptance_head`: train a SpecDec++ acceptance head per draft on its labelled rollouts.

The draft stays frozen; the head reads its last hidden state (docs/METHODS.md section 4), through the draft's kind
(`DraftKind.teacher_forced`): an EAGLE-3 head's layer output after its final norm, over the states of the target,
which is then loaded beside the drafts (`DraftKind.reads_target`). Each head is saved as a small directory
(`head_config.json` + `model.safetensors`) under `<out_dir>/<draft name>/export`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts import exported_kind
from specdistill.export.head import export_head
from specdistill.head_data import HiddenCache, RolloutDataModule
from specdistill.modules.acceptance_head import AcceptanceHeadModule
from specdistill.rollout.storage import read_settings
from specdistill.stages.datamodules import stage_batch_plan
from specdistill.stages.model_loading import load_exported_drafts, load_frozen_target_and_drafts, named_drafts
from specdistill.stages.outputs import logged_metrics, write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import build_settings
from specdistill.stages.trainer import build_trainer, fit, trainer_config

VAL_METRICS = ["val/head_bce", "val/binary_kl", "val/auroc_rejection", "val/ece"]


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "acceptance_head")
    rollouts = settings.rollouts or {}
    if not rollouts:
        raise ValueError(
            "acceptance_head.rollouts is empty: give draft name -> rollout directory "
            "(+acceptance_head.rollouts.<draft>=<rollout_run>/rollouts/<draft>), or run stage=pipeline."
        )
    drafts = named_drafts(cfg, settings.drafts)
    missing = set(rollouts) - set(drafts)
    if missing:
        raise ValueError(
            f"acceptance_head.rollouts names drafts without a path in acceptance_head.drafts: {sorted(missing)} "
            "(+acceptance_head.drafts.<draft>=<draft export directory>)"
        )
    trainer_cfg = trainer_config(cfg, "acceptance_head")
    # acceptance_head.batch_size is the global batch; each device runs micro-batches of this size
    micro_batch_size = stage_batch_plan(settings, trainer_cfg).micro_batch_size
    specs = {name: drafts[name] for name in rollouts}
    target = None
    if any(spec.is_pretrained and exported_kind(spec.pretrained_model_name_or_path).reads_target
           for spec in specs.values()):  # fmt: skip
        # a draft that reads the target's states (EAGLE-3): the target too, on the CPU until the Trainer places it
        tokenizer, target, loaded, _ = load_frozen_target_and_drafts(cfg, specs, torch.device("cpu"))
    else:
        tokenizer, loaded, _ = load_exported_drafts(cfg, specs)
    models = {name: draft.model for name, draft in loaded.items()}  # the head reads the draft model's states
    result: dict = {"stage": "acceptance_head", "heads": {}}
    for name, rollout_dir in rollouts.items():
        seed_everything(cfg)
        draft = models[name]
        run_dir = out_dir / name
        head = instantiate(settings.model, hidden_size=draft.config.hidden_size)
        # a proposer head reads the draft's distribution the way decoding will: the rollouts' sampling settings
        sampling = SamplingConfig(**read_settings(rollout_dir)["sampling"])
        hidden_cache = None
        if settings.cache_hidden_states:
            # built at fit start (AcceptanceHeadModule), where the strategy places the draft, the ranks sharing it
            hidden_cache = HiddenCache(
                draft, rollout_dir, run_dir / "hidden_cache", mixing_ratio=settings.mixing_ratio, seed=cfg.seed,
                batch_size=micro_batch_size, pad_token_id=tokenizer.pad_token_id,
                dtype=settings.hidden_cache_dtype, head_input=head.input, sampling=sampling,
                kind=loaded[name].kind, target=target,
            )  # fmt: skip
        datamodule = RolloutDataModule(
            rollout_dir=str(rollout_dir),
            batch_size=micro_batch_size,
            mixing_ratio=settings.mixing_ratio,
            val_fraction=settings.val_fraction,
            seed=cfg.seed,
            pad_token_id=tokenizer.pad_token_id,
            head_input=head.input,
            hidden_cache=hidden_cache,
        )
        module = AcceptanceHeadModule(
            head=head,
            draft=None if hidden_cache is not None else draft,
            optimizer=instantiate(settings.optimizer),
            scheduler=instantiate(settings.scheduler),
            w_acc=settings.w_acc,
            w_rej=settings.w_rej,
            cache_hidden_states=hidden_cache is not None,
            reliability_bins=settings.reliability_bins,
            sampling=sampling,
            hidden_cache=hidden_cache,
            draft_kind=loaded[name].kind,
            target=target,
        )
        trainer = build_trainer(cfg, "acceptance_head", run_dir, trainer_cfg)
        fit(trainer, module, datamodule)
        trainer.validate(module, datamodule=datamodule, verbose=False)
        export = export_head(
            trainer, module.head, run_dir / "export", draft, drafts[name].pretrained_model_name_or_path,
            {"stage": "acceptance_head", "task": cfg.task.name, "draft": name},
        )  # fmt: skip
        result["heads"][name] = str(export)
        result.update({f"{name}/{k}": v for k, v in logged_metrics(trainer, VAL_METRICS).items()})
    return write_result(out_dir, result)
