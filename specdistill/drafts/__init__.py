"""Draft kinds (`DraftKind`): how a draft is built, trained, exported, loaded and decoded with; see `base.py`.

`load_draft(spec)` loads any export by path: it builds the kind the export records in `draft_kind.json` (a Hydra node
whose `_target_` is the kind's class) and lets that kind load it; an export without a record (older exports, hub
models) is a standalone causal LM.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
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
from specdistill.drafts.standalone import Standalone
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
    "target_pass",
]


def exported_kind(path: str | Path) -> DraftKind:
    """The draft kind an export records (`<path>/draft_kind.json`); `Standalone()` when it records none.

    Raises:
        InputFileError: the record is not JSON with a `_target_`, names a class that cannot be imported or built,
            or builds something that is not a `DraftKind`.
    """
    record_path = Path(path).expanduser() / KIND_FILE
    if not record_path.is_file():
        return Standalone()
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as error:
        raise InputFileError(f"{record_path} is not valid JSON ({error}): re-export the draft") from error
    if not isinstance(record, dict) or "_target_" not in record:
        raise InputFileError(
            f"{record_path} has no `_target_` (the draft kind's class, e.g. specdistill.drafts.standalone.Standalone): "
            "re-export the draft, or delete the file if the export is a standalone causal LM"
        )
    try:
        kind = instantiate(record)
    except InstantiationException as error:
        raise InputFileError(
            f"the export {path} records the draft kind {record['_target_']!r}, which cannot be built here ({error}). "
            "Use the specdistill version that wrote it, or install the package that defines that kind."
        ) from error
    if not isinstance(kind, DraftKind):
        raise InputFileError(
            f"{record_path} names {record['_target_']!r}, which is not a draft kind (a specdistill.drafts.DraftKind)"
        )
    return kind


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
    return LoadedDraft(kind, kind.load(spec, vocab_size, target), source=path)
