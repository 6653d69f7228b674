"""Export trained models in Hugging Face format (safetensors), loadable with `from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def export_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (safetensors) and `tokenizer` into `out_dir`; returns the directory.

    `metadata` (stage name, source models, settings) goes to `specdistill.json` beside the weights so that a
    later stage or a user can tell where the export came from.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model.save_pretrained(out, safe_serialization=True)
    model.train(was_training)
    tokenizer.save_pretrained(out)
    if metadata is not None:
        (out / "specdistill.json").write_text(json.dumps(metadata, indent=2, default=str))
    return out
