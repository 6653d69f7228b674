"""Cached target distributions: an offline pass stores the target's top-m answer-token distribution, so distillation
trains without loading the target (docs/METHODS.md, "Cached target distributions").

`build_target_cache(path, target, ...)` runs the frozen target once over each split (`scoring_dataloader`,
`example_id` order; train and validation by default) and stores, per example and per answer token (shifted positions,
row-major like `answer_mask`), the m largest log-probabilities on the real vocabulary, their token ids and the
remaining tail mass (`specdistill.losses.sparse.top_m`). Storage: one `datasets` dataset per split under
`path/<split>` (arrow shards of at most `max_shard_size`; keep it beside the tokenised dataset) with columns
`example_id`, `log_probs` (n_i * m float32), `token_ids` (n_i * m int32) and `tail_mass` (n_i float32), and
`path/specdistill_target_cache.json` holding the key: the model's identity (its config and a digest of every weight,
`specdistill.caches.weights_digest`), the tokenizer's fingerprint, each tokenised split's fingerprint, the vocabulary
size and m, and, written last, the sha256, size and rows of each split's table. Computing, merging across ranks and
reusing go through `specdistill.caches.build_or_reuse`, which verifies the tables before reusing them (a table changed
or truncated on disk is recomputed, with a warning naming the folder).

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

from specdistill.caches.digest import weights_digest
from specdistill.caches.fit_start import FitStart, FitStartCache
from specdistill.caches.store import (
    SharedPass,
    build_or_reuse,
    inputs_of,
    load_checked,
    load_tables,
    read_key,
)
from specdistill.losses.answers import answer_mask
from specdistill.losses.rows import answer_rows
from specdistill.losses.sparse import SparseRows, top_m
from specdistill.models.frozen import Frozen, placed
from specdistill.utils.distributed import batches_of_rank, is_sharded

log = logging.getLogger(__name__)

KEY_FILE = "specdistill_target_cache.json"
CHUNK_SIZE = 1024  # answer rows projected to logits at once
MAX_SHARD_SIZE = "500MB"  # arrow shard size on disk


def model_identity(model: nn.Module, weights: str | None = None) -> str:
    """sha256 of the model's config and of every one of its weights (`specdistill.caches.weights_digest`): a target
    whose body changed, or one retrained into the same directory, has another identity.

    Args:
        model: the target, its weights whole (take the identity before a ZeRO-3 placement partitions them).
        weights: its `weights_digest`, when already taken (`Frozen.weights_digest()`); computed here when None.
    """
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    digest.update((weights or weights_digest(model)).encode())
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


def _check_m(m: int, vocab_size: int) -> None:
    if not 1 <= m <= vocab_size:
        raise ValueError(f"m must lie in [1, vocab_size={vocab_size}] cached tokens per position, got {m}")


class SplitsPass(SharedPass):
    """A target pass over the tokenised splits its key names (`key["data"]`: split -> fingerprint), one table each."""

    _key: dict[str, Any]
    datamodule: Any

    def key(self) -> dict[str, Any]:
        return self._key

    def sizes(self) -> dict[str, int]:
        return {split: len(self.datamodule.tokenized(split)) for split in self._key["data"]}


class _TargetPass(SplitsPass):
    """The target cache as a `SharedPass`: one table per split, the target's top-m rows of each example.

    `target` is the model, or its `Frozen` holder, placed on `trainer`'s devices only when the pass runs."""

    key_file = KEY_FILE

    def __init__(
        self,
        path: Path,
        target: nn.Module | Frozen,
        trainer: Any,
        key: dict[str, Any],
        datamodule: Any,
        chunk_size: int,
        max_shard_size: str | None,
    ) -> None:
        self.path, self.target, self.trainer, self._key = path, target, trainer, key
        self.datamodule, self.chunk_size, self.max_shard_size = datamodule, chunk_size, max_shard_size

    @torch.no_grad()
    def compute(self, name: str, rank: int, world_size: int) -> datasets.Dataset:
        target = placed(self.target, self.trainer)
        target.eval()
        args = (self._key["vocab_size"], self._key["m"], self.chunk_size, rank, world_size)
        part = _score_split(target, self.datamodule, name, *args)
        log.info("cached the target's top-%d distributions of %s (this rank's share)", self._key["m"], name)
        return part


@torch.no_grad()
def build_target_cache(
    path: str | Path,
    target: nn.Module,
    tokenizer: Any,
    datamodule: Any,
    vocab_size: int,
    m: int = 64,
    chunk_size: int = CHUNK_SIZE,
    max_shard_size: str = MAX_SHARD_SIZE,
    splits: tuple[str, ...] = ("train", "validation"),
    identity: str | None = None,
) -> CachedTarget:
    """Run the target once over each split and store its top-m answer distributions under `path`.

    When a process group is running (a Trainer's strategy), the ranks share the pass: each scores its share of the
    batches (`specdistill.utils.distributed`), writes its part beside the cache, and rank 0 merges the parts into
    the one cache (refusing a lost example) and writes the key last; every rank returns the same cache
    (`specdistill.caches.build_or_reuse`).

    Args:
        path: output directory (overwritten).
        target: the frozen target, on the device the scoring batches should use (or a ZeRO-3 engine: give
            `identity` then, computed before the weights were partitioned).
        tokenizer: the shared tokenizer (fingerprinted).
        datamodule: a `TaskDataModule`; its `scoring_dataloader(split)` is scored for every split.
        vocab_size: the tokenizer's real vocabulary.
        m: cached tokens per answer position (at most V; m = V stores the exact distribution).
        chunk_size: answer rows projected to logits at once.
        max_shard_size: arrow shard size on disk.
        splits: the splits to cache (training reads "train", validation "validation").
        identity: `model_identity(target)`; computed here when None.
    """
    _check_m(m, vocab_size)
    key = cache_key(identity or model_identity(target), tokenizer, datamodule, vocab_size, m, tuple(splits))
    cache = _TargetPass(Path(path), target, None, key, datamodule, chunk_size, max_shard_size)
    key, tables = build_or_reuse(cache, reuse=False)
    return CachedTarget(path, key, tables)


_FEATURES = datasets.Features(
    {
        "example_id": datasets.Value("int64"),
        "log_probs": datasets.Sequence(datasets.Value("float32")),
        "token_ids": datasets.Sequence(datasets.Value("int32")),
        "tail_mass": datasets.Sequence(datasets.Value("float32")),
    }
)


def _score_split(
    target: nn.Module,
    datamodule: Any,
    split: str,
    vocab_size: int,
    m: int,
    chunk_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> datasets.Dataset:
    """This rank's examples of `split` (all of them for one rank), in the order scored."""
    device = next(target.parameters()).device
    columns: dict[str, list] = {name: [] for name in _FEATURES}
    loader = datamodule.scoring_dataloader(split)
    if is_sharded(loader):  # the datamodule gives this rank its share already
        rank, world_size = 0, 1
    for batch, counts in batches_of_rank(loader, rank, world_size):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        keep = answer_mask(batch["labels"])
        rows = answer_rows(target, batch, keep, vocab_size)
        pieces = [
            top_m(rows.logits(*rows.inputs(s, s + chunk_size)), m) for s in range(0, len(rows), chunk_size)
        ]
        if not counts:  # kept step with the other ranks; the result is discarded
            continue
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
    return datasets.Dataset.from_dict(columns, features=_FEATURES)


class CachedTarget:
    """The target's cached answer distributions, served per batch as `SparseRows` (no target model needed).

    Build with `build_target_cache`, or open with `CachedTarget.load`, which checks the key.
    """

    def __init__(
        self, path: str | Path, key: Mapping[str, Any], tables: Mapping[str, datasets.Dataset] | None = None
    ) -> None:
        self.path = Path(path)
        self.key = dict(key)
        self.vocab_size = int(key["vocab_size"])
        self.m = int(key["m"])
        tables = tables if tables is not None else load_tables(self.path, list(key["data"]))
        self._splits = {split: tables[split].with_format("numpy") for split in key["data"]}

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
        tokenised splits, vocabulary and m; raise a ValueError naming what differs otherwise.

        Its tables are verified against the digests its key file recorded (`specdistill.caches.store.load_checked`):
        without the target they cannot be recomputed here, so a table changed, truncated or missing since it was
        written, or a cache written without digests, raises a one-line `InputFileError` naming it and the fix."""
        stored = read_key(path, KEY_FILE)
        if stored is None:
            raise ValueError(
                f"{path} holds no cached target distributions ({KEY_FILE} is missing): build them with "
                "build_target_cache(path, target, tokenizer, datamodule, vocab_size, m)"
            )
        wanted = cache_key(model, tokenizer, datamodule, vocab_size, m, splits)
        names = {"model": "target model", "tokenizer": "tokenizer", "data": "dataset (tokenised splits)"}
        differing = [names.get(k, k) for k in wanted if stored.get(k) != wanted[k]]
        if differing:
            raise ValueError(
                f"the cached target distributions in {path} were built from another {', '.join(differing)} than "
                "this run uses; rebuild them with build_target_cache for this target, tokenizer and dataset, or "
                "point the run at the matching cache"
            )
        fix = "rebuild the cache with build_target_cache(path, target, tokenizer, datamodule, vocab_size, m)"
        return cls(path, inputs_of(stored), load_checked(path, KEY_FILE, stored, list(stored["data"]), fix))

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


class CacheOnceTarget(CachedTarget, FitStartCache):
    """`CachedTarget` that builds the cache itself, once, where the Trainer placed the target.

    At fit start (`specdistill.caches.prepare_caches`, called by `DistillModule`) the cache at `path` is reused if
    its key matches: this target's config and every weight (`model_identity`, taken here, before a ZeRO-3 placement
    partitions the weights), tokenizer, data and m; else the target is placed like any frozen model (the
    strategy's device, or ZeRO-3 shards) and all ranks rebuild it together (`build_or_reuse`). The target is released
    afterwards.

    Args:
        target: the frozen target, or its `Frozen` holder when another provider places the same model
            (`ScoreOnceReference`), so that it is placed (and hashed) once.
        path, tokenizer, datamodule, vocab_size, m: as for `build_target_cache` (train and validation are cached).
    """

    def __init__(
        self,
        target: nn.Module | Frozen,
        path: str | Path,
        tokenizer: Any,
        datamodule: Any,
        vocab_size: int,
        m: int,
    ) -> None:
        _check_m(m, vocab_size)
        self.path, self.vocab_size, self.m = Path(path), int(vocab_size), int(m)
        self.key, self._splits = {}, {}
        self._frozen: Frozen | None = target if isinstance(target, Frozen) else Frozen(target)
        identity = model_identity(self._frozen.model, self._frozen.weights_digest())
        self._key = cache_key(identity, tokenizer, datamodule, vocab_size, m, ("train", "validation"))
        self._datamodule = datamodule

    @property
    def ready(self) -> bool:
        return self._frozen is None

    def prepare(self, fit_start: FitStart) -> None:
        cache = _TargetPass(
            self.path,
            self._frozen,
            fit_start.trainer,
            self._key,
            self._datamodule,
            CHUNK_SIZE,
            MAX_SHARD_SIZE,
        )
        self.key, tables = build_or_reuse(cache)
        self._splits = {split: tables[split].with_format("numpy") for split in self.key["data"]}
        self._frozen = self._datamodule = None

    def rows(self, batch: Mapping[str, Any], keep: torch.Tensor, split: str) -> SparseRows:
        if self._frozen is not None:
            raise RuntimeError(
                "the cached target distributions are built at fit start (prepare_caches, called by DistillModule "
                "under a Trainer); outside a Trainer build them with build_target_cache"
            )
        return super().rows(batch, keep, split)
