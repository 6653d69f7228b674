"""One mechanism for the caches computed once over a dataset: key, compute (each rank its share), merge, load.

A cache is a directory of tables (one `datasets` dataset per table, e.g. per split, under `path/<table>`, with an
`example_id` column) and a key file (`path/<key_file>`, JSON) that records everything the tables depend on: the
digests of the models (`specdistill.caches.digest.weights_digest`), the data's fingerprints and the settings.
`build_or_reuse(cache)`:

1. key: `cache.key()`; when the stored key equals it the tables are loaded as they are.
2. compute: otherwise every rank of the running process group computes its share of each table
   (`cache.compute(name, rank, world_size)`, table after table; `specdistill.utils.distributed.batches_of_rank` keeps the ranks in step).
3. merge: each rank writes its part under `path/.rank_parts/`; after a barrier rank 0 merges them into one table
   per name (`example_id` order, one row per example, refusing a lost one), removes the parts and writes the key
   last, so that a key only ever vouches for complete tables. Each table and the key are written beside their place
   and renamed into it (`specdistill.utils.atomic`): a killed job or a full disk leaves no half-written one.
4. load: after a barrier every rank opens the same tables.

A stale cache (its key differs: another model, dataset or setting) is recomputed into the same directory, not
refused: the key file says what the tables were built from, and a run that changed its models expects new values.

A `resumable` cache (many tables, e.g. the hidden-state cache's shards) resumes an interrupted build: rank 0 records
the key it is building in `path/.building_<key_file>` before any table is written, each table is saved atomically
(a temporary directory renamed into place), and a later build with that same key keeps the finished tables and
computes only the others. A build with another key removes this cache's tables first.
"""

from __future__ import annotations

import json
import logging
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from specdistill.utils.atomic import atomic_directory, atomic_write_text
from specdistill.utils.distributed import rank_and_world_size

log = logging.getLogger(__name__)

PARTS_DIR = ".rank_parts"
BUILDING_PREFIX = ".building_"  # + key_file: the key of a resumable build under way


class SharedPass(ABC):
    """One cache: where it lives, what it depends on, and how a rank computes its share.

    Attributes:
        path: the cache directory.
        key_file: the key file's name inside `path`.
        max_shard_size: arrow shard size of the saved tables (None: the `datasets` default).
        resumable: an interrupted build with the same key keeps its finished tables (see the module doc).
    """

    path: Path
    key_file: str
    max_shard_size: str | None = None
    resumable: bool = False

    @abstractmethod
    def key(self) -> dict[str, Any]:
        """Everything the tables depend on (JSON-able): model digests, data fingerprints, settings."""

    @abstractmethod
    def sizes(self) -> dict[str, int]:
        """Table name -> number of examples (`example_id` 0..n-1 must all be present after the merge)."""

    @abstractmethod
    def compute(self, name: str, rank: int, world_size: int) -> datasets.Dataset:
        """This rank's rows of table `name` (all of them for one rank), with an `example_id` column."""


def read_key(path: str | Path, key_file: str) -> dict[str, Any] | None:
    """The key stored in `path/key_file`; None when there is none (no cache, or one whose build did not finish)."""
    file = Path(path) / key_file
    return json.loads(file.read_text()) if file.is_file() else None


def load_tables(path: str | Path, names: list[str]) -> dict[str, datasets.Dataset]:
    return {name: datasets.load_from_disk(str(Path(path) / name)) for name in names}


def build_or_reuse(
    cache: SharedPass, reuse: bool = True
) -> tuple[dict[str, Any], dict[str, datasets.Dataset]]:
    """Reuse the cache when its stored key matches (and `reuse`), else compute it with every rank; see module doc.

    Returns:
        `(key, tables)`: the key and the complete tables, the same on every rank.
    """
    path = Path(cache.path)
    key = cache.key()
    sizes = cache.sizes()
    if reuse and read_key(path, cache.key_file) == key:
        log.info("reusing the cache in %s (same models, data and settings)", path)
        return key, load_tables(path, list(sizes))
    rank, world_size = rank_and_world_size()
    building = path / f"{BUILDING_PREFIX}{cache.key_file}"
    if rank == 0:
        # the key marks a complete cache: an older one must not vouch for a half-rebuilt cache
        (path / cache.key_file).unlink(missing_ok=True)
        shutil.rmtree(path / PARTS_DIR, ignore_errors=True)  # parts of an interrupted pass
        if cache.resumable and not (reuse and read_key(path, building.name) == key):
            for name in sizes:  # tables of another key must not pass for finished ones
                shutil.rmtree(path / name, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
            building.write_text(json.dumps(key, indent=1))
    if world_size > 1:
        torch.distributed.barrier()
    # read by every rank after rank 0 removed stale tables and before any is written: the same set on every rank
    finished = {name for name in sizes if cache.resumable and (path / name).is_dir()}
    if finished:
        log.info("resuming the cache in %s: %d of %d tables are finished", path, len(finished), len(sizes))
    for name, size in sizes.items():
        if name in finished:
            continue
        part = cache.compute(name, rank, world_size)
        if world_size > 1:
            # a rank with no rows of this table writes no part (datasets cannot reload an empty one)
            if len(part):
                part.save_to_disk(str(_part_path(path, name, rank)))
            torch.distributed.barrier()  # every rank's part is written
            if rank == 0:
                written = [_part_path(path, name, r) for r in range(world_size)]
                loaded = [datasets.load_from_disk(str(p)) for p in written if p.is_dir()]
                part = datasets.concatenate_datasets(loaded) if loaded else part
        if rank == 0:
            _save(merged(part, name, size), path / name, cache)
    if rank == 0:
        shutil.rmtree(path / PARTS_DIR, ignore_errors=True)
        atomic_write_text(path / cache.key_file, json.dumps(key, indent=1))
        building.unlink(missing_ok=True)
    if world_size > 1:
        torch.distributed.barrier()  # rank 0 has written the one cache
    return key, load_tables(path, list(sizes))


def _save(table: datasets.Dataset, out: Path, cache: SharedPass) -> None:
    """Save one merged table atomically (a table directory exists only complete: `specdistill/utils/atomic.py`)."""
    with atomic_directory(out) as tmp:
        table.save_to_disk(str(tmp), max_shard_size=cache.max_shard_size)


def _part_path(path: Path, name: str, rank: int) -> Path:
    return path / PARTS_DIR / name / f"rank{rank}"


def merged(dataset: datasets.Dataset, name: str, num_examples: int) -> datasets.Dataset:
    """`dataset` in `example_id` order, one row per example (a sharded dataloader may pad a rank's share with
    repeats: the first copy is kept); raises unless the ids are exactly 0..num_examples-1."""
    ids = np.asarray(dataset["example_id"], dtype=np.int64)
    _, first = np.unique(ids, return_index=True)  # sorted by id, the first copy of each
    dataset = dataset.select(first.tolist())
    if dataset["example_id"] != list(range(num_examples)):
        raise ValueError(
            f"the {name} scoring dataloader must yield every example_id 0..{num_examples - 1}; it yielded "
            f"{len(dataset)} distinct ids"
        )
    return dataset
