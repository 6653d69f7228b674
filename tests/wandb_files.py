"""Read back what an offline W&B run wrote into its `.wandb` file (history, config, summary, run info), for tests.

wandb ships no Python reader for run files (its Go core writes and syncs them), so this parses the on-disk format:
LevelDB-log framing of `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version
_RECORD = struct.Struct("<IHB")  # crc32c, length, type (LevelDB log format)
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class NotARunFile(Exception):
    """The file does not start with a W&B run file's header (waiting will not mend it)."""


def _records(data: bytes) -> Iterable[bytes]:
    """Payloads of a `.wandb` file: a 7-byte header, then LevelDB-log records in 32 KiB blocks."""
    ident, magic, version = _HEADER.unpack_from(data.ljust(_HEADER.size, b"\0"), 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise NotARunFile(
            "not a W&B run file (bad header); pass the run's run-<id>.wandb file or its directory"
        )
    pos, pending = _HEADER.size, b""
    while pos + _RECORD.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD.size:  # block trailer padding
            pos += left
            continue
        _, length, kind = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left - _RECORD.size - length
        else:
            raise ValueError(f"corrupt W&B run file: record type {kind} at byte {pos}")


def _item_value(item: Any) -> Any:
    """A history value: typed (`oneof value`) in recent wandb cores, JSON text in older ones."""
    which = item.WhichOneof("value")
    if which is None or which == "value_json":
        return json.loads(item.value_json) if item.value_json else None
    if which == "json":
        return json.loads(item.json)
    if which == "none":
        return None
    return getattr(item, which)


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_offline_run(path: str | Path, timeout: float = 60.0) -> dict[str, Any]:
    """Read back what an (offline) run recorded, once its file holds the run's final (`exit`) record.

    Returns:
        `{"history": [row, ...], "config": {...}, "summary": {...}, "run": {"id", "project", "group", "name",
        "tags"}, "artifacts": [{"name", "type", "metadata"}, ...]}` (artifacts as logged, before any upload).

    wandb 0.31 ships no Python reader for run files (its Go core writes and syncs them), so this parses the
    documented on-disk format: LevelDB-log framing of `wandb_internal_pb2.Record` protobufs.

    Args:
        path: a `run-<id>.wandb` file, or the run directory holding one (`<save_dir>/wandb/offline-run-*`).
        timeout: seconds to wait for the `exit` record. `run.finish()` returns before wandb's core has always
            flushed the file (seen on a loaded 2-core machine: a file without its `run` record), so the reader
            waits for the last record rather than reading whatever is on disk.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if len(files) != 1:
            raise FileNotFoundError(f"expected one run-*.wandb file in {path}, found {len(files)}")
        path = files[0]
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes()
        try:
            payloads = _parsed(data)
        except ValueError:  # a record still being written
            payloads = []
        except NotARunFile:
            if len(data) >= _HEADER.size:
                raise
            payloads = []  # the header is not written yet
        if any(kind == "exit" for kind, _ in payloads):
            return _collect(payloads)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} holds no exit record after {timeout:.0f} s: the run did not finish")
        time.sleep(0.2)


def _parsed(data: bytes) -> list[tuple[str, Any]]:
    """`(record kind, record)` for every record of a `.wandb` file's bytes."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    parsed = []
    for payload in _records(data):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as err:
            raise ValueError(f"a W&B record that does not parse: {err}") from err
        parsed.append((record.WhichOneof("record_type"), record))
    return parsed


def _collect(payloads: list[tuple[str, Any]]) -> dict[str, Any]:
    """The history, config, summary, run info and artifacts of parsed records."""
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    run: dict[str, Any] = {}
    artifacts: list[dict[str, Any]] = []
    for kind, record in payloads:
        if kind == "history":
            history.append({_item_key(i): _item_value(i) for i in record.history.item})
        if kind == "run":
            info = record.run
            run = {
                "id": info.run_id,
                "project": info.project,
                "group": info.run_group,
                "name": info.display_name,
                "tags": list(info.tags),
            }
        if kind == "artifact":
            info = record.artifact
            artifacts.append(
                {"name": info.name, "type": info.type, "metadata": json.loads(info.metadata or "{}")}
            )
        if kind in ("config", "run"):
            items = record.config.update if kind == "config" else record.run.config.update
            config.update({_item_key(i): json.loads(i.value_json) for i in items})
        elif kind == "summary":
            summary.update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
    return {"history": history, "config": config, "summary": summary, "run": run, "artifacts": artifacts}
