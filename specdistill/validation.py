"""Checks of a composed config that need no model and no data: run by train.py before anything is loaded or written.

Each check raises a `specdistill.errors.UserError` naming the key or file and the fix, so a wrong setting costs a
second, not a model download and a 60-line traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from specdistill.errors import ConfigError, InputFileError
from specdistill.plan_checks import check_plan
from specdistill.stages.settings import (
    RolloutSettings,
    StageSettings,
    TargetAnswersSettings,
    TrainingSettings,
    build_settings,
)

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# a hub id: "name" or "namespace/name"; anything else that does not exist is a mistyped local path
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def validate_config(cfg: DictConfig) -> None:
    """All the checks below, in the order a user would want to hear about them."""
    check_added_keys(cfg)
    for stage in running_stages(cfg):
        check_stage_settings(cfg, stage)
    check_drafts_given(cfg)
    check_reference_given(cfg)
    check_reference_rows(cfg)
    check_target_states(cfg)
    check_packing(cfg)
    check_zero3_kind(cfg)
    for key, path in model_paths(cfg):
        check_model_source(key, path)
    check_gguf_files(cfg)
    for key, path in input_dirs(cfg):
        if not Path(path).expanduser().exists():
            raise InputFileError(
                f"{key}={path}: no such file or directory; pass the folder an earlier run wrote."
            )
    check_plan(cfg, running_stages(cfg))
    check_code_execution(cfg)


def running_stages(cfg: DictConfig) -> list[str]:
    """The stages this launch runs: the pipeline's steps, or the one stage (stage=sequential declares the steps of
    its phases but names none: its phases' own settings are checked when each phase starts)."""
    steps = cfg.pipeline.get("steps") if "pipeline" in cfg else None
    if cfg.stage.get("steps") is not None and steps is not None:
        return [str(s) for s in steps]
    return [str(cfg.stage.name)]


# -- settings -------------------------------------------------------------------------------------------------------


def check_stage_settings(cfg: DictConfig, stage: str) -> None:
    """Build the stage's typed settings (every range check of its group, specdistill/stages/settings.py), then the
    checks that span groups: the rollout's processes vs the target's placement, vLLM vs the models, the trainer."""
    if cfg.get(stage) is None:
        return
    settings = build_settings(cfg, stage)
    if isinstance(settings, RolloutSettings):
        check_ranks(cfg, stage, settings)
    if isinstance(settings, RolloutSettings | TargetAnswersSettings):
        check_vllm_backend(cfg, stage, settings)
    if isinstance(settings, TrainingSettings) and "trainer" in cfg:
        from specdistill.stages.trainer import trainer_config

        trainer = trainer_config(cfg, stage)
        for key in ("max_steps", "max_epochs"):
            if trainer.get(key) == 0:
                raise ConfigError(
                    f"{key}=0 for stage {stage}: it would export an untrained model and report success. Set "
                    f"trainer.{key} (or ++{stage}.trainer.{key}) to a positive number, or -1/null for no limit."
                )


def check_ranks(cfg: DictConfig, stage: str, settings: RolloutSettings | None = None) -> None:
    """One process per node for a target placed across the node's GPUs (the counts and the device type are
    checked by the settings themselves, built here when not given)."""
    if settings is None:
        settings = build_settings(cfg, stage)
    device_map = OmegaConf.select(cfg, "models.target.device_map")
    if device_map is not None and settings.devices > 1:
        raise ConfigError(
            f"models.target.device_map places the target across all GPUs of a node, so {stage}.devices="
            f"{settings.devices} processes per node would each load it there: run one process per node "
            f"({stage}.devices=1, {stage}.num_nodes=<nodes>), or drop the device_map and give each GPU its own "
            "process when the target fits one GPU."
        )


def check_vllm_backend(
    cfg: DictConfig, stage: str, settings: RolloutSettings | TargetAnswersSettings | None = None
) -> None:
    """`<stage>.backend=vllm` (rollout, target_answers) loads a target from disk or the hub, as safetensors, with the
    vLLM of `<stage>.vllm_python`, checked before training starts (the settings are built here when not given: their
    own checks come first)."""
    if settings is None:
        settings = build_settings(cfg, stage)
    if settings.backend != "vllm":
        return
    from specdistill.rollout.vllm_backend import vllm_model, vllm_python

    if str(cfg.stage.name) == stage:  # in a pipeline an earlier step (sft) may export the target it loads
        vllm_model(
            OmegaConf.select(cfg, "models.target.pretrained_model_name_or_path"),
            OmegaConf.select(cfg, "models.target.gguf_file"),
            stage,
        )
    vllm_python(settings.vllm_python, stage)  # vLLM is there before hours of training start


def check_drafts_given(cfg: DictConfig) -> None:
    """A stage run alone with no drafts uses the pair's draft: refuse when that one is only random weights."""
    stage = str(cfg.stage.name)
    settings = cfg.get(stage)
    if settings is None or "drafts" not in settings or settings.drafts:
        return
    draft = cfg.models.get("draft")
    if draft is not None and draft.get("pretrained_model_name_or_path"):
        return
    raise ConfigError(
        f"{stage}.drafts is empty and models.draft is built with random weights: there is no trained draft to "
        f"{stage}. Add +{stage}.drafts.<name>=<run_dir>/export (an export of distill or adaspec), or set "
        "models.draft.pretrained_model_name_or_path=<hub id or directory>."
    )


def filled_by_earlier_steps(cfg: DictConfig, stage: str) -> set[str]:
    """The config keys that pipeline steps before `stage` fill with their outputs (empty outside a pipeline)."""
    if cfg.stage.get("steps") is None or "pipeline" not in cfg:
        return set()
    keys: set[str] = set()
    for name in running_stages(cfg):
        if name == stage:
            break
        for targets in (cfg.stage.steps[name].get("outputs") or {}).values():
            keys.update(str(t) for t in targets)
    return keys


def check_reference_given(cfg: DictConfig) -> None:
    """A stage with a `reference` setting (AdaSPEC's reference model) needs one, or an earlier step that fills it."""
    for stage in running_stages(cfg):
        settings = cfg.get(stage)
        if settings is None or "reference" not in settings or settings.reference:
            continue
        if stage == "adaspec":
            from specdistill.stages.adaspec import configured_reference_source

            source = configured_reference_source(cfg)
            if source is None or not source.loads_reference:
                continue  # no reference read, or the draft's own earlier weights score
        if f"{stage}.reference" in filled_by_earlier_steps(cfg, stage):
            continue
        raise ConfigError(
            f"{stage}.reference is not set: pass the export directory of a `distill` run "
            f"({stage}.reference=<distill_run_dir>/export), or run stage=pipeline with a distill step, which wires it."
        )


def check_reference_rows(cfg: DictConfig) -> None:
    """AdaSPEC on a draft kind with several training rows per answer token (EAGLE-3) scores its reference online:
    refuse `adaspec.cached_scores=true` before the distill step has trained for an hour."""
    if "adaspec" not in running_stages(cfg) or cfg.get("adaspec") is None:
        return
    from specdistill.stages.adaspec import configured_reference_source

    configured_reference_source(cfg)


def check_target_states(cfg: DictConfig) -> None:
    """`<stage>.target_cache` against the draft kind (`TargetSource.check_kind`): a states cache for a kind that
    reads none of the target's states, a top-m cache for one that reads them, refused before anything loads."""
    for stage in ("distill", "adaspec"):
        if stage not in running_stages(cfg) or cfg.get(stage) is None:
            continue
        from specdistill.data.target_source import source_from_setting
        from specdistill.stages.model_loading import draft_kind

        source_from_setting(stage, OmegaConf.select(cfg, f"{stage}.target_cache")).check_kind(draft_kind(cfg))


def check_packing(cfg: DictConfig) -> None:
    """`<stage>.packing=true` for a draft kind that cannot train on packed rows (`DraftKind.packing_refusal`) is
    refused before anything loads."""
    for stage in ("distill", "adaspec"):
        if stage not in running_stages(cfg) or not OmegaConf.select(cfg, f"{stage}.packing", default=False):
            continue
        from specdistill.stages.model_loading import draft_kind

        kind = draft_kind(cfg)
        if kind.packing_refusal:
            raise ConfigError(
                f"{stage}.packing=true with the {type(kind).__name__} draft kind: {kind.packing_refusal}"
            )


def zero3_requested(strategy: object) -> bool:
    """Whether a trainer's `strategy` value (a preset's node or a Lightning registry name) asks for ZeRO-3."""
    if isinstance(strategy, str):
        return "stage_3" in strategy
    return isinstance(strategy, DictConfig) and strategy.get("stage") == 3


def check_zero3_kind(cfg: DictConfig) -> None:
    """A draft kind that cannot train under DeepSpeed ZeRO-3 (`DraftKind.zero3_refusal`) is refused before the
    target loads on every GPU."""
    for stage in ("distill", "adaspec"):
        if stage not in running_stages(cfg) or cfg.get(stage) is None:
            continue
        from specdistill.stages.model_loading import draft_kind
        from specdistill.stages.trainer import trainer_config

        kind = draft_kind(cfg)
        if kind.zero3_refusal and zero3_requested(trainer_config(cfg, stage).get("strategy")):
            raise ConfigError(
                f"{stage} with the {type(kind).__name__} draft kind under DeepSpeed ZeRO-3: {kind.zero3_refusal}"
            )


def check_added_keys(cfg: DictConfig) -> None:
    """Refuse a `+key=value` (or `++`) that adds a setting nothing reads (a misspelt key is otherwise ignored).

    An added key is accepted where adding one means something: under a node built with `_target_` (it becomes an
    argument, and a wrong one fails loudly; a stage's settings accept only their fields), under a `trainer` block or a model `config` (keyword arguments of the
    Lightning Trainer and of the Hugging Face config), in a map that is empty by default (`evaluate.drafts`), or
    when the value is itself an object with `_target_`. The defaults are composed again without the added keys to
    tell which existed.
    """
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return
    lines = list(HydraConfig.get().overrides.task)
    overrides = OverridesParser.create().parse_overrides(lines)
    added = [
        o
        for o in overrides
        if (o.is_add() or o.is_force_add()) and o.package is None and not (CONF_DIR / o.key_or_group).is_dir()
    ]  # fmt: skip  (+experiment=... adds a config group, not a key)
    if not added:
        return
    kept = [line for line, o in zip(lines, overrides, strict=True) if o not in added]
    try:
        baseline = compose(config_name=HydraConfig.get().job.config_name, overrides=kept)
    except Exception as error:  # e.g. a launcher that runs the job without Hydra's global state
        log.warning("could not check the '+' overrides %s (%s)", [o.input_line for o in added], error)
        return
    for override in added:
        key = override.key_or_group
        if OmegaConf.select(baseline, key, default=_ABSENT) is not _ABSENT:
            continue  # ++ on an existing key overrides it
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(baseline, parent_key, default=None) if parent_key else baseline
        value = OmegaConf.select(cfg, key)
        if isinstance(value, DictConfig) and "_target_" in value:
            continue
        fields = settings_fields(parent)
        if fields is not None and name in fields:
            continue  # a field of a stage's settings that its group leaves at the default
        if (
            isinstance(parent, DictConfig)
            and fields is None
            and ("_target_" in parent or parent_key.rpartition(".")[2] in PASSED_WHOLE or len(parent) == 0)
        ):
            continue
        known = fields or ([str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else [])
        hint = difflib.get_close_matches(name, known, n=1)
        where = f"{parent_key}." if parent_key else ""
        raise ConfigError(
            f"{override.input_line}: adds {key!r}, which nothing reads"
            + (f" (did you mean {where}{hint[0]}?)" if hint else "")
            + ". Drop the '+' to override an existing key"
            + (
                f"; {parent_key or 'the top level'} has: {', '.join(known[:15])}"
                if known
                else f"; {parent_key} does not exist"
            )  # fmt: skip
            + "."
        )


def settings_fields(node: object) -> list[str] | None:
    """The fields of the stage settings a node's `_target_` names (the only keys they accept), else None."""
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    try:
        cls = get_class(node._target_)
    except Exception:  # not importable: instantiating the node says so
        return None
    if not (isinstance(cls, type) and issubclass(cls, StageSettings)):
        return None
    return [f.name for f in dataclasses.fields(cls) if f.init]


_ABSENT = object()
# settings handed whole to a library, so any key added there is read: Lightning's Trainer, a model config, vllm.LLM
PASSED_WHOLE = ("trainer", "config", "vllm")


# -- models and files -----------------------------------------------------------------------------------------------


def model_paths(cfg: DictConfig) -> Iterator[tuple[str, str]]:
    """(key, value) of every model a running stage loads by name: the pair's and the drafts' exports."""
    for role, node in (cfg.get("models") or {}).items():
        if isinstance(node, DictConfig) and node.get("pretrained_model_name_or_path"):
            if node.get("gguf_file"):  # one GGUF file there, not a safetensors folder: check_gguf_files
                continue
            yield f"models.{role}.pretrained_model_name_or_path", str(node.pretrained_model_name_or_path)
    for stage in running_stages(cfg):
        settings = cfg.get(stage)
        if settings is None:
            continue
        for name, path in (settings.get("drafts") or {}).items():
            if path:
                yield f"{stage}.drafts.{name}", str(path)
        if settings.get("reference"):
            yield f"{stage}.reference", str(settings.reference)


def check_gguf_files(cfg: DictConfig) -> None:
    """Every local GGUF file a model or the tokenizer loads (`models.<role>.gguf_file`) exists and is GGUF, with the
    `gguf` package installed; a hub repository's file is checked when it is downloaded, at load."""
    from specdistill.models.loading import gguf_path

    for node in (cfg.get("models") or {}).values():
        if (
            isinstance(node, DictConfig)
            and node.get("gguf_file")
            and node.get("pretrained_model_name_or_path")
        ):
            if is_local_path(str(node.pretrained_model_name_or_path)):
                gguf_path(str(node.pretrained_model_name_or_path), str(node.gguf_file))


def input_dirs(cfg: DictConfig) -> Iterator[tuple[str, str]]:
    """(key, value) of the other folders a running stage reads (acceptance heads, rollouts)."""
    for stage in running_stages(cfg):
        settings = cfg.get(stage)
        for group in ("heads", "rollouts"):
            for name, path in ((settings.get(group) if settings is not None else None) or {}).items():
                if path:
                    yield f"{stage}.{group}.{name}", str(path)


def is_local_path(path: str) -> bool:
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists() or not _REPO_ID.match(path)


def check_model_source(key: str, path: str) -> None:
    """A local model folder must hold `config.json` and readable safetensors; a hub id must be reachable.

    Raises:
        InputFileError: naming the folder or file and what to pass instead.
    """
    if is_local_path(path):
        check_model_dir(key, Path(path).expanduser())
    elif _offline() and not _in_hub_cache(path):
        raise InputFileError(
            f"{key}={path}: this hub id is not in the local cache and the hub is offline (HF_HUB_OFFLINE=1). "
            "Download it once with network access, or pass a local directory."
        )


def check_model_dir(key: str, folder: Path) -> None:
    if not folder.is_dir():
        raise InputFileError(
            f"{key}={folder}: no such directory. Pass a hub id (namespace/name) or an existing directory, e.g. "
            "<run_dir>/export of an earlier stage."
        )
    if not (folder / "config.json").is_file():
        raise InputFileError(
            f"{key}={folder}: no config.json there, so it is not a Hugging Face model folder. Pass the export "
            "directory of an earlier stage (<run_dir>/export) or a folder written by save_pretrained."
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise InputFileError(
            f"{key}={folder}: no *.safetensors weights (specdistill loads safetensors only). Re-export the model, "
            "or convert it with save_pretrained(safe_serialization=True)."
        )
    for file in weights:
        check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Open `file`'s header and check that its tensors fit in the file (a truncated copy does not)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        raise InputFileError(
            f"{file} is not a readable safetensors file ({error}); it was probably cut short while copying or "
            "writing. Copy or export it again."
        ) from error


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


# -- generated code -------------------------------------------------------------------------------------------------


def check_code_execution(cfg: DictConfig) -> None:
    """With `task.execute_code=true`, the sandbox it asks for must be available here (checked before loading)."""
    task = cfg.get("task")
    if task is None or not task.get("execute_code"):
        return
    from specdistill.tasks.code_execution import check_sandbox

    check_sandbox(task.get("sandbox", "namespaces"))
