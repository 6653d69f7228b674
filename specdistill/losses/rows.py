"""Answer rows of a model without its full logits: final hidden states and the output layer that projects them.

A causal LM's logits are `output_layer(last_hidden_state)` (`(B, T, H) -> (B, T, V)`, plus Gemma-2's final soft cap).
At a real vocabulary (Qwen2.5's 152k) that tensor is gigabytes per micro-batch and model, so the loss path keeps
only the answer positions' hidden states `(N, H)` and projects them chunk by chunk (`specdistill.losses.chunked`)
with the model's `OutputHead` (`specdistill.models.output_rows`, the one place logits are projected from hidden
states; re-exported here with `final_hidden_states` for the loss path's callers):

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

from specdistill.models.output_rows import OutputHead, final_hidden_states

__all__ = ["GatheredLogitRows", "HiddenRows", "LogitRows", "OutputHead", "answer_rows", "final_hidden_states"]


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


@dataclass(frozen=True)
class GatheredLogitRows(LogitRows):
    """Row `i` is row `index[i]` of `values` `(N, V)` materialised logits; each chunk gathers its own rows, so `M`
    rows that repeat `N` (several training rows per answer token) never hold `(M, V)` logits at once."""

    index: torch.Tensor

    def __len__(self) -> int:
        return self.index.shape[0]

    def inputs(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        return (self.values[self.index[start:stop]],)


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
