"""Head-training batches: the mixed sequence Z and `RolloutCollator`.

Candidate heads (docs/METHODS.md section 4): Z_i = X_i (the target's token) with probability r and Y_i (the draft's
token) otherwise. The head is trained only at positions holding a draft token, on the hidden state whose *input*
token is Y_i, i.e. at absolute position `len(prompt) + i` of prompt + Z (no shift: the head judges the token it just
read).

Proposer heads (`specdistill.models.acceptance_head`): the input is prompt + X unmixed, and the head is trained at
every response position on the state that proposed Y_i, absolute position `len(prompt) + i - 1`, together with Y_i
(`draft_tokens`) to read `q(Y_i)` from the draft's distribution there.

Batches (right-padded):

- from rollouts: `input_ids (B, L) long`, `attention_mask (B, L) long`, `loss_mask (B, L) bool` (True at the states
  the head judges), `head_labels (B, L) float` (soft label there, 0 elsewhere), `draft_tokens (B, L) long` (the
  judged draft token there, pad elsewhere), `example_id (B,) long`;
- from a hidden-state cache (`specdistill.head_data.hidden_cache`): `hidden_states (B, N, D) float` (the head's
  inputs), `loss_mask (B, N) bool`, `head_labels (B, N) float`, `example_id (B,) long`.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.models.acceptance_head import HEAD_INPUTS


def mix_sequence(
    response_ids: torch.Tensor, draft_tokens: torch.Tensor, r: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix target and draft tokens position by position.

    Args:
        response_ids: `(T,)` target response X.
        draft_tokens: `(T,)` draft tokens Y (Y_i sampled given prompt + X_<i).
        r: mixing ratio, the probability of keeping the target token (0.15 in SpecDec++).
        generator: random source (None: the global torch RNG).

    Returns:
        `(mixed_ids, is_draft_mask)`, both `(T,)`: Z, and True where Z_i is the draft token Y_i (the positions that
        carry the loss), even where Y_i happens to equal X_i.
    """
    if response_ids.shape != draft_tokens.shape or response_ids.dim() != 1:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and draft_tokens {tuple(draft_tokens.shape)} must be (T,)."
        )
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"mixing ratio r={r} must be in [0, 1] (SpecDec++ uses 0.15).")
    keep_target = torch.rand(response_ids.shape, generator=generator) < r
    is_draft_mask = ~keep_target
    return torch.where(is_draft_mask, draft_tokens, response_ids), is_draft_mask


def example_generator(seed: int, example_id: int) -> torch.Generator:
    """A generator that depends only on (seed, example): reproducible whatever the batching or worker."""
    return torch.Generator().manual_seed((seed * 1_000_003 + example_id) % (2**63 - 1))


class RolloutCollator:
    """Builds head-training batches from rollout rows or hidden-state cache rows.

    Args:
        pad_token_id: id for padding (masked out of attention).
        mixing_ratio: r, probability of keeping the target token at each response position (candidate heads).
        seed: None draws the mixing from the global RNG (fresh every epoch: training); an int fixes each example's
            mixing by `(seed, prompt_index)` (validation, cache building).
        head_input: `"candidate"` (mixed sequences) or `"proposer"` (unmixed, states one position earlier).
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        mixing_ratio: float = 0.15,
        seed: int | None = None,
        head_input: str = "candidate",
    ) -> None:
        if not 0.0 <= mixing_ratio <= 1.0:
            raise ValueError(f"mixing_ratio={mixing_ratio} must be in [0, 1].")
        if head_input not in HEAD_INPUTS:
            raise ValueError(
                f"head_input={head_input!r} is not a head input; use one of {list(HEAD_INPUTS)}."
            )
        self.pad_token_id = pad_token_id
        self.mixing_ratio = mixing_ratio
        self.seed = seed
        self.head_input = head_input

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "hidden" in rows[0]:
            return self._collate_cached(rows)
        return self._collate_rollouts(rows)

    def _collate_rollouts(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, masks, labels, judged = [], [], [], []
        for row in rows:
            prompt = torch.as_tensor(row["prompt_ids"], dtype=torch.long)
            response = torch.as_tensor(row["response_ids"], dtype=torch.long)
            draft_tokens = torch.as_tensor(row["draft_tokens"], dtype=torch.long)
            label = torch.as_tensor(row["labels"], dtype=torch.float32)
            if self.head_input == "proposer":
                # the state at len(prompt) + i - 1 proposed Y_i; the last response token proposes nothing judged
                sequence, is_judged = (
                    torch.cat([prompt, response]),
                    torch.ones(len(response), dtype=torch.bool),
                )
                offset = len(prompt) - 1
            else:
                generator = (
                    None if self.seed is None else example_generator(self.seed, int(row["prompt_index"]))
                )
                mixed, is_judged = mix_sequence(response, draft_tokens, self.mixing_ratio, generator)
                sequence, offset = torch.cat([prompt, mixed]), len(prompt)
            sequences.append(sequence)
            masks.append(_place(is_judged, offset, len(sequence), False))
            labels.append(_place(label, offset, len(sequence), 0.0))
            judged.append(_place(draft_tokens, offset, len(sequence), self.pad_token_id))
        width = max(len(s) for s in sequences)
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
            "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
            "head_labels": torch.zeros((len(rows), width)),
            "draft_tokens": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
        }
        for i, (seq, mask, label, tokens) in enumerate(zip(sequences, masks, labels, judged, strict=True)):
            batch["input_ids"][i, : len(seq)] = seq
            batch["attention_mask"][i, : len(seq)] = 1
            batch["loss_mask"][i, : len(seq)] = mask
            batch["head_labels"][i, : len(seq)] = torch.where(mask, label, 0.0)
            batch["draft_tokens"][i, : len(seq)] = torch.where(mask, tokens, self.pad_token_id)
        batch["example_id"] = torch.tensor([int(row["prompt_index"]) for row in rows], dtype=torch.long)
        return batch

    def _collate_cached(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        hidden = [torch.as_tensor(row["hidden"], dtype=torch.float32) for row in rows]
        width, size = max(len(h) for h in hidden), hidden[0].shape[-1]
        batch = {
            "hidden_states": torch.zeros((len(rows), width, size)),
            "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
            "head_labels": torch.zeros((len(rows), width)),
        }
        for i, (row, h) in enumerate(zip(rows, hidden, strict=True)):
            batch["hidden_states"][i, : len(h)] = h
            batch["loss_mask"][i, : len(h)] = True
            batch["head_labels"][i, : len(h)] = torch.as_tensor(row["head_labels"], dtype=torch.float32)
        batch["example_id"] = torch.tensor([int(row["prompt_index"]) for row in rows], dtype=torch.long)
        return batch


def _place(values: torch.Tensor, offset: int, length: int, fill: float | int | bool) -> torch.Tensor:
    """`(length,)` tensor holding `values` from index `offset` on and `fill` elsewhere."""
    out = torch.full((length,), fill, dtype=values.dtype)
    out[offset : offset + len(values)] = values
    return out
