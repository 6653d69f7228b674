"""Export a trained SpecDec++ acceptance head (`head_config.json` + `model.safetensors`) like every other model:
rank 0 writes it, then it goes up to W&B with `logger.log_model=true` (`specdistill.export.publish`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from torch import nn

from specdistill.export.publish import publish_export
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.models.draft_identity import describe_draft


def export_head(
    trainer: L.Trainer,
    head: AcceptanceHead,
    out_dir: Path,
    draft: nn.Module,
    source: str | None,
    metadata: Mapping[str, Any],
) -> Path:
    """Save `head` into `out_dir` with the identity of the `draft` it reads (checked again when it is loaded).

    Args:
        trainer: the Trainer that trained the head.
        head: the trained head.
        out_dir: its export directory (`<run_dir>/<draft name>/export`).
        draft: the frozen draft whose hidden states the head reads.
        source: where that draft was loaded from (its export directory or hub id), recorded with it.
        metadata: what the W&B artifact records.
    """
    return publish_export(
        trainer, head, out_dir, lambda out: head.save(out, draft=describe_draft(draft, source)), metadata
    )
