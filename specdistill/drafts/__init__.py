"""Draft kinds (`DraftKind`): how a draft is built, trained, exported, loaded and decoded with; see `base.py`.

`load_draft(spec)` loads any export by path: it looks up the kind the export names in `draft_kind.json` in the
registry of kinds (`registry.py`; an export is data: nothing it names is imported, called or unpickled) and lets that
kind load it. An export without a record is a head in another trainer's layout that a kind recognises
(`DraftKind.from_layout`, e.g. an EAGLE-3 head saved by SpecForge) or else a standalone causal LM (older exports,
hub models).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from specdistill.drafts.base import (
    KIND_FILE,
    DraftKind,
    DraftStates,
    LoadedDraft,
    TargetPass,
    TrainingRows,
    target_pass,
)
from specdistill.drafts.registry import kind_from_record, known_kinds, register_kind
from specdistill.drafts.standalone.kind import Standalone
from specdistill.errors import InputFileError
from specdistill.models.loading import ModelSpec

__all__ = [
    "KIND_FILE",
    "DraftKind",
    "DraftStates",
    "LoadedDraft",
    "Standalone",
    "TargetPass",
    "TrainingRows",
    "exported_kind",
    "load_draft",
    "register_kind",
    "target_pass",
]


def exported_kind(path: str | Path) -> DraftKind:
    """The draft kind an export records (`<path>/draft_kind.json`); without a record, the kind that recognises the
    folder's layout (`DraftKind.from_layout`), else `Standalone()`.

    Raises:
        InputFileError: the record is not JSON, names no registered kind, or holds settings that are not plain
            values of that kind's settings (`registry.kind_from_record`): it is refused, and nothing in it runs.
    """
    folder = Path(path).expanduser()
    record_path = folder / KIND_FILE
    if not record_path.is_file():
        return recognised_kind(folder)
    try:
        record = json.loads(record_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputFileError(f"{record_path} is not valid JSON ({error}): re-export the draft") from error
    return kind_from_record(record, record_path)


def recognised_kind(folder: Path) -> DraftKind:
    """The kind whose `from_layout` recognises `folder` (an export without our record), else `Standalone()`."""
    if folder.is_dir():
        for cls in known_kinds().values():
            kind = cls.from_layout(folder)
            if kind is not None:
                return kind
    return Standalone()


def load_draft(
    spec: ModelSpec | str | Path, vocab_size: int | None = None, target: nn.Module | None = None
) -> LoadedDraft:
    """Load a draft export (or hub model) through the kind it records.

    Args:
        spec: the export directory, or a `ModelSpec` with it (its dtype, revision, device_map apply).
        vocab_size: the tokenizer's real vocabulary; the draft must cover it.
        target: the loaded frozen target, for kinds whose draft uses part of it (`DraftKind.load`).
    """
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec(pretrained_model_name_or_path=str(spec))
    if not spec.is_pretrained:
        raise ValueError(
            "load_draft loads an export or hub model: the spec needs pretrained_model_name_or_path"
        )
    path = spec.pretrained_model_name_or_path
    kind = exported_kind(path)
    model = kind.load(spec, vocab_size, target)
    return LoadedDraft(kind.loaded_kind(model, target), model, source=path)
