"""A draft cut from the target: its embeddings, its first `num_layers` layers, its final norm and its output head.

The cut is a real Hugging Face model of the target's class with `num_hidden_layers=num_layers` and the target's
weights copied in, so from then on it is a standalone causal LM: it trains, exports, loads and drafts like one
(`DraftKind`'s defaults). Its logits before training are the target's early exit after layer `num_layers`: embeddings ->
layers 0..num_layers-1 -> final norm -> head. `python train.py stage=distill draft=cut_layers draft.num_layers=1`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from specdistill.drafts.base import DraftKind
from specdistill.drafts.standalone.kind import Standalone
from specdistill.errors import ConfigError
from specdistill.models.loading import ModelSpec


class CutLayers(DraftKind):
    """The draft is the target's first `num_layers` layers between its embeddings and its final norm and head.

    Args:
        num_layers: layers kept, 1 <= num_layers < the target's `num_hidden_layers` (`draft.num_layers`).
        continues: an earlier export of this kind to train on from (`<stage>.init`, e.g. the previous phase of
            stage=sequential) instead of cutting the target again; None: cut from the target.
    """

    exported_settings = ("num_layers",)

    def __init__(self, num_layers: int, continues: str | None = None) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(
                f"draft.num_layers={num_layers!r} is out of range: a cut draft keeps at least one of the target's "
                "layers (set draft.num_layers to 1 or more, fewer than the target's num_hidden_layers)"
            )
        self.num_layers = num_layers
        self.continues = None if continues is None else str(continues)

    def settings(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers}  # an export loads by path: `continues` is not part of it

    def specs(self, role: str) -> dict[str, ModelSpec]:
        return (
            {} if self.continues is None else {role: ModelSpec(pretrained_model_name_or_path=self.continues)}
        )

    def continued_from(self, export: str) -> CutLayers:
        """The same cut, its weights from the earlier export `export` (a cut of `num_layers` layers)."""
        return CutLayers(self.num_layers, continues=export)

    @torch.no_grad()
    def build(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool = False) -> nn.Module:
        """A model of the target's class with `num_layers` layers and the target's weights for them, in fp32
        (bfloat16 under `pure_bf16`), in training mode with gradients (the target itself is not changed); with
        `continues`, that export's weights instead."""
        if self.continues is not None:
            return self._continued(target, vocab_size, pure_bf16)
        if target is None:
            raise ValueError("a cut_layers draft is cut from the target: this stage loads no target model")
        config = copy.deepcopy(target.config)
        layers = config.num_hidden_layers
        if self.num_layers >= layers:
            raise ConfigError(
                f"draft.num_layers={self.num_layers} is out of range: the target has {layers} layers and a cut draft "
                f"keeps fewer (set draft.num_layers between 1 and {layers - 1})"
            )
        config.num_hidden_layers = self.num_layers
        if isinstance(
            getattr(config, "layer_types", None), list
        ):  # per-layer attention kinds (Gemma-2, Qwen2)
            config.layer_types = config.layer_types[: self.num_layers]
        dtype = torch.bfloat16 if pure_bf16 else torch.float32  # as trainable_spec (models/precision.py)
        # the random initialisation is overwritten: fork the RNG so that building the cut draws nothing from it
        with torch.random.fork_rng(devices=[]):
            draft = type(target)._from_config(config, dtype=dtype)
        wanted = draft.state_dict()
        # the kept layers have the same names in both models (layers.0 .. layers.N-1); the rest is not copied
        draft.load_state_dict(
            {name: tensor for name, tensor in target.state_dict().items() if name in wanted}
        )
        draft.to(next(target.parameters()).device)
        draft.train()
        draft.requires_grad_(True)
        return draft

    def _continued(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool) -> nn.Module:
        """The export `continues`, trainable, checked to be a cut of `num_layers` layers (of the target's class)."""
        exported = Standalone(ModelSpec(pretrained_model_name_or_path=self.continues))
        draft = exported.build(
            target, vocab_size, pure_bf16=pure_bf16
        )  # fp32 master weights, vocabulary checked
        layers = draft.config.num_hidden_layers
        if layers != self.num_layers:
            raise ConfigError(
                f"{self.continues} is a cut of {layers} layers, but draft.num_layers={self.num_layers}: continue it "
                f"with draft.num_layers={layers}, or start from the target (no init)"
            )
        if target is not None and type(draft) is not type(target):
            raise ConfigError(
                f"{self.continues} is a {type(draft).__name__}, not a cut of this target ({type(target).__name__}): "
                "continue a cut of the same target, or start from the target (no init)"
            )
        if target is not None:
            draft.to(next(target.parameters()).device)
        draft.train()
        draft.requires_grad_(True)
        return draft
