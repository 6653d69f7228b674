"""Settings records: the JSON file a resumable output keeps beside its parts (rollout shards, answer shards), so that a
relaunch adds parts only to an output made with the same settings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdistill.utils.atomic import atomic_write_text


def differences_from_record(path: str | Path, settings: Mapping[str, Any], write: bool = True) -> list[str]:
    """The keys whose value in the record at `path` differs from `settings` (sorted; none when they match). With no
    record there yet, `settings` becomes it (written whole, its folder created, when `write`) and none differ."""
    path = Path(path)
    if path.is_file():
        previous = json.loads(path.read_text())
        return sorted(k for k in settings.keys() | previous.keys() if settings.get(k) != previous.get(k))
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return []
