"""Answer rows of a model without its full logits: final hidden states and the output layer that projects them.

A causal LM's logits are `output_layer(last_hidden_state)` (`(B, T, H) -> (B, T, V)`, plus Gemma-2's final soft cap).
At a real vocabulary (Qwen2.5's 152k) that tensor is gigabytes per micro-batch and model, so the loss path keeps
only the answer positions' hidden states `(N, H)` and projects them chunk by chunk (`specdistill.losses.chunked`):

- `HiddenRows(hidden, head)`: `(N, H)` hidden states and the head that gives their logits `(n, vocab_size)`.
- `LogitRows(logits)`: already materialised `(N, V)` logits (tests, callers that have them).
- `SparseRows(log_probs, token_ids, tail_mass)`: a target distribution cached as its top-m tokens plus the mass of
  the rest (`specdistill.losses.sparse`), for training without the target.

`answer_rows(model, batch, keep, vocab_size)` runs a model's body (no output layer) and returns its `HiddenRows`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class OutputHead:
    """A model's output layer as `hidden (n, H) -> logits (n, vocab_size)`, exactly as its forward computes them.

    Calls the layer module itself (not its weight), so hooks that gather sharded parameters (DeepSpeed ZeRO-3) fire;
    applies `config.final_logit_softcapping` (Gemma-2) like the model's forward; drops padded rows beyond the real
    vocabulary.
    """

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        model = _unwrap(model)
        layer = model.get_output_embeddings()
        if layer is None:
            raise ValueError(
                f"{type(model).__name__} has no output layer (get_output_embeddings() is None): the loss path "
                "needs a causal LM head model (e.g. AutoModelForCausalLM)"
            )
        rows = layer.weight.shape[0] if getattr(layer, "weight", None) is not None else None
        if rows is not None and 0 < rows < vocab_size:
            raise ValueError(
                f"{type(model).__name__} gives {rows} logits but the tokenizer has {vocab_size} tokens: "
                "draft, reference and target must share the tokenizer (set vocab_size to len(tokenizer))"
            )
        self.layer = layer
        self.vocab_size = vocab_size
        self.softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.layer(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[..., : self.vocab_size]


@dataclass(frozen=True)
class HiddenRows:
    """`hidden`: `(N, H)` final hidden states at the kept positions; `head` projects a slice of them to logits."""

    hidden: torch.Tensor
    head: OutputHead

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    def inputs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """The tensors a chunk is computed from (what activation checkpointing keeps)."""
        return (self.hidden[start:stop],)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(n, H) -> (n, vocab_size)` logits of a chunk given by `inputs`."""
        return self.head(hidden)

    def against(self, draft_logits: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(target, draft)` logits of one chunk, as a divergence takes them, for this target chunk's `inputs`."""
        return self.logits(*inputs), draft_logits


@dataclass(frozen=True)
class LogitRows:
    """`values`: `(N, V)` materialised logits (the rows are sliced, nothing is projected)."""

    values: torch.Tensor

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.values.shape[-1]

    def inputs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        return (self.values[start:stop],)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def against(self, draft_logits: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits(*inputs), draft_logits


def _unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DeepSpeed engine wrapper (frozen ZeRO-3 models, `specdistill.utils.frozen_sharding`)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def final_hidden_states(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """`(B, T, H)` last hidden state (after the final norm) from the model's body, without its output layer."""
    model = _unwrap(model)
    body = getattr(model, "base_model", model)
    if body is model:
        raise ValueError(
            f"{type(model).__name__} has no separate body (base_model is the model itself): the hidden-state loss "
            "path needs a causal LM with an output layer on top of a base model (e.g. AutoModelForCausalLM)"
        )
    out = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def answer_rows(
    model: nn.Module, batch: Mapping[str, Any], keep: torch.Tensor, vocab_size: int
) -> HiddenRows:
    """The model's rows at the kept shifted positions, as hidden states and its output layer.

    Args:
        model: HF-style causal LM (`base_model` body and `get_output_embeddings()` head).
        batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
        keep: `(B, T-1)` bool, usually `answer_mask(batch["labels"])`.
        vocab_size: the tokenizer's real vocabulary; padded output rows beyond it are dropped.

    Returns:
        `HiddenRows` with `hidden` `(N, H)`, N = `keep.sum()`, rows in row-major order of `keep`; its logits equal
        `answer_logits(model, batch, keep, vocab_size)` up to float rounding of the matrix product.
    """
    head = OutputHead(model, vocab_size)
    hidden = final_hidden_states(model, batch)
    return HiddenRows(hidden[:, :-1][keep], head)
