"""A model's output rows at chosen positions: its final hidden states and the output layer that projects them.

A causal LM's logits are `output_layer(last_hidden_state)` (`(B, T, H) -> (B, T, V')`, then Gemma-2's final soft
cap), with V' >= the tokenizer's vocabulary when the checkpoint pads its embedding. At a real vocabulary (Qwen2.5's
152k) that tensor is gigabytes per batch and model, yet every caller needs only some positions: the answer positions
(the loss path, `specdistill.losses.rows`), the response positions (rollout labels, `specdistill.rollout.generate`),
the newest position (drafting, `specdistill.models.acceptance_head.draft_logits`). So all of them run the model's
body, keep the hidden states at their positions and project only those rows, here:

- `final_hidden_states(model, batch)`: `(B, T, H)` after the final norm, from the body alone.
- `OutputHead(model, vocab_size)`: `(..., H) -> (..., vocab_size)` logits, exactly as the model's forward computes
  them (output layer module, soft cap, padded rows dropped).
- `logits_at(model, batch, positions, vocab_size)`: `(N, vocab_size)` logits at a `(B, T)` bool mask of positions.

A model wrapped in a DeepSpeed engine (frozen ZeRO-3 models, `specdistill.utils.frozen_sharding`) is unwrapped first;
its layer modules keep the hooks that gather their sharded parameters.

Rounding: the rows of a matrix product are independent in exact arithmetic, but a BLAS may round a product over a
few rows differently from one over many (MKL on CPU takes another kernel below about 4 rows per thread: measured up
to 51 rows at 32 threads, 3 at one thread). `logits_at` therefore projects at least `MIN_PROJECTED_ROWS` rows (or
the whole batch when it is smaller), so its logits are bitwise the full forward's on CPU (tests/test_output_rows.py).
`OutputHead` itself projects what it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from specdistill.utils.frozen_sharding import is_deepspeed_engine

# Fewest rows `logits_at` projects at once: past it MKL rounds every row as it does in a full-batch projection.
MIN_PROJECTED_ROWS = 128


def unwrap_engine(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a DeepSpeed engine (`is_deepspeed_engine`), else `model` itself."""
    return model.module if is_deepspeed_engine(model) else model


class OutputHead:
    """A model's output layer as `hidden (..., H) -> logits (..., vocab_size)`, exactly as its forward computes them.

    Calls the layer module itself (not its weight), so hooks that gather sharded parameters (DeepSpeed ZeRO-3) fire;
    applies `config.final_logit_softcapping` (Gemma-2) like the model's forward; drops padded rows beyond the real
    vocabulary.

    Args:
        model: HF-style causal LM (`get_output_embeddings()`), or a DeepSpeed engine wrapping one.
        vocab_size: the tokenizer's real vocabulary; None keeps every output row (padded ones too).
    """

    def __init__(self, model: nn.Module, vocab_size: int | None = None) -> None:
        model = unwrap_engine(model)
        layer = model.get_output_embeddings()
        if layer is None:
            raise ValueError(
                f"{type(model).__name__} has no output layer (get_output_embeddings() is None): logits are "
                "projected from hidden states by the output layer, so use a causal LM head model "
                "(e.g. AutoModelForCausalLM)"
            )
        if vocab_size is not None:
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
        return logits if self.vocab_size is None else logits[..., : self.vocab_size]


def final_hidden_states(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """`(B, T, H)` last hidden state (after the final norm) from the model's body, without its output layer.

    Args:
        model: HF-style causal LM (`base_model` body), or a DeepSpeed engine wrapping one.
        batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
    """
    model = unwrap_engine(model)
    body = getattr(model, "base_model", model)
    if body is model:
        raise ValueError(
            f"{type(model).__name__} has no separate body (base_model is the model itself): logits are "
            "projected from the body's hidden states, so use a causal LM with an output layer on top of a base model "
            "(e.g. AutoModelForCausalLM)"
        )
    out = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def logits_at(
    model: nn.Module, batch: Mapping[str, Any], positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The model's logits at chosen positions, projected from those positions' hidden states only.

    A selection of fewer than `MIN_PROJECTED_ROWS` rows is projected together with filler rows (the batch's first
    unchosen positions, or all of them in a small batch), so that the product rounds as the full forward's does.

    Args:
        model: HF-style causal LM, or a DeepSpeed engine wrapping one.
        batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
        positions: `(B, T)` bool, True where the logits are wanted.
        vocab_size: the tokenizer's real vocabulary; padded output rows beyond it are dropped.

    Returns:
        `(N, vocab_size)` with N = `positions.sum()`, rows in row-major order of `positions`: what
        `model(**batch).logits[positions][:, :vocab_size]` gives.
    """
    return project_at(OutputHead(model, vocab_size), final_hidden_states(model, batch), positions)


def project_at(head: Any, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`head`'s logits `(N, V)` of the `(B, T, H)` states `hidden` at the `(B, T)` bool `positions` (row-major),
    projected with filler rows as `logits_at` does (so that they round as a full forward's)."""
    positions = positions.to(hidden.device)
    projected = _with_filler(positions, MIN_PROJECTED_ROWS)
    return head(hidden[projected])[positions[projected]]


def _with_filler(positions: torch.Tensor, min_rows: int) -> torch.Tensor:
    """`positions` plus the first unchosen positions (row-major) until `min_rows` of them, or all, are True."""
    missing = min(min_rows, positions.numel()) - int(positions.sum())
    if missing <= 0:
        return positions
    flat = positions.flatten().clone()
    flat[(~flat).nonzero().squeeze(-1)[:missing]] = True
    return flat.view_as(positions)
