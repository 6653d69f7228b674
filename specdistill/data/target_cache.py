"""Cached target distributions: an offline pass stores the target's top-m answer-token distribution, so distillation
trains without loading the target (docs/METHODS.md, "Cached target distributions").

`build_target_cache(path, target, ...)` runs the frozen target once over each split (`scoring_dataloader`,
`example_id` order; train and validation by default) and stores, per example and per answer token (shifted positions,
row-major like `answer_mask`), the m largest log-probabilities on the real vocabulary, their token ids and the
remaining tail mass (`specdistill.losses.sparse.top_m`). Storage: one `datasets` dataset per split under
`path/<split>` (arrow shards of at most `max_shard_size`; keep it beside the tokenised dataset) with columns
`example_id`, `log_probs` (n_i * m float32), `token_ids` (n_i * m int32) and `tail_mass` (n_i float32), and
`path/specdistill_target_cache.json` holding the key: the model's identity, the tokenizer's fingerprint, each
tokenised split's fingerprint, the vocabulary size and m.

`CachedTarget.load(path, model=..., tokenizer=..., datamodule=...)` refuses a cache made from another model,
tokenizer or dataset (naming which one differs) and serves `rows(batch, answer_mask, split) -> SparseRows` by
`example_id`; `DistillModule(target=<CachedTarget>)` then trains and validates the draft against it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from specdistill.losses.answers import answer_mask
from specdistill.losses.rows import answer_rows
from specdistill.losses.sparse import SparseRows, top_m

log = logging.getLogger(__name__)

KEY_FILE = "specdistill_target_cache.json"


def model_identity(model: nn.Module) -> str:
    """sha256 of the model's config and output-layer weights: what the cache's top-m depends on most directly, cheap
    to compute even for a large target (the whole body is not hashed)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    weight = model.get_output_embeddings().weight.detach().float().cpu().contiguous()
    digest.update(weight.numpy().tobytes())
    return digest.hexdigest()


def tokenizer_identity(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (string -> id)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def cache_key(
    model: str, tokenizer: Any, datamodule: Any, vocab_size: int, m: int, splits: tuple[str, ...]
) -> dict[str, Any]:
    """What a cache must have been built from to be used: model identity, tokenizer, tokenised splits, V, m."""
    return {
        "model": model,
        "tokenizer": tokenizer_identity(tokenizer),
        "data": {split: datamodule.tokenized(split)._fingerprint for split in splits},
        "vocab_size": int(vocab_size),
        "m": int(m),
    }


@torch.no_grad()
def build_target_cache(
    path: str | Path,
    target: nn.Module,
    tokenizer: Any,
    datamodule: Any,
    vocab_size: int,
    m: int = 64,
    chunk_size: int = 1024,
    max_shard_size: str = "500MB",
    splits: tuple[str, ...] = ("train", "validation"),
) -> CachedTarget:
    """Run the target once over the train split and store its top-m answer distributions under `path`.

    Args:
        path: output directory (overwritten).
        target: the frozen target, on the device the scoring batches should use.
        tokenizer: the shared tokenizer (fingerprinted).
        datamodule: a `TaskDataModule`; its `scoring_dataloader(split)` is scored for every split.
        vocab_size: the tokenizer's real vocabulary.
        m: cached tokens per answer position (at most V; m = V stores the exact distribution).
        chunk_size: answer rows projected to logits at once.
        max_shard_size: arrow shard size on disk.
        splits: the splits to cache (training reads "train", validation "validation").
    """
    if not 1 <= m <= vocab_size:
        raise ValueError(f"m must lie in [1, vocab_size={vocab_size}] cached tokens per position, got {m}")
    path = Path(path)
    target.eval()
    for split in splits:
        dataset = _score_split(target, datamodule, split, vocab_size, m, chunk_size)
        dataset.save_to_disk(str(path / split), max_shard_size=max_shard_size)
        log.info("cached the target's top-%d distributions of %d %s examples", m, len(dataset), split)
    key = cache_key(model_identity(target), tokenizer, datamodule, vocab_size, m, tuple(splits))
    (path / KEY_FILE).write_text(json.dumps(key, indent=1))
    return CachedTarget(path, key)


_FEATURES = datasets.Features(
    {
        "example_id": datasets.Value("int64"),
        "log_probs": datasets.Sequence(datasets.Value("float32")),
        "token_ids": datasets.Sequence(datasets.Value("int32")),
        "tail_mass": datasets.Sequence(datasets.Value("float32")),
    }
)


def _score_split(
    target: nn.Module, datamodule: Any, split: str, vocab_size: int, m: int, chunk_size: int
) -> datasets.Dataset:
    device = next(target.parameters()).device
    columns: dict[str, list] = {name: [] for name in _FEATURES}
    for batch in datamodule.scoring_dataloader(split):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        keep = answer_mask(batch["labels"])
        rows = answer_rows(target, batch, keep, vocab_size)
        pieces = [
            top_m(rows.logits(*rows.inputs(s, s + chunk_size)), m) for s in range(0, len(rows), chunk_size)
        ]
        if not pieces:
            pieces = [top_m(torch.zeros(0, vocab_size), m)]
        log_probs, token_ids, tail = (torch.cat(p).cpu() for p in zip(*pieces, strict=True))
        start = 0
        for example_id, n in zip(batch["example_id"].tolist(), keep.sum(dim=1).tolist(), strict=True):
            columns["example_id"].append(int(example_id))
            columns["log_probs"].append(log_probs[start : start + n].reshape(-1).numpy())
            columns["token_ids"].append(token_ids[start : start + n].reshape(-1).int().numpy())
            columns["tail_mass"].append(tail[start : start + n].numpy())
            start += n
    dataset = datasets.Dataset.from_dict(columns, features=_FEATURES).sort("example_id")
    if dataset["example_id"] != list(range(len(dataset))):
        raise ValueError(f"the {split} scoring dataloader must yield every example_id 0..N-1 exactly once")
    return dataset


class CachedTarget:
    """The target's cached answer distributions, served per batch as `SparseRows` (no target model needed).

    Build with `build_target_cache`, or open with `CachedTarget.load`, which checks the key.
    """

    def __init__(self, path: str | Path, key: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.key = dict(key)
        self.vocab_size = int(key["vocab_size"])
        self.m = int(key["m"])
        self._splits = {
            split: datasets.load_from_disk(str(self.path / split)).with_format("numpy")
            for split in key["data"]
        }

    @classmethod
    def load(
        cls,
        path: str | Path,
        model: str,
        tokenizer: Any,
        datamodule: Any,
        vocab_size: int,
        m: int = 64,
        splits: tuple[str, ...] = ("train", "validation"),
    ) -> CachedTarget:
        """Open the cache at `path` if it was built from exactly this model identity (`model_identity`), tokenizer,
        tokenised splits, vocabulary and m; raise a ValueError naming what differs otherwise."""
        key_file = Path(path) / KEY_FILE
        if not key_file.is_file():
            raise ValueError(
                f"{path} holds no cached target distributions ({KEY_FILE} is missing): build them with "
                "build_target_cache(path, target, tokenizer, datamodule, vocab_size, m)"
            )
        stored = json.loads(key_file.read_text())
        wanted = cache_key(model, tokenizer, datamodule, vocab_size, m, splits)
        names = {"model": "target model", "tokenizer": "tokenizer", "data": "dataset (tokenised splits)"}
        differing = [names.get(k, k) for k in wanted if stored.get(k) != wanted[k]]
        if differing:
            raise ValueError(
                f"the cached target distributions in {path} were built from another {', '.join(differing)} than "
                "this run uses; rebuild them with build_target_cache for this target, tokenizer and dataset, or "
                "point the run at the matching cache"
            )
        return cls(path, stored)

    def rows(self, batch: Mapping[str, Any], keep: torch.Tensor, split: str) -> SparseRows:
        """The cached rows of the batch's answer positions, in the row-major order of `keep` `(B, T-1)`."""
        if split not in self._splits:
            raise ValueError(
                f"the cached target distributions in {self.path} hold no {split!r} split (they hold "
                f"{sorted(self._splits)}): build them with splits including {split!r}"
            )
        ids = batch["example_id"].tolist()
        examples = self._splits[split][ids]
        counts = keep.sum(dim=1).tolist()
        for example_id, n, tail in zip(ids, counts, examples["tail_mass"], strict=True):
            if len(tail) != n:
                raise ValueError(
                    f"{split} example {example_id} has {n} answer tokens in this batch but {len(tail)} in the cached "
                    f"target distributions ({self.path}): the cache was built from another tokenisation"
                )
        n = int(sum(counts))

        def stack(name: str, dtype: torch.dtype) -> torch.Tensor:
            flat = np.concatenate(list(examples[name])) if n else np.zeros(0)
            return torch.as_tensor(flat).to(keep.device, dtype)

        return SparseRows(
            stack("log_probs", torch.float32).reshape(n, self.m),
            stack("token_ids", torch.long).reshape(n, self.m),
            stack("tail_mass", torch.float32).reshape(n),
        )


def open_or_build_target_cache(
    path: str | Path, target: nn.Module, tokenizer: Any, datamodule: Any, vocab_size: int, m: int
) -> CachedTarget:
    """A stage's target cache: the one at `path` when it was built from this target, tokenizer, data, vocabulary and
    m (a resumed or re-launched run), else a new one (one target pass over train and validation)."""
    try:
        return CachedTarget.load(path, model_identity(target), tokenizer, datamodule, vocab_size, m=m)
    except ValueError:
        return build_target_cache(path, target, tokenizer, datamodule, vocab_size, m=m)
