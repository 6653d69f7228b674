"""Rollout storage: a `datasets` dataset on disk, written in shards so an interrupted run resumes where it stopped.

Layout of `out_dir`:

    rollout_config.json        settings the rollouts were made with (checked again on resume)
    shards/shard_00000/        one `Dataset.save_to_disk` per shard of `shard_size` prompts
    shards/shard_00001/ ...

A shard is written to a temporary directory, synced and renamed into place (`specdistill.utils.atomic`), so a shard
directory exists only once it is complete; leftovers of an interrupted write are removed on resume. Several ranks share one directory
(`specdistill.rollout.ranks`): each writes only its own shards, and loading the directory after all of them are done
is the one merge (it refuses a missing shard or a lost or duplicated example).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import datasets

from specdistill.utils.atomic import TMP_MARK, atomic_directory
from specdistill.utils.records import differences_from_record

SETTINGS_NAME = "rollout_config.json"
SHARDS_DIR = "shards"
_TMP_PREFIX = ".tmp_"  # leftovers of writers before specdistill.utils.atomic


def shard_path(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / SHARDS_DIR / f"shard_{index:05d}"


def num_shards(num_examples: int, shard_size: int) -> int:
    return math.ceil(num_examples / shard_size)


def prepare_out_dir(out_dir: str | Path, settings: dict[str, Any], write: bool = True) -> list[int]:
    """Create `out_dir` or check it was started with the same settings; return the indices of finished shards.

    With several ranks every rank checks (so all of them raise alike), and only one, `write=True`, creates the
    directory and removes the leftovers of interrupted writes, before any rank starts writing shards.

    Raises:
        ValueError: if `out_dir` holds rollouts made with other settings (resuming would mix two datasets).
    """
    out_dir = Path(out_dir)
    changed = differences_from_record(out_dir / SETTINGS_NAME, settings, write)
    if changed:
        raise ValueError(
            f"{out_dir} holds rollouts made with other settings (differing: {', '.join(changed)}). "
            "Use a new output directory, or delete this one to start over."
        )
    shards = out_dir / SHARDS_DIR
    if write:
        shards.mkdir(exist_ok=True)
        for leftover in [*shards.glob(f"{_TMP_PREFIX}*"), *shards.glob(f"*{TMP_MARK}*")]:
            shutil.rmtree(leftover)
    expected = num_shards(settings["num_prompts"], settings["shard_size"])
    return [i for i in range(expected) if shard_path(out_dir, i).is_dir()]


def write_shard(
    out_dir: str | Path, index: int, columns: dict[str, list], features: datasets.Features
) -> Path:
    """Save one shard atomically (temporary directory, synced, then renamed into place)."""
    final = shard_path(out_dir, index)
    with atomic_directory(final) as tmp:
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
    return final


def read_settings(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / SETTINGS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"No rollouts at {out_dir}: {SETTINGS_NAME} is missing (run the rollout stage first)."
        )
    return json.loads(path.read_text())


def load_shards(out_dir: str | Path, allow_incomplete: bool = False) -> datasets.Dataset:
    """Concatenate the shards in order, checking that none is missing (unless `allow_incomplete`)."""
    settings = read_settings(out_dir)
    expected = num_shards(settings["num_prompts"], settings["shard_size"])
    present = [i for i in range(expected) if shard_path(out_dir, i).is_dir()]
    if not allow_incomplete and len(present) != expected:
        missing = sorted(set(range(expected)) - set(present))
        raise ValueError(
            f"{out_dir} is incomplete: {len(missing)} of {expected} shards missing (first: {missing[0]}). "
            "Run the same rollout command again to resume."
        )
    if not present:
        raise ValueError(f"{out_dir} holds no finished shard yet.")
    parts = [datasets.load_from_disk(str(shard_path(out_dir, i))) for i in present]
    dataset = datasets.concatenate_datasets(parts)
    if not allow_incomplete and list(dataset.with_format(None)["prompt_index"]) != list(
        range(settings["num_prompts"])
    ):
        raise ValueError(
            f"{out_dir} is corrupt: prompt_index is not 0..{settings['num_prompts'] - 1} in order."
        )
    return dataset
