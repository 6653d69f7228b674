"""Rollout steps (1) and (2)+(3) of SpecDec++ labelling, batched.

(1) the target samples a response X to each prompt (`sample_responses`: a KV-cached loop warped by our own
`SamplingConfig`, so that generation, labelling and decoding warp identically, with finished rows dropped from the
batch); (2) one teacher-forced draft pass over prompt+X samples a draft token Y_i ~ q(. | prompt, X_<i) at every
response position; (3) the target's logits at the same positions give the soft label min(1, p(Y_i)/q(Y_i)). The
target's logits of step (3) are the raw logits generation already computed for X, so a rollout runs the target once;
responses generated elsewhere (reused for another draft) get a teacher-forced target pass instead. The two agree to
float rounding (KV-cached vs full attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import DraftKind
from specdistill.models.cache import forward_with_cache, takes_logits_to_keep
from specdistill.models.output_rows import logits_at, project_at
from specdistill.rollout.labels import sample_draft_tokens, soft_labels


def _eos_ids(eos_token_id: int | Sequence[int]) -> list[int]:
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `(B, T)` long, padded on the left (generation continues on the right)."""
    return _pad(sequences, pad_token_id, left=True)


def right_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `(B, T)` long, padded on the right."""
    return _pad(sequences, pad_token_id, left=False)


def _pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            cols = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, cols] = 1
    return ids, mask


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def row_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One sampling seed per prompt, from a base seed and the prompts' indices in the rollout set."""
    return [(seed * 1_000_003 + int(i)) % (2**63 - 1) for i in indices]


def race_sample(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """`(B,)` draws from the rows of `(B, V)` probabilities, row b from `generators[b]` alone.

    The exponential race: with E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p. One cheap noise
    draw per row replaces a `torch.multinomial` call per row, and a row's draw never depends on the other rows.
    """
    noise = torch.stack(
        [torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g) for g in generators]
    )
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


@torch.no_grad()
def sample_responses(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    vocab_size: int,
    seeds: Sequence[int],
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Target responses for one batch of prompts and the target's raw logits at every response position.

    A KV-cached loop over the left-padded batch. Rows that ended (EOS) leave the batch and the cache as soon as they
    are an eighth of it, so a batch costs about the sum of its response lengths rather than its longest one times
    the batch size. Row i draws from its own generator seeded with `seeds[i]` (`race_sample`), so a response depends
    on its prompt and seed only, never on the batch it was generated in.

    Args:
        target: causal LM (any architecture transformers caches; a `device_map`-placed model works too).
        prompts: token ids of each prompt (non-empty).
        sampling: warping; greedy takes the argmax.
        max_new_tokens: longest response.
        eos_token_id: id (or ids) that end a response (kept as its last token).
        pad_token_id: id used to pad the batch (masked out of attention; may equal EOS).
        vocab_size: real vocabulary; padded embedding rows are never sampled.
        seeds: one seed per prompt (`row_seeds`).

    Returns:
        `(responses, logits)`: per row the response's token ids, and `(n_i, vocab_size)` fp32 logits of the target at
        the positions that predicted them (before any warping), what a teacher-forced pass over prompt + response
        gives there up to float rounding.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS) to condition on.")
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt is needed, got {len(seeds)} seeds for {len(prompts)} prompts")
    device = _device(target)
    input_ids, attention_mask = (t.to(device) for t in left_pad(prompts, pad_token_id))
    eos = torch.tensor(_eos_ids(eos_token_id), device=device)
    generators = (
        [None] * len(prompts)
        if sampling.is_greedy
        else [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    )
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    kwargs = {"logits_to_keep": 1} if takes_logits_to_keep(type(target)) else {}
    out, cache = forward_with_cache(
        target, input_ids, None, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    # cache slot -> the row it generates, None once that row ended (until the slot is dropped)
    slots: list[int | None] = list(range(len(prompts)))
    positions = position_ids[:, -1:]
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        if logits.shape[-1] < vocab_size:
            raise ValueError(
                f"model has {logits.shape[-1]} output rows, fewer than the vocabulary ({vocab_size})."
            )
        logits = logits[:, :vocab_size].to(device)
        live = [slot for slot, row in enumerate(slots) if row is not None]
        chosen = torch.full((len(slots),), pad_token_id, dtype=torch.long, device=device)
        if sampling.is_greedy:
            chosen[live] = logits[live].argmax(dim=-1)
        else:
            chosen[live] = race_sample(
                sampling.warp_probs(logits[live]), [generators[slots[s]] for s in live]
            )
        for slot, token in zip(live, chosen[live].tolist(), strict=True):
            tokens[slots[slot]].append(token)
            step_logits[slots[slot]].append(logits[slot])
        ended = torch.isin(chosen, eos).tolist()
        slots = [None if row is None or ended[slot] else row for slot, row in enumerate(slots)]
        live = [slot for slot, row in enumerate(slots) if row is not None]
        if step == max_new_tokens - 1 or not live:
            break
        if len(slots) - len(live) >= max(1, len(slots) // 8):
            # drop ended rows from the batch and the cache once they would waste an eighth of a step
            keep = torch.tensor(live, device=device)
            cache.batch_select_indices(keep)
            slots = [slots[s] for s in live]
            attention_mask, positions, chosen = attention_mask[keep], positions[keep], chosen[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(slots), 1)], dim=-1)
        positions = positions + 1
        out, cache = forward_with_cache(
            target, chosen[:, None], cache, attention_mask=attention_mask, position_ids=positions
        )
    logits = [torch.stack(rows) if rows else torch.zeros(0, vocab_size) for rows in step_logits]
    return tokens, logits


def _response_logits(
    model: torch.nn.Module,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    pad_token_id: int,
    vocab_size: int,
    draft: tuple[DraftKind, torch.nn.Module | None] | None = None,
) -> list[torch.Tensor]:
    """Per row, `(n_i, vocab_size)` logits at the positions that predict the response tokens (teacher forcing).

    Projects only those positions' hidden states (`logits_at`), never the `(B, T, V)` logits of the whole batch.
    `draft`: `(kind, target)` when `model` is a draft, whose states and output layer its kind gives
    (`DraftKind.teacher_forced`); None for a causal LM's own pass (the target's).
    """
    device = _device(model)
    input_ids, attention_mask = right_pad(sequences, pad_token_id)
    # Logits at position t predict token t+1: response token i (at P+i) is predicted at P+i-1.
    positions = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (seq, start) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        positions[row, start - 1 : len(seq) - 1] = True
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if draft is None:
        logits = logits_at(model, batch, positions, vocab_size)
    else:
        kind, target = draft
        states = kind.teacher_forced(model, target, batch, vocab_size)
        logits = project_at(states.head, states.hidden, positions)
    return list(
        logits.split([len(seq) - start for seq, start in zip(sequences, prompt_lengths, strict=True)])
    )


@torch.no_grad()
def label_responses(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    pad_token_id: int,
    vocab_size: int,
    generator: torch.Generator | None = None,
    target_logits: Sequence[torch.Tensor] | None = None,
    kind: DraftKind | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample a draft token at every response position and label it.

    Args:
        target: the causal LM whose responses are labelled.
        draft: the draft, sharing the target's vocabulary; its distribution q at each position is what its `kind`'s
            teacher-forced pass gives (`DraftKind.teacher_forced`: the causal LM's own pass by default, an EAGLE-3
            head's step 0 over the target's states; a token the draft cannot propose has q = 0 and is never drawn).
        prompts, responses: token ids; each response X is labelled under teacher forcing on prompt + X_<i.
        sampling: the labelling warping (see `labelling_config`).
        pad_token_id: id used to pad the batch.
        vocab_size: real vocabulary size.
        generator: generator on the draft's device for the draft-token draws.
        target_logits: per row, the target's `(n_i, vocab_size)` logits at the response positions when generation
            already computed them (`sample_responses`); None runs a teacher-forced target pass.
        kind: the draft's kind (default `DraftKind()`, a causal LM).

    Returns:
        `(draft_tokens, labels)`: per row, lists of the response's length.
    """
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    prompt_lengths = [len(p) for p in prompts]
    if min(prompt_lengths) < 1:
        raise ValueError("empty prompt: the first response token needs a context to be predicted from.")
    draft_logits = _response_logits(
        draft, sequences, prompt_lengths, pad_token_id, vocab_size, (kind or DraftKind(), target)
    )
    lengths = [len(r) for r in responses]
    if target_logits is None:
        target_logits = _response_logits(target, sequences, prompt_lengths, pad_token_id, vocab_size)
    elif [t.shape for t in target_logits] != [(n, vocab_size) for n in lengths]:
        raise ValueError(
            "target_logits must hold one (len(response), vocab_size) tensor per response, got shapes "
            f"{[tuple(t.shape) for t in target_logits]} for response lengths {lengths} and vocab_size {vocab_size}"
        )
    flat_draft = torch.cat(draft_logits)
    tokens = sample_draft_tokens(flat_draft, sampling, generator)
    labels = soft_labels(torch.cat(target_logits).to(flat_draft.device), flat_draft, tokens, sampling)
    token_rows = torch.split(tokens.cpu(), lengths)
    label_rows = torch.split(labels.cpu(), lengths)
    return [t.tolist() for t in token_rows], [a.tolist() for a in label_rows]
