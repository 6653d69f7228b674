"""Batched greedy generation with Hugging Face `generate`, for the task metric of a single model (the sft stage)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase


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


def task_metric(task, records: Sequence[dict], texts: Sequence[str]) -> float:
    """Mean of the task's per-example score over generated `texts`."""
    if not texts:
        raise ValueError("No examples to score: the evaluation split is empty.")
    return sum(task.score(text, record) for text, record in zip(texts, records, strict=True)) / len(texts)
