"""One mechanism for the caches computed once over a dataset: key, compute (each rank its share), merge, load.

A cache is a directory of tables (one `datasets` dataset per table, e.g. per split, under `path/<table>`, with an
`example_id` column) and a key file (`path/<key_file>`, JSON) that records everything the tables depend on: the
digests of the models (`specdistill.caches.digest.weights_digest`), the data's fingerprints and the settings; and,
under `"contents"`, what was written: per table the sha256 of its files, their size and its rows (`table_digest`).
`build_or_reuse(cache)`:

1. key: `cache.key()`; when the stored key equals it, rank 0 verifies the tables (`check_contents`: each table's
   files hash to the recorded sha256, it loads and has the recorded rows) and they are loaded as they are. A table
   changed, truncated or missing since it was written, or a key file without `"contents"` (written before the check
   existed), is recomputed (step 2) with a warning naming the folder and what was wrong.
2. compute: otherwise every rank of the running process group computes its share of each table
   (`cache.compute(name, rank, world_size)`, table after table; `specdistill.utils.distributed.batches_of_rank` keeps the ranks in step).
3. merge: each rank writes its part under `path/.rank_parts/`; after a barrier rank 0 merges them into one table
   per name (`example_id` order, one row per example, refusing a lost one), removes the parts, hashes the tables
   and writes the key with their digests last, so that a key only ever vouches for complete tables. Each table and
   the key are written beside their place and renamed into it (`specdistill.utils.atomic`): a killed job or a full
   disk leaves no half-written one.
4. load: after a barrier every rank opens the same tables.

A stale cache (its key differs: another model, dataset or setting) is recomputed into the same directory, not
refused: the key file says what the tables were built from, and a run that changed its models expects new values.
A cache opened by path only, without the models to recompute it (`CachedTarget.load`, `load_hidden_cache`), is
verified the same way (`load_checked`) and refused with a one-line `InputFileError` when the check fails.

Cost of the check: one read of the tables' files through sha256 (0.8-1.9 s for a 0.78 GB table in the target-state
cache's format on a shared 2-core machine, docs/ARCHITECTURE.md "Caches are verified on reuse"), on rank 0 only (the
verdict is broadcast), once per reuse: a provider is prepared once per run and its DataLoader workers read the
opened tables. Writing a cache reads its tables back once more to hash them.

A `resumable` cache (many tables, e.g. the hidden-state cache's shards) resumes an interrupted build: rank 0 records
the key it is building in `path/.building_<key_file>` before any table is written, each table is saved atomically
(a temporary directory renamed into place), and a later build with that same key keeps the finished tables that
still load with their rows and computes only the others. A build with another key removes this cache's tables first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from specdistill.errors import InputFileError
from specdistill.utils.atomic import atomic_directory, atomic_write_text
from specdistill.utils.distributed import rank_and_world_size

log = logging.getLogger(__name__)

PARTS_DIR = ".rank_parts"
BUILDING_PREFIX = ".building_"  # + key_file: the key of a resumable build under way
CONTENTS = "contents"  # the key file's record of what was written: table -> {"sha256", "bytes", "rows"}
READ_CHUNK = 8 << 20  # bytes read and hashed at a time
HASH_THREADS = 8  # files of a table hashed at once
# a `datasets` table's state: its fingerprint and format hints differ between equal tables
STATE_FILE = "state.json"
# what loading a damaged table raises: pyarrow's OSError / ArrowInvalid, a bad state.json's ValueError or KeyError
_UNREADABLE = (OSError, ValueError, KeyError, pa.ArrowException)


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


class CacheContentsError(Exception):
    """A cache's tables are not what its key file recorded (changed, truncated, missing or unreadable), or the key
    file records no contents (written before they were checked); the message names the folder, what was expected
    and what was found, without the fix (the caller's: recompute, or refuse with `InputFileError`)."""


def read_key(path: str | Path, key_file: str) -> dict[str, Any] | None:
    """The key stored in `path/key_file`; None when there is none (no cache, or one whose build did not finish).

    Raises:
        InputFileError: the key file is not JSON (damaged after it was written).
    """
    try:
        return _parsed_key(Path(path) / key_file)
    except CacheContentsError as error:
        raise InputFileError(f"{error}; delete {Path(path)} and let the run rebuild the cache") from error


def _parsed_key(file: Path) -> dict[str, Any] | None:
    """The JSON object in `file` (None when there is no such file); `CacheContentsError` when it is not one."""
    if not file.is_file():
        return None
    try:
        key = json.loads(file.read_text())
    except (ValueError, OSError) as error:
        raise CacheContentsError(
            f"{file} is not a readable cache key ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(key, dict):
        raise CacheContentsError(
            f"{file} is not a readable cache key (a JSON {type(key).__name__}, not an object)"
        )
    return key


def inputs_of(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored key without its `"contents"`: what the tables depend on, to compare with `SharedPass.key()`."""
    return {name: value for name, value in stored.items() if name != CONTENTS}


def load_tables(path: str | Path, names: list[str]) -> dict[str, datasets.Dataset]:
    return {name: datasets.load_from_disk(str(Path(path) / name)) for name in names}


def table_digest(folder: Path) -> tuple[str, int]:
    """sha256 of a table's files and their total size in bytes.

    Each file under `folder` is hashed on its own (`file_digest`; up to `HASH_THREADS` at once: hashlib releases
    the GIL, so a table of many shards is hashed at the speed of several cores or of the disk), and the table's
    digest is the sha256 of the files' relative paths, sizes and digests in path order. `state.json` counts by its
    `_data_files` only, not in the size: its fingerprint and format hints differ between equal tables (one merged
    from rank parts); a damaged one fails to load or gives other rows (`check_contents` checks both).
    """
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    names = [file.relative_to(folder).as_posix() for file in files]
    data_files = [file for file, name in zip(files, names, strict=True) if name != STATE_FILE]
    threads = max(1, min(len(data_files), os.cpu_count() or 1, HASH_THREADS))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        hashed = dict(zip(data_files, pool.map(file_digest, data_files), strict=True))
    digest, total = hashlib.sha256(), 0
    for file, name in zip(files, names, strict=True):
        if name == STATE_FILE:
            state = _state_bytes(file)
            size, sha256 = len(state), hashlib.sha256(state).hexdigest()
        else:
            size, sha256 = file.stat().st_size, hashed[file]
            total += size
        digest.update(f"{name}\0{size}\0{sha256}\n".encode())
    return digest.hexdigest(), total


def file_digest(file: Path) -> str:
    """sha256 of a file's bytes, read in `READ_CHUNK` pieces."""
    digest, buffer = hashlib.sha256(), bytearray(READ_CHUNK)
    with file.open("rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(memoryview(buffer)[:read])
    return digest.hexdigest()


def _state_bytes(file: Path) -> bytes:
    """What a table's `state.json` says about its rows: its `_data_files` (which arrow files, in which order) as
    canonical JSON; its raw bytes when it is not such JSON."""
    raw = file.read_bytes()
    try:
        state = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(state, dict):
        return raw
    return json.dumps(state.get("_data_files"), sort_keys=True).encode()


def record_contents(path: Path, sizes: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """What the complete tables hold, for the key file's `"contents"`: per table its sha256, bytes and rows."""
    contents = {}
    for name, rows in sizes.items():
        sha256, size = table_digest(path / name)
        contents[name] = {"sha256": sha256, "bytes": size, "rows": int(rows)}
    return contents


def check_contents(
    path: Path, key_file: str, stored: Mapping[str, Any], names: list[str]
) -> dict[str, datasets.Dataset]:
    """The tables `names` of the cache at `path`, loaded once each matches what `stored` (its key file) records.

    Raises:
        CacheContentsError: a table is missing, changed, truncated, unreadable or has other rows, or the key file
            records no contents.
    """
    contents = stored.get(CONTENTS)
    if not isinstance(contents, dict):
        raise CacheContentsError(
            f"{path / key_file} records no digest of the tables' contents (written by a specdistill that did not "
            "check them), so the tables cannot be verified"
        )
    return {name: _checked_table(path / name, contents.get(name), path / key_file) for name in names}


def _checked_table(folder: Path, record: Any, key_path: Path) -> datasets.Dataset:
    """The table in `folder`, loaded after checking its files against `record` (`{"sha256", "bytes", "rows"}`)."""
    if not isinstance(record, dict) or not {"sha256", "bytes", "rows"} <= record.keys():
        raise CacheContentsError(f"{key_path} records no digest of the table {folder}")
    if not folder.is_dir():
        raise CacheContentsError(f"the table {folder} is missing ({record['rows']} rows were written)")
    sha256, size = table_digest(folder)
    if size != record["bytes"]:
        raise CacheContentsError(
            f"the table {folder} holds {size} bytes but {record['bytes']} were written (truncated or changed on disk)"
        )
    if sha256 != record["sha256"]:
        raise CacheContentsError(
            f"the table {folder} changed on disk since it was written (its files hash to sha256 {sha256[:16]}..., "
            f"{record['sha256'][:16]}... was recorded)"
        )
    table = _loaded(folder)
    if len(table) != record["rows"]:
        raise CacheContentsError(f"the table {folder} holds {len(table)} rows, {record['rows']} were written")
    return table


def _loaded(folder: Path) -> datasets.Dataset:
    """`datasets.load_from_disk(folder)`; a damaged table raises `CacheContentsError` naming it."""
    try:
        return datasets.load_from_disk(str(folder))
    except _UNREADABLE as error:
        detail = (str(error).splitlines() or [type(error).__name__])[0]
        raise CacheContentsError(
            f"the table {folder} cannot be read ({type(error).__name__}: {detail})"
        ) from error


def load_checked(
    path: str | Path, key_file: str, stored: Mapping[str, Any], names: list[str], fix: str
) -> dict[str, datasets.Dataset]:
    """`check_contents` for a cache opened by path only, without the models to recompute it.

    Raises:
        InputFileError: one line: the folder, what was expected and found (`CacheContentsError`), then `fix`.
    """
    try:
        return check_contents(Path(path), key_file, stored, names)
    except CacheContentsError as error:
        raise InputFileError(f"{error}; {fix}") from error


def build_or_reuse(
    cache: SharedPass, reuse: bool = True
) -> tuple[dict[str, Any], dict[str, datasets.Dataset]]:
    """Reuse the cache when its stored key matches (and `reuse`) and its tables are intact, else compute it with
    every rank; see module doc.

    Returns:
        `(key, tables)`: the key and the complete tables, the same on every rank.
    """
    path = Path(cache.path)
    key = cache.key()
    sizes = cache.sizes()
    if reuse:
        tables = _reused(cache, key, list(sizes))
        if tables is not None:
            return key, tables
    rank, world_size = rank_and_world_size()
    building = path / f"{BUILDING_PREFIX}{cache.key_file}"
    if rank == 0:
        # the key marks a complete cache: an older one must not vouch for a half-rebuilt cache
        (path / cache.key_file).unlink(missing_ok=True)
        shutil.rmtree(path / PARTS_DIR, ignore_errors=True)  # parts of an interrupted pass
        if cache.resumable:
            _start_resumable(cache, key, sizes, reuse)
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
        stored = {**key, CONTENTS: record_contents(path, sizes)}
        atomic_write_text(path / cache.key_file, json.dumps(stored, indent=1))
        building.unlink(missing_ok=True)
    if world_size > 1:
        torch.distributed.barrier()  # rank 0 has written the one cache
    return key, load_tables(path, list(sizes))


def _reused(cache: SharedPass, key: dict[str, Any], names: list[str]) -> dict[str, datasets.Dataset] | None:
    """The cache's tables when it holds `key` and rank 0 verified them (`check_contents`); None when it must be
    computed: another key or none (stale), or tables that failed the check (a warning names the folder and why)."""
    path = Path(cache.path)
    rank, world_size = rank_and_world_size()
    tables, problem = _verified(cache, key, names) if rank == 0 else (None, None)
    verdict = (tables is not None, problem)
    if world_size > 1:  # one rank reads and hashes the tables; the others follow its verdict
        box = [verdict]
        torch.distributed.broadcast_object_list(box, src=0)
        verdict = box[0]
    intact, problem = verdict
    if problem is not None:
        log.warning("recomputing the cache in %s: %s", path, problem)
    if not intact:
        return None
    log.info("reusing the cache in %s (same models, data and settings; contents verified)", path)
    return tables if tables is not None else load_tables(path, names)


def _verified(
    cache: SharedPass, key: dict[str, Any], names: list[str]
) -> tuple[dict[str, datasets.Dataset] | None, str | None]:
    """`(tables, None)` for an intact cache of `key`; `(None, problem)` for one of `key` that failed the check (or
    whose key file is unreadable); `(None, None)` for a cache of another key, or none."""
    path = Path(cache.path)
    try:
        stored = _parsed_key(path / cache.key_file)
    except CacheContentsError as error:
        return None, str(error)
    if stored is None or inputs_of(stored) != key:
        return None, None
    try:
        return check_contents(path, cache.key_file, stored, names), None
    except CacheContentsError as error:
        return None, str(error)


def _start_resumable(cache: SharedPass, key: dict[str, Any], sizes: Mapping[str, int], reuse: bool) -> None:
    """Rank 0, before a resumable build: keep the finished tables of an interrupted build of this same key that
    still load with their rows (removing the others), or remove every table of another key and record this one."""
    path = Path(cache.path)
    building = path / f"{BUILDING_PREFIX}{cache.key_file}"
    try:
        same = reuse and (marker := _parsed_key(building)) is not None and inputs_of(marker) == key
    except CacheContentsError:
        same = False
    # tables of another key, or damaged ones, must not pass for finished ones
    for name, rows in sizes.items():
        if not (same and _loads_with_rows(path / name, rows)):
            shutil.rmtree(path / name, ignore_errors=True)
    if not same:
        path.mkdir(parents=True, exist_ok=True)
        building.write_text(json.dumps(key, indent=1))


def _loads_with_rows(folder: Path, rows: int) -> bool:
    """Whether the finished table in `folder` opens and holds `rows` rows (False when there is none)."""
    if not folder.is_dir():
        return False
    try:
        return len(_loaded(folder)) == rows
    except CacheContentsError as error:
        log.warning("recomputing %s of an interrupted build: %s", folder, error)
        return False


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
