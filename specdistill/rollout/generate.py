"""Rollout steps (1) and (2)+(3) of SpecDec++ labelling, batched.

(1) the target samples a response X to each prompt (left-padded `model.generate`, warped by our own `SamplingConfig`
so that generation, labelling and decoding warp identically); (2) one teacher-forced draft pass over prompt+X samples
a draft token Y_i ~ q(. | prompt, X_<i) at every response position; (3) the target's logits at the same positions give
the soft label min(1, p(Y_i)/q(Y_i)). The target's logits of step (3) are the raw scores generation already computed
for X (`generate_scored_responses`), so a rollout runs the target once; responses generated elsewhere (reused for
another draft) get a teacher-forced target pass instead. The two agree to float rounding (KV-cached vs full attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from specdistill.decoding.sampling import SamplingConfig
from specdistill.rollout.labels import sample_draft_tokens, soft_labels


class WarpLogitsProcessor(LogitsProcessor):
    """Replaces transformers' warpers by `SamplingConfig.warp_logits` and masks padded vocabulary rows.

    Sampling from `softmax` of the returned scores is sampling from `sampling.warp_probs(logits[:, :vocab_size])`.
    """

    def __init__(self, sampling: SamplingConfig, vocab_size: int) -> None:
        self.sampling = sampling
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"), dtype=torch.float32)
        out[:, : self.vocab_size] = self.sampling.warp_logits(scores[:, : self.vocab_size])
        return out


def _eos_ids(eos_token_id: int | Sequence[int]) -> list[int]:
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def truncate_at_eos(tokens: Sequence[int], eos_token_id: int | Sequence[int]) -> list[int]:
    """Tokens up to and including the first EOS (everything after it is padding from batched generation)."""
    eos = set(_eos_ids(eos_token_id))
    out = []
    for token in tokens:
        out.append(int(token))
        if token in eos:
            break
    return out


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


@torch.no_grad()
def generate_scored_responses(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    vocab_size: int,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Target responses for one batch of prompts (EOS kept, nothing after it) and the target's raw logits for them.

    Draws from the global torch RNG (`model.generate` has no generator argument): seed it before the call.

    Args:
        target: causal LM.
        prompts: token ids of each prompt (non-empty).
        sampling: warping; greedy uses argmax.
        max_new_tokens: longest response.
        eos_token_id: id (or ids) that end a response.
        pad_token_id: id used to pad the batch (may equal EOS).
        vocab_size: real vocabulary; padded embedding rows are never sampled.

    Returns:
        `(responses, logits)`: per row the response's token ids, and `(n_i, vocab_size)` fp32 logits of the target at
        the positions that predicted them (before any warping), exactly what a teacher-forced pass over
        prompt + response gives there up to float rounding.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS) to condition on.")
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    device = _device(target)
    config = GenerationConfig(
        do_sample=not sampling.is_greedy,
        # Neutral values (not None) so neither the model's own generation_config nor transformers' defaults add
        # warpers of their own; WarpLogitsProcessor is the only warping.
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=_eos_ids(eos_token_id),
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,  # the raw (unprocessed) logits of every step: the labels' target distribution
    )
    output = target.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        generation_config=config,
        logits_processor=LogitsProcessorList([WarpLogitsProcessor(sampling, vocab_size)]),
    )
    generated = output.sequences[:, input_ids.shape[1] :].tolist()
    responses = [truncate_at_eos(tokens, eos_token_id) for tokens in generated]
    if output.logits and output.logits[0].shape[-1] < vocab_size:
        raise ValueError(
            f"model has {output.logits[0].shape[-1]} output rows, fewer than the vocabulary ({vocab_size})."
        )
    steps = torch.stack(output.logits, dim=1) if output.logits else None  # (B, steps, V')
    logits = [
        steps[row, : len(r), :vocab_size].float() if steps is not None else torch.zeros(0, vocab_size)
        for row, r in enumerate(responses)
    ]
    return responses, logits


def generate_responses(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    vocab_size: int,
) -> list[list[int]]:
    """The responses of `generate_scored_responses` (same arguments, same draws), without the logits."""
    return generate_scored_responses(
        target, prompts, sampling, max_new_tokens, eos_token_id, pad_token_id, vocab_size
    )[0]


def _response_logits(
    model: torch.nn.Module,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    pad_token_id: int,
    vocab_size: int,
) -> list[torch.Tensor]:
    """Per row, `(n_i, V)` logits at the positions that predict the response tokens (teacher forcing)."""
    device = _device(model)
    input_ids, attention_mask = right_pad(sequences, pad_token_id)
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
    if logits.shape[-1] < vocab_size:
        raise ValueError(
            f"model has {logits.shape[-1]} output rows, fewer than the vocabulary ({vocab_size})."
        )
    # Logits at position t predict token t+1: response token i (at P+i) is predicted at P+i-1.
    return [
        logits[row, start - 1 : len(seq) - 1, :vocab_size]
        for row, (seq, start) in enumerate(zip(sequences, prompt_lengths, strict=True))
    ]


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
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample a draft token at every response position and label it.

    Args:
        target, draft: causal LMs sharing the vocabulary.
        prompts, responses: token ids; each response X is labelled under teacher forcing on prompt + X_<i.
        sampling: the labelling warping (see `labelling_config`).
        pad_token_id: id used to pad the batch.
        vocab_size: real vocabulary size.
        generator: generator on the draft's device for the draft-token draws.
        target_logits: per row, the target's `(n_i, vocab_size)` logits at the response positions when generation
            already computed them (`generate_scored_responses`); None runs a teacher-forced target pass.

    Returns:
        `(draft_tokens, labels)`: per row, lists of the response's length.
    """
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    prompt_lengths = [len(p) for p in prompts]
    if min(prompt_lengths) < 1:
        raise ValueError("empty prompt: the first response token needs a context to be predicted from.")
    draft_logits = _response_logits(draft, sequences, prompt_lengths, pad_token_id, vocab_size)
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
