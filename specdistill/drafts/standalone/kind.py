"""The default draft kind, `Standalone`: the draft is its own causal LM, the pair's `models.draft`."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from specdistill.drafts.base import DraftKind
from specdistill.models.loading import ModelSpec, load_model
from specdistill.models.precision import trainable_spec
from specdistill.models.vocab import check_model_covers_vocab


class Standalone(DraftKind):
    """The draft is its own causal LM, `spec` (`models.draft`: a config with random weights, a hub id or an export).

    Rows, export, loading and proposer are `DraftKind`'s, those of a causal-LM draft.

    Args:
        spec: where the draft to train comes from; None for a kind read back from an export (which loads by path).
    """

    def __init__(self, spec: ModelSpec | None = None) -> None:
        self.spec = spec

    def specs(self, role: str) -> dict[str, ModelSpec]:
        return {role: self._spec()}

    def continued_from(self, export: str) -> Standalone:
        """The same draft settings (dtype), its weights and config from the export directory `export`."""
        return Standalone(
            replace(
                self._spec(), pretrained_model_name_or_path=export, gguf_file=None, config=None, revision=None
            )
        )

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
