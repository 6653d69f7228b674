"""Batched generation of a single model's answers: greedy with Hugging Face `generate` (the sft stage's task metric,
target answers), or sampled with seeded rows (target answers at a serving temperature)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.decoding.sampling import SamplingConfig
from specdistill.rollout.generate import sample_responses


@torch.inference_mode()
def greedy_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 16,
    desc: str = "generate",
) -> list[str]:
    """Greedy continuations of `prompt_ids` (left-padded batches), decoded without special tokens."""
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    texts: list[str] = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc=desc, leave=False):
        chunk = prompt_ids[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(chunk):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts.extend(tokenizer.batch_decode(out[:, width:], skip_special_tokens=True))
    return texts


def sampled_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seeds: Sequence[int],
    vocab_size: int,
    batch_size: int = 16,
    desc: str = "generate",
) -> list[str]:
    """Continuations of `prompt_ids` sampled under `sampling`, prompt i from its own generator seeded with `seeds[i]`
    (`specdistill.rollout.generate.sample_responses`): an answer depends on its prompt and seed only, never on the
    batch it was drawn in, so a relaunch draws it again. Decoded without special tokens, as `greedy_texts`."""
    model.eval()
    texts: list[str] = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc=desc, leave=False):
        responses, _ = sample_responses(
            model, prompt_ids[start : start + batch_size], sampling, max_new_tokens, tokenizer.eos_token_id,
            tokenizer.pad_token_id, vocab_size, seeds=seeds[start : start + batch_size],
        )  # fmt: skip
        texts.extend(tokenizer.batch_decode(responses, skip_special_tokens=True))
    return texts


def task_metric(task, records: Sequence[dict], texts: Sequence[str]) -> float:
    """Mean of the task's per-example score over generated `texts`."""
    if not texts:
        raise ValueError("No examples to score: the evaluation split is empty.")
    return sum(task.score(text, record) for text, record in zip(texts, records, strict=True)) / len(texts)
