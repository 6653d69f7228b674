"""Export trained models in Hugging Face format (safetensors), loadable with `from_pretrained`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Give the model's config and generation config the tokenizer's BOS, EOS and pad ids (None where it has none).

    A model built from a config keeps its architecture's defaults (GPT-NeoX: `eos_token_id=2`), which need not be
    the tokenizer's: Hugging Face `generate` and vLLM read these ids to stop, so an export must carry the
    tokenizer's.
    """
    for name in SPECIAL_TOKENS:
        value = getattr(tokenizer, name)
        setattr(model.config, name, value)
        if model.generation_config is not None:
            setattr(model.generation_config, name, value)
    return model


METADATA_FILE = "specdistill.json"


def umask_modes(directory: Path) -> None:
    """Give `directory` and the files under it the modes the user's umask asks for.

    safetensors writes its files with mode 0600 whatever the umask; on a shared cluster colleagues could then not
    read an export.
    """
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (safetensors) and `tokenizer` into `out_dir`; returns the directory.

    The config's special-token ids are the tokenizer's (`align_special_tokens`), and file modes follow the umask.
    `metadata` (stage name, source models, settings) goes to `specdistill.json` beside the weights so that a
    later stage or a user can tell where the export came from.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    align_special_tokens(model, tokenizer)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model.save_pretrained(out, safe_serialization=True)
    model.train(was_training)
    tokenizer.save_pretrained(out)
    write_metadata(out, metadata)
    umask_modes(out)
    return out


def write_metadata(out_dir: Path, metadata: dict[str, Any] | None) -> None:
    """Write `metadata` (where an export came from: stage, source models, settings) to `<out_dir>/specdistill.json`;
    nothing when None."""
    if metadata is not None:
        (Path(out_dir) / METADATA_FILE).write_text(json.dumps(metadata, indent=2, default=str))
