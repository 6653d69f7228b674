"""A split's generated answers written shard by shard, so a relaunched `target_answers` step resumes where it stopped.

Layout of one split's folder (`<run_dir>/answer_shards/<split>/`):

    settings.json        what its shards are generated with; a relaunch with other settings is refused
    shard-00000.jsonl    the answers to the split's prompts 0 .. shard_size - 1 (in the stage's order), ...

A shard is a `specdistill.tasks.answers` file (`{"prompt", "answer"}` lines) written whole or not at all, so a shard
file exists only once all its answers do. Once every shard is there the stage combines them into the one
`answers/<split>.jsonl` that `task.answers_from` reads; the shards stay beside it, out of that folder.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specdistill.errors import ConfigError
from specdistill.tasks.answers import answers_file, read_answers, write_answers
from specdistill.utils.records import differences_from_record

SETTINGS_NAME = "settings.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def open_split(folder: str | Path, settings: Mapping[str, Any], num_shards: int) -> list[int]:
    """Create `folder` with its settings record, or check that the record there matches `settings`; return the
    shards already written.

    Raises:
        ConfigError: the folder holds shards generated with other settings (mixing them would give a split whose
            answers come from two generations), naming the differing keys and the fix.
    """
    folder = Path(folder)
    changed = differences_from_record(folder / SETTINGS_NAME, settings)
    if changed:
        raise ConfigError(
            f"{folder} holds answers generated with other settings (differing: {', '.join(changed)}): relaunch "
            "with the settings it was made with, or delete that folder to generate these answers anew."
        )
    return [i for i in range(num_shards) if answers_file(folder, shard_name(i)).is_file()]


def write_shard(folder: str | Path, index: int, pairs: Iterable[tuple[str, str]]) -> Path:
    """One shard's `(prompt key, answer)` pairs, written whole."""
    return write_answers(folder, shard_name(index), pairs)


def read_shards(folder: str | Path, num_shards: int) -> list[tuple[str, str]]:
    """Every shard's `(prompt key, answer)` pairs, shard after shard."""
    return [pair for i in range(num_shards) for pair in read_answers(folder, shard_name(i)).items()]


def shards_of(items: Sequence[str], shard_size: int) -> list[list[str]]:
    """`items` cut into consecutive shards of `shard_size` (the last one shorter)."""
    return [list(items[start : start + shard_size]) for start in range(0, len(items), shard_size)]
