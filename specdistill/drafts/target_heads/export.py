"""Exporting a head on the target's hidden states: its checkpoint (weights, config, tokenizer), the target it drafts
for, named as its verifier, and the fields of a vLLM `speculators` checkpoint that do not depend on the head.

A head is exported without the target's weights it uses (an EAGLE-3 head's embeddings): a loader takes them from the
verifier. `specdistill.drafts.eagle3` writes its two layouts (vLLM's and SGLang's, and `speculators`) through these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout `speculators_record` writes


def write_checkpoint(
    out_dir: Path, state: Mapping[str, torch.Tensor], config: Mapping[str, Any], tokenizer: Any = None
) -> Path:
    """Write `state` to `<out_dir>/model.safetensors` (contiguous, on the CPU), `config` to `config.json` and the
    tokenizer, when given, into `out_dir` (created); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def verifier_of(target: torch.nn.Module) -> tuple[str | None, list[str]]:
    """`(verifier, verifier_architectures)` of the loaded target, what an export names as the model it drafts for:
    the hub id or directory transformers' `from_pretrained` loaded it from (its `name_or_path`; a local directory
    made absolute, so that the export names it from anywhere), None for a target built from a config; its config's
    `architectures`."""
    name = getattr(target, "name_or_path", None) or getattr(
        getattr(target, "config", None), "_name_or_path", None
    )
    if name:
        local = Path(name).expanduser()
        name = str(local.resolve()) if local.exists() else str(name)
    architectures = getattr(getattr(target, "config", None), "architectures", None) or []
    return name or None, list(architectures)


def speculators_record(
    model_type: str,
    architecture: str,
    fields: Mapping[str, Any],
    verifier: str | None,
    verifier_architectures: Sequence[str] = (),
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """A speculators checkpoint's `config.json`: `architectures`, `speculators_model_type` (`model_type`, the field
    vLLM recognises a speculators checkpoint by), `speculators_version`, then the head's own `fields`, then
    `speculators_config`: the algorithm (`model_type`), greedy proposals of `speculative_tokens` tokens and the
    verifier (`verifier` with `verifier_architectures`; vLLM takes its `name_or_path` as the target model)."""
    if (
        isinstance(speculative_tokens, bool)
        or not isinstance(speculative_tokens, int)
        or speculative_tokens < 1
    ):
        raise ValueError(f"speculative_tokens={speculative_tokens!r} must be an int >= 1")
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        **fields,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
