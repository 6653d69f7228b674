"""Drafts that are standalone Hugging Face causal LMs: the default kind, `Standalone` (the pair's `models.draft`).

`CausalLMDraft` holds what every causal-LM draft shares once it is built: its rows are its own answer rows (the
target pass is not read), it exports and loads as a Hugging Face model (`specdistill.export.hf`), and the decoding
engine drafts with the model itself. A kind whose draft is a causal LM built some other way (`cut_layers.py`)
subclasses it and overrides `build`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdistill.drafts.base import DraftKind, TargetPass
from specdistill.export.hf import export_pretrained
from specdistill.losses.rows import HiddenRows, answer_rows
from specdistill.models.loading import ModelSpec, load_model
from specdistill.models.precision import trainable_spec
from specdistill.models.vocab import check_model_covers_vocab


class CausalLMDraft(DraftKind):
    """A draft that is a standalone causal LM once built: rows, export, loading and proposer of such a model."""

    def rows(
        self,
        draft: nn.Module,
        batch: Mapping[str, Any],
        keep: torch.Tensor,
        target: TargetPass,
        vocab_size: int,
    ) -> HiddenRows:
        """The draft's own `answer_rows` (`(N, H)` final hidden states and its output layer); `target` is unused."""
        return answer_rows(draft, batch, keep, vocab_size)

    def export(
        self,
        draft: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        out_dir: Path,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """The Hugging Face export (`export_pretrained`) and this kind's record beside it."""
        out = export_pretrained(draft, tokenizer, out_dir, metadata)
        self.write_record(out)
        return out

    def load(self, spec: ModelSpec, vocab_size: int | None = None) -> nn.Module:
        """`load_model(spec)`, checked to cover the tokenizer's `vocab_size` when given."""
        model = load_model(spec, vocab_size=vocab_size)
        if vocab_size is not None:
            check_model_covers_vocab("draft", model, vocab_size)
        return model

    def proposer(self, model: nn.Module, vocab_size: int) -> nn.Module:
        """The model itself: the engine drafts with a causal LM directly."""
        return model


class Standalone(CausalLMDraft):
    """The draft is its own causal LM, `spec` (`models.draft`: a config with random weights, a hub id or an export).

    Args:
        spec: where the draft to train comes from; None for a kind read back from an export (which loads by path).
    """

    def __init__(self, spec: ModelSpec | None = None) -> None:
        self.spec = spec

    def specs(self, role: str) -> dict[str, ModelSpec]:
        return {role: self._spec()}

    def build(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool = False) -> nn.Module:
        """`load_model` of `spec` with fp32 master weights (bfloat16 under `pure_bf16`); the target is unused."""
        model = load_model(trainable_spec(self._spec(), pure_bf16=pure_bf16), vocab_size=vocab_size)
        check_model_covers_vocab("draft", model, vocab_size)
        return model

    def _spec(self) -> ModelSpec:
        if self.spec is None:
            raise ValueError(
                "this standalone draft kind has no spec (it was read back from an export, which loads by path): "
                "build it as Standalone(spec=ModelSpec(...)), as conf/draft/standalone.yaml does with models.draft"
            )
        return self.spec
