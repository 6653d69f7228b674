"""What every stage builds from its config: tokenizer and models (vocabulary-checked), data module, Trainer, results.

A stage is `run(cfg, out_dir) -> dict`: it reads its own settings group (`cfg.<stage>`), the pair (`cfg.models`), the
task, the trainer, the logger, and writes into `out_dir` (the run directory, or `<run_dir>/<step>` in a pipeline).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.callbacks.fingerprint import RunFingerprint
from specdistill.callbacks.progress import training_progress_bar
from specdistill.callbacks.scaleout import scaleout_callbacks
from specdistill.data.datamodule import TaskDataModule
from specdistill.drafts import DraftKind, LoadedDraft, Standalone, exported_kind, load_draft
from specdistill.export.hf import export_pretrained
from specdistill.export.publish import publish_export
from specdistill.models import ModelSpec, check_model_covers_vocab, check_same_tokenizer, freeze, load_model
from specdistill.models.loading import is_placed_across_devices
from specdistill.models.precision import MasterWeightsCheck, check_training_precision, trainable_spec
from specdistill.models.tokenizer import ensure_pad_token, load_tokenizer
from specdistill.stages.settings import TaskTrainingSettings, TrainingSettings
from specdistill.utils.atomic import atomic_write_text
from specdistill.utils.batching import BatchPlan, batch_plan, world_size
from specdistill.utils.checkpoint_io import use_atomic_checkpoints
from specdistill.utils.run_dir import check_checkpoint, is_rank_zero
from specdistill.utils.strategy import check_devices

log = logging.getLogger(__name__)

# -- models ---------------------------------------------------------------------------------------------------------


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
                spec.pretrained_model_name_or_path, spec.revision, spec.trust_remote_code, spec.gguf_file
            )
    check_same_tokenizer(tokenizers)
    return tokenizer


def draft_kind(cfg: DictConfig, init: str | None = None) -> DraftKind:
    """The run's draft kind, `cfg.draft` (`draft=<kind>`: conf/draft/<kind>.yaml), continuing from the export `init`
    when one is given (`<stage>.init`; `DraftKind.continued_from`).

    With no kind chosen (the default, so every existing config composes as before) the draft is `Standalone`, the
    pair's `models.draft`, exactly what `draft=standalone` builds.
    """
    node = cfg.get("draft")
    kind = Standalone(model_spec(cfg.models.draft)) if node is None else instantiate(node)
    return kind if init is None else kind.continued_from(init)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def brings_tokenizer(spec: ModelSpec) -> bool:
    """Whether `spec` has a tokenizer of its own to check against the pair's: every model but a head on the target's
    states saved without one (a SpecForge EAGLE-3 checkpoint): it drafts the target's ids, and its vocabulary size is
    checked against the target's when it loads (`specdistill.drafts.eagle3.check_head_fits_target`)."""
    if not spec.is_pretrained or spec.gguf_file is not None:
        return True
    folder = Path(spec.pretrained_model_name_or_path).expanduser()
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return True
    return not exported_kind(folder).reads_target


def _check_placement(specs: Mapping[str, ModelSpec], placed_roles: tuple[str, ...]) -> None:
    for role, spec in specs.items():
        if spec.device_map is not None and role not in placed_roles:
            raise ValueError(
                f"the {role} has a device_map, which only rollout and evaluate use (for their frozen target). "
                "Training stages place their models with the Trainer's strategy: drop the device_map and use "
                "trainer=deepspeed_zero3 for a target larger than one GPU."
            )


def _load_checked(role: str, spec: ModelSpec, vocab_size: int) -> PreTrainedModel:
    model = load_model(spec, vocab_size=vocab_size)
    check_model_covers_vocab(role, model, vocab_size)
    return model


def load_models(
    cfg: DictConfig,
    specs: dict[str, ModelSpec],
    trainable: tuple[str, ...] = (),
    placed_roles: tuple[str, ...] = (),
    drafts: Mapping[str, DraftKind] | None = None,
) -> tuple[PreTrainedTokenizerBase, dict[str, nn.Module], int]:
    """Load the tokenizer and each model once; return `(tokenizer, models, real_vocab_size)`.

    The roles named in `trainable` load in float32 (fp32 master weights; bfloat16 only under `pure_bf16=true`),
    whatever their spec's dtype, which is the dtype of the frozen roles (specdistill/models/precision.py). Only the
    roles in `placed_roles` may carry a `device_map` (frozen models of stages that place them themselves).
    `drafts` (role -> `DraftKind`) are the trained drafts: each is built by its kind (`DraftKind.build`, fp32 master
    weights) after the models of `specs`, from the target among them (`specs["target"]`) when there is one.
    """
    drafts = drafts or {}
    sources = dict(specs)
    for role, kind in drafts.items():
        sources.update(kind.specs(role))
    _check_placement(sources, placed_roles)
    tokenizer = shared_tokenizer(cfg, sources)
    vocab_size = len(tokenizer)
    pure_bf16 = bool(cfg.get("pure_bf16", False))
    models: dict[str, nn.Module] = {}
    for role, spec in specs.items():
        if role in trainable:
            spec = trainable_spec(spec, pure_bf16=pure_bf16)
        models[role] = _load_checked(role, spec, vocab_size)
    for role, kind in drafts.items():
        models[role] = kind.build(models.get("target"), vocab_size, pure_bf16=pure_bf16)
    return tokenizer, models, vocab_size


def named_drafts(cfg: DictConfig, paths: DictConfig | None) -> dict[str, ModelSpec]:
    """`paths` (draft name -> export directory) as model specs, or the pair's draft (`draft`) when none is given.

    `load_draft` loads each through the draft kind its export records (`load_exported_drafts`)."""
    if not paths:
        return {"draft": model_spec(cfg.models.draft)}
    dtype = cfg.models.draft.get("dtype", "float32")
    return {name: ModelSpec(pretrained_model_name_or_path=path, dtype=dtype) for name, path in paths.items()}


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU; any other value is a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_exported_drafts(
    cfg: DictConfig, drafts: Mapping[str, ModelSpec]
) -> tuple[PreTrainedTokenizerBase, dict[str, LoadedDraft], int]:
    """`(tokenizer, drafts, vocab_size)`: each draft export (see `named_drafts`) loaded through the kind it records
    (`specdistill.drafts.load_draft`), after the same tokenizer checks as every other stage."""
    _check_placement(drafts, ())
    tokenizer = shared_tokenizer(cfg, dict(drafts))
    vocab_size = len(tokenizer)
    return tokenizer, {name: load_draft(spec, vocab_size) for name, spec in drafts.items()}, vocab_size


def load_frozen_target_and_drafts(
    cfg: DictConfig, drafts: Mapping[str, ModelSpec], device: torch.device
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, dict[str, LoadedDraft], int]:
    """For stages without training (rollout, evaluate): `(tokenizer, target, drafts, vocab_size)`, all frozen on
    `device` (a target loaded with `models.target.device_map` stays where it was placed), after the same tokenizer
    checks as every other stage. Each draft export (see `named_drafts`) loads through the kind it records."""
    specs = {"target": model_spec(cfg.models.target), **drafts}
    _check_placement(specs, ("target",))
    tokenizer = shared_tokenizer(cfg, {name: spec for name, spec in specs.items() if brings_tokenizer(spec)})
    vocab_size = len(tokenizer)
    target = _load_checked("target", specs.pop("target"), vocab_size)
    loaded = {name: load_draft(spec, vocab_size, target) for name, spec in specs.items()}
    for model in [target, *(draft.model for draft in loaded.values())]:
        freeze(model)
        if not is_placed_across_devices(model):
            model.to(device)
    return tokenizer, target, loaded, vocab_size


# -- data -----------------------------------------------------------------------------------------------------------


def build_datamodule(
    cfg: DictConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    batch_size: int = 1,
    eval_batch_size: int | None = None,
    accumulate_grad_batches: int = 1,
    task: Any = None,
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
    return build_datamodule(
        cfg,
        tokenizer,
        max_length=settings.max_length,
        batch_size=plan.micro_batch_size,
        eval_batch_size=settings.eval_batch_size,
        accumulate_grad_batches=plan.accumulate_grad_batches,
    )


# -- trainer --------------------------------------------------------------------------------------------------------


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


# -- outputs --------------------------------------------------------------------------------------------------------


def export_trained(
    trainer: L.Trainer,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    metadata: dict[str, Any],
    kind: DraftKind | None = None,
) -> Path:
    """Write the export of a trained model (gathering ZeRO-3 shards first; rank 0 writes) and, when the logger is
    W&B with `log_model`, upload it as an artifact. A draft exports through its `kind` (`DraftKind.export`, which
    records the kind); other models (sft's target) as Hugging Face models."""

    def write(out: Path) -> object:
        if kind is not None:
            return kind.export(model, tokenizer, out, metadata)
        return export_pretrained(model, tokenizer, out, metadata)

    return publish_export(trainer, model, out_dir, write, metadata)


def stage_logger(cfg: DictConfig, out_dir: Path):
    """The configured logger, for stages without a Trainer (W&B gets the report table and plots)."""
    return instantiate(cfg.logger, save_dir=str(out_dir)) if cfg.get("logger") else None


def logged_metrics(trainer: L.Trainer, names: list[str]) -> dict[str, float]:
    metrics = trainer.callback_metrics
    return {name: float(metrics[name]) for name in names if name in metrics}


def write_result(out_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write `result.json` and end the stage on the console with `format_result` (rank 0)."""
    atomic_write_text(out_dir / "result.json", json.dumps(result, indent=2, default=str))
    if is_rank_zero():
        print(format_result(out_dir, result), flush=True)
    return result


def format_result(out_dir: Path, result: dict[str, Any]) -> str:
    """A stage's last console block: its folder, then one `name  value` line per metric and output path.

    Numbers print with 4 decimals, a mapping (e.g. `heads: {draft: path}`) one line per entry (`heads/draft`);
    multi-line text (evaluate's table, printed already) and the stage name (the header) are left out.
    """
    rows = []
    for key, value in result.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            name = f"{key}/{sub}" if sub is not None else key
            if isinstance(item, float):
                rows.append((name, f"{item:.4f}"))
            elif isinstance(item, int | str) and not isinstance(item, bool) and "\n" not in str(item):
                rows.append((name, str(item)))
    rows = [(name, text) for name, text in rows if name != "stage"]
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join(
        [f"{result.get('stage', 'stage')} finished: {out_dir}", *(f"  {n:<{width}}  {t}" for n, t in rows)]
    )


def seed_everything(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")
