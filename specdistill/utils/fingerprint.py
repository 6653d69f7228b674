"""Run fingerprints: what identifies a run, as a hash of its settings (no Lightning, so train.py checks a run folder
before importing the heavy libraries)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.utils.atomic import atomic_write_text

FINGERPRINT_FILE = "run_fingerprint.json"
# written into every checkpoint *directory* (DeepSpeed) after it is saved: DeepSpeed loads its files with
# torch.load(weights_only=False), so its fingerprint must be checked before anything in it is read
CHECKPOINT_SIGNATURE = "specdistill_fingerprint.json"
# What identifies a run: the stage, its settings group (conf/<stage>/) and the groups that shape it (those the stage
# composes: a `stage=sft` config has no `divergence`). Other groups (other stages' settings, where it runs and logs,
# on what hardware) may change between a run and its resume, and so may how long it trains and how it is evaluated
# during training (leaf keys below).
BASE_FINGERPRINT_KEYS = ("seed", "models", "task")
FINGERPRINT_KEYS = (*BASE_FINGERPRINT_KEYS, "divergence", "selector", "sampling")
RESUMABLE_LEAF_KEYS = frozenset(
    {"max_steps", "max_epochs", "val_check_interval", "limit_val_batches", "eval_batch_size", "eval_examples",
     "eval_max_new_tokens"}
)  # fmt: skip


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _drop_leaves(obj: Any, names: frozenset[str]) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_leaves(v, names) for k, v in obj.items() if k not in names}
    if isinstance(obj, list):
        return [_drop_leaves(v, names) for v in obj]
    return obj


def run_fingerprint(
    cfg: DictConfig | Mapping[str, Any],
    stage: str | None = None,
    groups: Iterable[str] | None = None,
    upstream: str | None = None,
) -> dict[str, Any]:
    """What identifies a run: the resolved groups and the stage's settings group (without its `_target_`), minus
    resumable leaves.

    Args:
        cfg: the job config.
        stage: the stage whose settings group (`cfg[stage]`, e.g. `distill`) counts; default `cfg.stage.name`.
        groups: the other groups that count (default `FINGERPRINT_KEYS`, those present in `cfg`).
        upstream: the fingerprint of what this run builds on (the previous pipeline step), folded into its own.

    Returns:
        `{"fingerprint": <hash without resumable leaves>, "settings": <hash of everything>, "models": <hash of the
        models config>, "config": <the config>, "upstream": upstream}`.
    """
    stage = stage or str(OmegaConf.select(cfg, "stage.name", default="") if OmegaConf.is_config(cfg) else "")
    config: dict[str, Any] = {"stage": stage}
    for key in (*(FINGERPRINT_KEYS if groups is None else groups), stage):
        if not key or key not in cfg:
            continue
        node = cfg[key]
        config[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        if key == stage and isinstance(config[key], dict):
            # the settings class that builds the stage's group (specdistill/stages/settings.py) is code, not a
            # setting: left out, the fingerprints of runs made before the group named it stay the same
            config[key].pop("_target_", None)
    identity = _drop_leaves(config, RESUMABLE_LEAF_KEYS)
    return {
        "fingerprint": _digest([identity, upstream] if upstream else identity),
        "settings": _digest([config, upstream]),
        "models": _digest(config.get("models")),
        "config": config,
        "upstream": upstream,
    }


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dictionaries (added and removed keys included)."""
    a, b = _flatten(dict(old)), _flatten(dict(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>"))


def sign_checkpoint_dir(path: str | Path, signature: Mapping[str, Any]) -> None:
    """Write `CHECKPOINT_SIGNATURE` (the run's fingerprint) into a checkpoint directory."""
    atomic_write_text(Path(path) / CHECKPOINT_SIGNATURE, json.dumps(dict(signature), sort_keys=True))
