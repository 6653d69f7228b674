"""Per-token divergences computed chunk by chunk from answer rows, so no `(N, V)` logits of any model exist at once.

`rowwise(fns, target, draft, chunk_size)` projects `chunk_size` rows of each model at a time
(`specdistill.losses.rows`) and applies every per-token function `fn(target_logits, draft_logits) -> (n,)` to the
chunk. When gradients are needed each chunk runs under activation checkpointing: its forward keeps only the chunk's
inputs (hidden states `(n, H)`), and the backward pass projects the chunk again, so neither pass holds more than one
chunk's logits. Rows are independent, so the result equals the full computation (same maths per row, concatenated) up
to float rounding of the projection's matrix product.

Without a `chunk_size` the chunk follows a memory budget (`budget_mb`, `auto_chunk_size`): a batch whose fp32
`(N, V)` logits fit in the budget is one chunk (the tiny pair's batches, ~13 MB at V = 512, stay so: the same
operations as without chunking), a larger one is cut into chunks of `budget / (V * 4 bytes)` rows. The budget counts
one fp32 `(n, V)` tensor; a chunk's peak is a small multiple (both models' logits, softmax temporaries, gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from specdistill.losses.rows import LogitRows

DivergenceFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Default budget of one chunk's fp32 logits, in MiB: 106 rows at SmolLM2's 49152 vocabulary, 34 at Qwen2.5's 152064
# (benchmarks/bench_loss_path.py: a chunk's peak is ~7 such tensors, so this keeps the loss path at ~0.1x of full
# logits at both); the tiny pair's largest batches (40 x 160 rows at V = 512: 12.5 MiB) stay one chunk.
DEFAULT_CHUNK_BUDGET_MB = 20.0
_FP32_BYTES = 4


def auto_chunk_size(rows: int, vocab_size: int, budget_mb: float | None) -> int | None:
    """Rows per chunk so that one chunk's fp32 `(n, vocab_size)` logits fit in `budget_mb` MiB.

    Returns None (all rows as one chunk) when every row fits or there is no budget, else at least one row.
    """
    if budget_mb is None:
        return None
    if budget_mb <= 0:
        raise ValueError(f"chunk_budget_mb must be None or a positive number of MiB, got {budget_mb}")
    per_row = vocab_size * _FP32_BYTES
    if rows * per_row <= budget_mb * 2**20:
        return None
    return max(1, int(budget_mb * 2**20 // per_row))


def rowwise(
    fns: Sequence[DivergenceFn],
    target: Any,
    draft: Any,
    chunk_size: int | None = None,
    budget_mb: float | None = None,
) -> list[torch.Tensor]:
    """Each `fn` per answer row: `[(N,) fp32 for fn in fns]`.

    Args:
        fns: per-token functions of `(target_logits (n, V), draft_logits (n, V))`, e.g. `forward_kl`.
        target: the target's rows (`HiddenRows`, `LogitRows` or cached `SparseRows`; an `(N, V)` tensor is taken as
            `LogitRows`); no gradient flows into it unless its tensors require one.
        draft: the draft's (or reference's) rows, `HiddenRows` or `LogitRows` (or an `(N, V)` tensor), same order.
        chunk_size: rows per chunk; None: as many as `budget_mb` allows (`auto_chunk_size`).
        budget_mb: MiB of one chunk's fp32 logits when `chunk_size` is None; None too: all N rows as one chunk.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be None or a positive number of rows, got {chunk_size}")
    target, draft = _as_rows(target), _as_rows(draft)
    n = len(draft)
    if len(target) != n:
        raise ValueError(
            f"target has {len(target)} answer rows but the draft has {n}; they must be the same positions"
        )
    if target.vocab_size is not None and target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"target rows have {target.vocab_size} logits but draft rows {draft.vocab_size}: slice both to the "
            "tokenizer's real vocabulary"
        )
    if chunk_size is None:
        chunk_size = auto_chunk_size(n, draft.vocab_size, budget_mb)
    size = chunk_size or max(n, 1)
    pieces: list[list[torch.Tensor]] = [[] for _ in fns]
    for start in range(0, n, size):
        stop = min(start + size, n)
        target_inputs = target.inputs(start, stop)
        draft_inputs = draft.inputs(start, stop)
        split = len(target_inputs)

        def chunk(*tensors: torch.Tensor, split: int = split) -> tuple[torch.Tensor, ...]:
            target_logits, draft_logits = target.against(draft.logits(*tensors[split:]), *tensors[:split])
            return tuple(fn(target_logits, draft_logits) for fn in fns)

        tensors = (*target_inputs, *draft_inputs)
        if torch.is_grad_enabled() and _needs_grad(tensors, draft, target):
            values = checkpoint(chunk, *tensors, use_reentrant=False)
        else:
            values = chunk(*tensors)
        for out, value in zip(pieces, values, strict=True):
            out.append(value)
    device = draft.inputs(0, 0)[0].device
    return [torch.cat(out) if out else torch.zeros(0, device=device) for out in pieces]


def _as_rows(rows: Any) -> Any:
    if torch.is_tensor(rows):
        if rows.dim() != 2:
            raise ValueError(
                f"logit rows must be (N, V), got shape {tuple(rows.shape)}; flatten (B, T, V) first"
            )
        return LogitRows(rows)
    return rows


def _needs_grad(tensors: Sequence[torch.Tensor], *rows: Any) -> bool:
    """Whether a chunk's values need a graph: its inputs or a row's output-layer parameters require gradients."""
    if any(t.requires_grad for t in tensors):
        return True
    for r in rows:
        head = getattr(r, "head", None)
        if head is not None and any(p.requires_grad for p in head.layer.parameters()):
            return True
    return False
