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
import shutil
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
from specdistill.models.frozen import Frozen
from specdistill.utils.distributed import batches_of_rank, is_sharded, rank_and_world_size

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
    identity: str | None = None,
) -> CachedTarget:
    """Run the target once over each split and store its top-m answer distributions under `path`.

    When a process group is running (a Trainer's strategy), the ranks share the pass: each scores its share of the
    batches (`specdistill.utils.distributed`), writes its part beside the cache, and rank 0 merges the parts into
    the one cache (refusing a lost example) and writes the key last; every rank returns the same cache.

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
    if not 1 <= m <= vocab_size:
        raise ValueError(f"m must lie in [1, vocab_size={vocab_size}] cached tokens per position, got {m}")
    path = Path(path)
    rank, world_size = rank_and_world_size()
    key = cache_key(identity or model_identity(target), tokenizer, datamodule, vocab_size, m, tuple(splits))
    if rank == 0:
        # the key marks a complete cache: an older one must not vouch for a half-rebuilt cache
        (path / KEY_FILE).unlink(missing_ok=True)
        shutil.rmtree(path / _PARTS_DIR, ignore_errors=True)  # parts of an interrupted pass
    if world_size > 1:
        torch.distributed.barrier()
    target.eval()
    for split in splits:
        part = _score_split(target, datamodule, split, vocab_size, m, chunk_size, rank, world_size)
        if world_size > 1:
            # a rank with no batch of this split writes no part (datasets cannot reload an empty one)
            if len(part):
                part.save_to_disk(str(_part_path(path, split, rank)))
            torch.distributed.barrier()  # every rank's part is written
            if rank == 0:
                written = [_part_path(path, split, r) for r in range(world_size)]
                parts = [datasets.load_from_disk(str(p)) for p in written if p.is_dir()]
                part = datasets.concatenate_datasets(parts) if parts else part
        if rank == 0:
            dataset = _merged(part, split, len(datamodule.tokenized(split)))
            dataset.save_to_disk(str(path / split), max_shard_size=max_shard_size)
            log.info("cached the target's top-%d distributions of %d %s examples", m, len(dataset), split)
    if rank == 0:
        shutil.rmtree(path / _PARTS_DIR, ignore_errors=True)
        (path / KEY_FILE).write_text(json.dumps(key, indent=1))
    if world_size > 1:
        torch.distributed.barrier()  # rank 0 has written the one cache
    return CachedTarget(path, key)


_FEATURES = datasets.Features(
    {
        "example_id": datasets.Value("int64"),
        "log_probs": datasets.Sequence(datasets.Value("float32")),
        "token_ids": datasets.Sequence(datasets.Value("int32")),
        "tail_mass": datasets.Sequence(datasets.Value("float32")),
    }
)
_PARTS_DIR = ".rank_parts"


def _part_path(path: Path, split: str, rank: int) -> Path:
    return path / _PARTS_DIR / split / f"rank{rank}"


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


def _merged(dataset: datasets.Dataset, split: str, num_examples: int) -> datasets.Dataset:
    """`dataset` in `example_id` order, one row per example (a sharded dataloader may pad a rank's share with
    repeats); raises unless the ids are exactly 0..num_examples-1."""
    ids = np.asarray(dataset["example_id"], dtype=np.int64)
    _, first = np.unique(ids, return_index=True)  # sorted by id, the first copy of each
    dataset = dataset.select(first.tolist())
    if dataset["example_id"] != list(range(num_examples)):
        raise ValueError(
            f"the {split} scoring dataloader must yield every example_id 0..{num_examples - 1}; it yielded "
            f"{len(dataset)} distinct ids"
        )
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

    def place(self, trainer: Any) -> None:
        """Nothing to place: the cache is read from disk (`CacheOnceTarget` builds itself here)."""

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


class CacheOnceTarget(CachedTarget):
    """`CachedTarget` that builds the cache itself, once, where the Trainer placed the target.

    At fit start (`place`, called by `DistillModule`) the cache at `path` is reused if it was built from this target,
    tokenizer and data; else the target is placed like any frozen model (the strategy's device, or ZeRO-3 shards) and
    all ranks build it together (`build_target_cache`). The target is released afterwards.

    Args:
        target: the frozen target, or its `Frozen` holder when another provider places the same model
            (`ScoreOnceReference`), so that it is placed once.
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
        if not 1 <= m <= vocab_size:
            raise ValueError(
                f"m must lie in [1, vocab_size={vocab_size}] cached tokens per position, got {m}"
            )
        self.path, self.vocab_size, self.m = Path(path), int(vocab_size), int(m)
        self.key, self._splits = {}, {}
        self._frozen: Frozen | None = target if isinstance(target, Frozen) else Frozen(target)
        self._identity = model_identity(
            self._frozen.model
        )  # before a ZeRO-3 placement partitions the weights
        self._tokenizer, self._datamodule = tokenizer, datamodule

    def place(self, trainer: Any) -> None:
        if self._frozen is None:  # built already
            return
        args = (self._tokenizer, self._datamodule, self.vocab_size)
        try:
            cache = CachedTarget.load(self.path, self._identity, *args, m=self.m)
            log.info("reusing the cached target distributions in %s", self.path)
        except ValueError:
            target = self._frozen.place(trainer).model
            cache = build_target_cache(self.path, target, *args, m=self.m, identity=self._identity)
        self.key, self._splits = cache.key, cache._splits
        self._frozen = self._tokenizer = self._datamodule = None

    def rows(self, batch: Mapping[str, Any], keep: torch.Tensor, split: str) -> SparseRows:
        if self._frozen is not None:
            raise RuntimeError(
                "the cached target distributions are built at fit start (CacheOnceTarget.place under a Trainer); "
                "outside a Trainer build them with build_target_cache"
            )
        return super().rows(batch, keep, split)
