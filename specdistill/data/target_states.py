"""Cached target states for a draft kind that reads the target's hidden states (EAGLE-3): one target pass, at fit
start, over the train and validation splits, so that training reads the states from disk instead of running the
target on every batch (`distill.target_cache=<dtype>` / `adaspec.target_cache=<dtype>`, in `target_cache_dir`;
`specdistill.data.target_source`).

Per example the cache holds the target's hidden states at the kind's layers (`target_layers`,
`output_hidden_states` indices) at every real position, `L x (layers x H)` values, and its last hidden state (after
the final norm) at the answer rows, `n x H` values, which the target's own output layer projects at training time
(the target stays loaded: an EAGLE-3 head reads its embeddings and its output layer scores the rows, but its body
never runs). Stored as `dtype` (bfloat16 by default: 2 bytes per value), so one example costs
`2 x (L x layers x H + n x H)` bytes: SmolLM2-135M (H = 576, 3 layers) at L = 300 and n = 64 about 1.1 MB, 700
examples 0.8 GB; Llama-3.1-8B (H = 4096) at L = 2048 and n = 512 about 54 MB per example, 68k ShareGPT
conversations 3.7 TB. Hence only where the user asks. bfloat16 rounds the states the head reads (the live target
in float32 on a CPU gives slightly different rows); `target_cache: float32` keeps them exact at twice the
size.

Storage and reuse go through `specdistill.caches.build_or_reuse` like the other caches (one `datasets` table per
split under `path/<split>`, columns `example_id`, `states`, `last`; the key `path/specdistill_target_states.json`
records the target's identity, the tokenizer, the tokenised splits, the layers and the dtype, and, written last, the
sha256, size and rows of each table), so each rank computes its share and a later stage with the same target and
data (a pipeline's adaspec step after distill) reuses it once rank 0 has verified the tables (a table changed or
truncated on disk is recomputed with a warning naming the folder; 1-2 s for 0.8 GB, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from specdistill.caches.fit_start import FitStart, FitStartCache
from specdistill.caches.store import build_or_reuse
from specdistill.data.packing import is_packed
from specdistill.data.target_cache import MAX_SHARD_SIZE, SplitsPass, model_identity, tokenizer_identity
from specdistill.drafts.base import TargetPass, target_states
from specdistill.losses.answers import answer_mask
from specdistill.losses.rows import HiddenRows, OutputHead
from specdistill.models.frozen import Frozen, placed
from specdistill.utils.distributed import batches_of_rank, is_sharded

log = logging.getLogger(__name__)

KEY_FILE = "specdistill_target_states.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# stored as integers of the same width (arrow has no bfloat16): the bits, viewed back on reading
_STORAGE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.float32}
_ARROW = {torch.int16: "int16", torch.float32: "float32"}
_NUMPY = {torch.int16: np.int16, torch.float32: np.float32}


def check_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"target_cache={name!r} must be one of {sorted(DTYPES)}")
    return DTYPES[name]


def _encode(values: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    return values.to(dtype).reshape(-1).view(_STORAGE[dtype]).cpu().numpy()


def _decode(values: Any, dtype: torch.dtype, width: int) -> torch.Tensor:
    storage = _STORAGE[dtype]
    flat = torch.as_tensor(np.asarray(values, dtype=_NUMPY[storage])).view(
        dtype
    )  # the stored bits, as `dtype`
    return flat.reshape(-1, width)


class _StatesPass(SplitsPass):
    """The target states as a `SharedPass`: one table per split, each example's states and answer rows."""

    key_file = KEY_FILE
    max_shard_size = MAX_SHARD_SIZE

    def __init__(
        self, path: Path, target: Frozen, trainer: Any, key: dict[str, Any], datamodule: Any
    ) -> None:
        self.path, self.target, self.trainer, self._key, self.datamodule = (
            path,
            target,
            trainer,
            key,
            datamodule,
        )

    @torch.no_grad()
    def compute(self, name: str, rank: int, world_size: int) -> datasets.Dataset:
        target = placed(self.target, self.trainer)
        layers, dtype = tuple(self._key["layers"]), DTYPES[self._key["dtype"]]
        device = next(target.parameters()).device
        columns: dict[str, list] = {"example_id": [], "states": [], "last": []}
        loader = self.datamodule.scoring_dataloader(name)
        if is_sharded(loader):
            rank, world_size = 0, 1
        for batch, counts in batches_of_rank(loader, rank, world_size):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            last, states = target_states(target, batch, layers)
            if not counts:
                continue
            fused = torch.cat([states[i] for i in layers], dim=-1)
            keep = answer_mask(batch["labels"])
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            for row, example_id in enumerate(batch["example_id"].tolist()):
                columns["example_id"].append(int(example_id))
                columns["states"].append(_encode(fused[row, : int(lengths[row])], dtype))
                columns["last"].append(_encode(last[row, :-1][keep[row]], dtype))
        log.info("cached the target's states at layers %s of %s (this rank's share)", list(layers), name)
        storage = _ARROW[_STORAGE[dtype]]
        features = datasets.Features(
            {
                "example_id": datasets.Value("int64"),
                "states": datasets.Sequence(datasets.Value(storage)),
                "last": datasets.Sequence(datasets.Value(storage)),
            }
        )
        return datasets.Dataset.from_dict(columns, features=features)


class CacheOnceTargetStates(FitStartCache):
    """The target's states for a kind's training, built (or reused) at fit start where the Trainer placed the target.

    Args:
        target: the frozen target, or its `Frozen` holder; `DistillModule` holds and places this same holder (once,
            kept placed: its embeddings and output layer are still read).
        path: where the cache lives (`distill.target_cache_dir`, or `target_cache/` in the stage's folder).
        tokenizer, datamodule: as for the target cache (train and validation are cached).
        vocab_size: the tokenizer's real vocabulary (the output layer's rows).
        layers: the kind's `target_layers`.
        dtype: `bfloat16`, `float16` or `float32`.
    """

    def __init__(
        self,
        target: nn.Module | Frozen,
        path: str | Path,
        tokenizer: Any,
        datamodule: Any,
        vocab_size: int,
        layers: Sequence[int],
        dtype: str = "bfloat16",
    ) -> None:
        self.dtype = check_dtype(dtype)
        self.path, self.vocab_size, self.layers = Path(path), int(vocab_size), tuple(int(i) for i in layers)
        self._frozen = target if isinstance(target, Frozen) else Frozen(target)
        self._datamodule: Any = datamodule
        splits = ("train", "validation")
        self._key = {
            "model": model_identity(self._frozen.model, self._frozen.weights_digest()),
            "tokenizer": tokenizer_identity(tokenizer),
            "data": {split: datamodule.tokenized(split)._fingerprint for split in splits},
            "layers": list(self.layers),
            "dtype": dtype,
        }
        self._splits: dict[str, datasets.Dataset] = {}

    @property
    def frozen(self) -> Frozen:
        """The target's holder, which the module places and reads the output layer and embeddings through."""
        return self._frozen

    @property
    def ready(self) -> bool:
        return bool(self._splits)

    def prepare(self, fit_start: FitStart) -> None:
        cache = _StatesPass(self.path, self._frozen, fit_start.trainer, self._key, self._datamodule)
        _, tables = build_or_reuse(cache)
        self._splits = {split: tables[split].with_format("numpy") for split in self._key["data"]}
        self._datamodule = None

    def target_pass(self, batch: Mapping[str, Any], keep: torch.Tensor, split: str) -> TargetPass:
        """The batch's `TargetPass` from the cache: `(B, T, H)` states per layer (zeros past each example's end; a
        packed batch's examples side by side in their rows), the answer rows `(N, H)` in the row-major order of
        `keep` `(B, T-1)` with the target's output layer."""
        if not self._splits:
            raise RuntimeError(
                "the target states are cached at fit start (prepare_caches, called by DistillModule under a "
                "Trainer); without a Trainer run the target itself"
            )
        if split not in self._splits:
            raise ValueError(f"the target states in {self.path} hold no {split!r} split")
        target = self._frozen.model
        hidden = target.config.hidden_size
        width = hidden * len(self.layers)
        ids = batch["example_id"].tolist()
        examples = self._splits[split][ids]
        b, t = batch["input_ids"].shape
        device = keep.device
        fused = torch.zeros(b, t, width, device=device, dtype=self.dtype)
        rows = []
        # where each example sits: a whole row, or a packed row's segment (`specdistill.data.packing`)
        places = (
            batch["segments"][:, :3].tolist()
            if is_packed(batch)
            else [[row, 0, int(n)] for row, n in enumerate(batch["attention_mask"].sum(dim=1).tolist())]
        )
        for (row, start, length), example_id, states, last in zip(
            places, ids, examples["states"], examples["last"], strict=True
        ):
            states = _decode(states, self.dtype, width)
            last = _decode(last, self.dtype, hidden)
            n = int(keep[row, start : start + length - 1].sum())
            if states.shape[0] != length or last.shape[0] != n:
                raise ValueError(
                    f"{split} example {example_id} has {length} tokens and {n} answer tokens in this batch but "
                    f"{states.shape[0]} and {last.shape[0]} in the cached target states ({self.path}): the cache "
                    "was built from another tokenisation; delete it or point target_cache_dir elsewhere"
                )
            fused[row, start : start + length] = states.to(device)
            rows.append(last.to(device))
        compute = next(target.parameters()).dtype
        fused = fused.to(compute)
        answer = torch.cat(rows).to(compute) if rows else fused.new_zeros((0, hidden))
        states = {layer: fused[..., k * hidden : (k + 1) * hidden] for k, layer in enumerate(self.layers)}
        return TargetPass(HiddenRows(answer, OutputHead(target, self.vocab_size)), states)


def states_bytes(length: int, answers: int, hidden: int, layers: int, dtype: str = "bfloat16") -> int:
    """Bytes one example takes in the cache: `(length x layers x hidden + answers x hidden)` values of `dtype`."""
    return (length * layers * hidden + answers * hidden) * DTYPES[dtype].itemsize
