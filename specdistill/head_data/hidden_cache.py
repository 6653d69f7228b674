"""Cache of the head's inputs at the judged positions, so head training need not run the draft every epoch.

For a candidate head the mixing of each example is drawn once (seeded by `(seed, prompt_index)`) and frozen into the
cache: every epoch then sees the same mixed sequence Z, unlike uncached training, which redraws Z each epoch. A
proposer head's inputs (no mixing) are the same every epoch anyway. Rows hold `prompt_index`, `hidden (n, D)` (the
head inputs, in order: hidden states, plus the draft features for a proposer head) and `head_labels (n,)`.

The cache is a fit-start cache (`specdistill.caches`): `HiddenCache` is built by `prepare_caches`, which
`AcceptanceHeadModule` calls at fit (or validation) start, with the draft where the Trainer's strategy places it; the
ranks share the pass (each runs its share of every shard's batches, rank 0 merges) and `RolloutDataModule` reads the
rows once it is ready. `build_hidden_cache` builds the same cache outside a Trainer.

Layout of the cache directory: one table per shard of `shard_size` rollouts, `shards/shard_00000/` ... (a `datasets`
dataset whose `example_id` is the rollout's index within its shard), and the key `specdistill_hidden_cache.json`:
the draft's `weights_digest` (every weight), the rollouts' fingerprint and settings, and the mixing, sampling and
storage settings. A directory whose key differs (a draft retrained into the same path, other rollouts or settings)
is rebuilt; an interrupted build with the same key resumes at the first unfinished shard (`SharedPass.resumable`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn
from torch.utils.data import DataLoader

from specdistill.caches.fit_start import FitStart, FitStartCache
from specdistill.caches.store import SharedPass, build_or_reuse, load_checked, read_key
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import DraftKind
from specdistill.head_data.collate import RolloutCollator
from specdistill.head_data.inputs import judged_head_inputs
from specdistill.models.acceptance_head import NUM_DRAFT_FEATURES
from specdistill.models.frozen import Frozen, digest_of, placed
from specdistill.rollout.run import load_rollouts
from specdistill.rollout.storage import num_shards, read_settings
from specdistill.utils.distributed import batches_of_rank

log = logging.getLogger(__name__)

KEY_FILE = "specdistill_hidden_cache.json"
_DTYPES = {"float16": torch.float16, "float32": torch.float32}


class HiddenCache(FitStartCache):
    """The head inputs of every rollout, computed once by the frozen draft at fit start (or reused from `path`).

    The key is taken here (the draft's digest before a ZeRO-3 placement partitions its weights); `prepare` (called
    by `prepare_caches`) places the draft for the Trainer's strategy, lets every rank run its share of each shard
    (`build_or_reuse`), keeps the merged rows (`dataset`) and releases the draft.

    Args:
        draft: the frozen draft the head is trained for (or its `Frozen` holder).
        rollout_dir: output of `run_rollouts`.
        path: cache directory (resumable; rebuilt when it holds a cache of another draft, rollouts or settings).
        mixing_ratio: r of the mixed sequence.
        seed: seed of the per-example mixing.
        batch_size: rollouts per draft forward pass.
        shard_size: rollouts per stored shard (the unit a resumed build keeps).
        pad_token_id: padding id.
        dtype: storage dtype of the hidden states: float16 or float32.
        head_input: `"candidate"` or `"proposer"` (`specdistill.models.acceptance_head`).
        sampling: decoding settings whose `policy_probs` a proposer head reads (default: greedy).
        kind: the draft's kind, whose teacher-forced pass gives the head inputs (default `DraftKind()`, a causal
            LM; `specdistill.head_data.judged_head_inputs`).
        target: the frozen target (or its `Frozen` holder), needed when the kind reads its hidden states
            (`DraftKind.reads_target`: an EAGLE-3 head); its weights are then part of the key.
    """

    def __init__(
        self,
        draft: nn.Module | Frozen,
        rollout_dir: str | Path,
        path: str | Path,
        mixing_ratio: float = 0.15,
        seed: int = 0,
        batch_size: int = 8,
        shard_size: int = 1024,
        pad_token_id: int = 0,
        dtype: str = "float16",
        head_input: str = "candidate",
        sampling: SamplingConfig | None = None,
        kind: DraftKind | None = None,
        target: nn.Module | Frozen | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
        self.path = Path(path)
        self._pass: _HiddenPass | None = _HiddenPass(
            self.path,
            draft if isinstance(draft, Frozen) else Frozen(draft),
            rollout_dir,
            mixing_ratio,
            seed,
            batch_size,
            shard_size,
            pad_token_id,
            dtype,
            head_input,
            sampling or SamplingConfig(greedy=True),
            kind or DraftKind(),
            None if target is None or isinstance(target, Frozen) else Frozen(target),
        )
        self.key = self._pass.key()
        self._dataset: datasets.Dataset | None = None

    @property
    def num_examples(self) -> int:
        """Rows of the cache (one per rollout), known before it is built."""
        return int(self.key["num_prompts"])

    @property
    def ready(self) -> bool:
        return self._pass is None

    def prepare(self, fit_start: FitStart) -> None:
        self._pass.trainer = fit_start.trainer
        _, tables = build_or_reuse(self._pass)
        self._dataset = _concatenated(tables)
        self._pass = None  # releases the draft (and the trainer)

    @property
    def dataset(self) -> datasets.Dataset:
        """The complete cache in prompt order (columns `prompt_index`, `hidden`, `head_labels`)."""
        if self._dataset is None:
            raise RuntimeError(
                f"the hidden cache at {self.path} is built at fit start (prepare_caches, called by "
                "AcceptanceHeadModule(hidden_cache=...) under a Trainer); outside a Trainer use build_hidden_cache"
            )
        return self._dataset


class _HiddenPass(SharedPass):
    """The hidden cache as a `SharedPass`: one table per shard of rollouts, the head inputs of each rollout.

    `draft` (and `target`, for a kind that reads it) are held `Frozen`, placed on `trainer`'s devices only when the
    pass runs."""

    key_file = KEY_FILE
    resumable = True

    def __init__(
        self,
        path: Path,
        draft: Frozen,
        rollout_dir: str | Path,
        mixing_ratio: float,
        seed: int,
        batch_size: int,
        shard_size: int,
        pad_token_id: int,
        dtype: str,
        head_input: str,
        sampling: SamplingConfig,
        kind: DraftKind,
        target: Frozen | None,
    ) -> None:
        if kind.reads_target and target is None:
            raise ValueError(
                "this draft reads the target's hidden states (an EAGLE-3 head): give the target to HiddenCache "
                "(target=...)"
            )
        self.path, self.draft, self.trainer = path, draft, None
        self.kind, self.target = kind, target if kind.reads_target else None
        self.rollouts = load_rollouts(rollout_dir)
        self.rollout_settings = read_settings(rollout_dir)
        self.batch_size, self.shard_size, self.dtype, self.sampling = batch_size, shard_size, dtype, sampling
        self.mixing_ratio, self.seed, self.head_input = mixing_ratio, seed, head_input
        self.collate = RolloutCollator(pad_token_id, mixing_ratio, seed, head_input)
        self.width = int(draft.model.config.hidden_size) + (
            NUM_DRAFT_FEATURES if head_input == "proposer" else 0
        )
        self._key = {
            "kind": "hidden_cache",
            "head_input": head_input,
            "sampling": asdict(sampling),
            "num_prompts": len(self.rollouts),
            "shard_size": shard_size,
            "mixing_ratio": mixing_ratio,
            "seed": seed,
            "dtype": dtype,
            "input_size": self.width,  # the head's input width (AcceptanceHead.input_size)
            "rollout_settings_sha256": hashlib.sha256(
                repr(sorted(self.rollout_settings.items())).encode()
            ).hexdigest(),
            "rollouts_fingerprint": self.rollouts._fingerprint,  # the stored rollouts themselves
            "draft_weights": digest_of(draft),  # before a ZeRO-3 placement partitions the weights
        }
        if self.target is not None:  # the head inputs are the draft's reading of the target's states
            self._key.update(draft_kind=kind.record(), target_weights=digest_of(self.target))

    def key(self) -> dict[str, Any]:
        return self._key

    def sizes(self) -> dict[str, int]:
        count = len(self.rollouts)
        return {
            _table(shard): min(self.shard_size, count - shard * self.shard_size)
            for shard in range(num_shards(count, self.shard_size))
        }

    @torch.no_grad()
    def compute(self, name: str, rank: int, world_size: int) -> datasets.Dataset:
        draft = placed(self.draft, self.trainer)
        draft.eval()
        target = None if self.target is None else placed(self.target, self.trainer).eval()
        device = next(draft.parameters()).device
        start = int(name.rsplit("_", 1)[1]) * self.shard_size
        rows = self.rollouts.select(range(start, start + self.sizes()[name]))
        columns: dict[str, list] = {"example_id": [], "prompt_index": [], "hidden": [], "head_labels": []}
        # the shard's batches are those of one process (the same rollouts in each), dealt to the ranks in turn
        loader = DataLoader(rows, batch_size=self.batch_size, collate_fn=self.collate)
        for batch, counts in batches_of_rank(loader, rank, world_size):
            on_device = {key: value.to(device) for key, value in batch.items()}
            inputs = judged_head_inputs(
                draft, on_device, self.head_input, self.sampling, self.kind, target
            ).float()
            if not counts:  # kept in step with the other ranks (ZeRO-3 gathers are collective); discarded
                continue
            per_example = inputs.split(batch["loss_mask"].sum(1).tolist())
            for i, example_inputs in enumerate(per_example):
                columns["example_id"].append(int(batch["example_id"][i]) - start)
                columns["prompt_index"].append(int(batch["example_id"][i]))
                columns["hidden"].append(example_inputs.to(_DTYPES[self.dtype]).cpu().numpy())
                columns["head_labels"].append(batch["head_labels"][i][batch["loss_mask"][i]].tolist())
        log.info("hidden cache: %s of %d rollouts (this rank's share)", name, len(rows))
        return datasets.Dataset.from_dict(columns, features=self.features())

    def features(self) -> datasets.Features:
        return datasets.Features(
            {
                "example_id": datasets.Value("int64"),
                "prompt_index": datasets.Value("int64"),
                "hidden": datasets.Array2D(shape=(None, self.width), dtype=self.dtype),
                "head_labels": datasets.Sequence(datasets.Value("float32")),
            }
        )


def _table(shard: int) -> str:
    return f"shards/shard_{shard:05d}"


def _concatenated(tables: dict[str, datasets.Dataset]) -> datasets.Dataset:
    """The shards' rows in prompt order, without the per-shard `example_id`."""
    return datasets.concatenate_datasets([tables[name] for name in tables]).remove_columns("example_id")


def build_hidden_cache(
    draft: nn.Module, rollout_dir: str | Path, out_dir: str | Path, *args: Any, **settings: Any
) -> datasets.Dataset:
    """Run the frozen draft once over every rollout (where it is) and store the head's inputs at the judged positions.

    The same cache as `HiddenCache(draft, rollout_dir, out_dir, *args, **settings)` builds at fit start (`args`
    and `settings`: its other arguments, `mixing_ratio` to `sampling`); with a process group running the ranks
    share the pass.

    Returns:
        The complete cache in prompt order (as `load_hidden_cache` reads it).
    """
    cache = HiddenCache(draft, rollout_dir, out_dir, *args, **settings)
    cache.prepare(FitStart(trainer=None))
    return cache.dataset


def check_hidden_cache(
    key: dict[str, Any],
    path: str | Path,
    expected_mixing_ratio: float | None = None,
    expected_head_input: str | None = None,
) -> None:
    """Raise unless the cache keyed `key` (at `path`) holds inputs for this head input and (candidate heads) ratio."""
    cached_input = key.get("head_input", "candidate")
    if expected_head_input is not None and cached_input != expected_head_input:
        raise ValueError(
            f"the hidden cache at {path} holds {cached_input} head inputs, not {expected_head_input}: rebuild it "
            "for this head."
        )
    if (
        expected_mixing_ratio is not None
        and cached_input == "candidate"
        and key["mixing_ratio"] != expected_mixing_ratio
    ):
        raise ValueError(
            f"the hidden cache at {path} was built with mixing_ratio={key['mixing_ratio']}, not "
            f"{expected_mixing_ratio}: rebuild it or use the same ratio."
        )


def load_hidden_cache(
    out_dir: str | Path, expected_mixing_ratio: float | None = None, expected_head_input: str | None = None
) -> datasets.Dataset:
    """The complete cache in prompt order; checks the head input and (candidate heads) the mixing ratio if given.

    Opened by path only (no draft to recompute it), its shards are verified against the digests its key file
    recorded (`specdistill.caches.store.load_checked`): a shard changed, truncated or missing since it was written,
    or a cache written without digests, raises a one-line `InputFileError` naming it and the fix."""
    key = read_key(out_dir, KEY_FILE)
    if key is None:
        raise ValueError(
            f"{out_dir} is not a complete hidden-state cache ({KEY_FILE} is missing): build it with "
            "build_hidden_cache, or let AcceptanceHeadModule(hidden_cache=HiddenCache(...)) build it at fit start."
        )
    check_hidden_cache(key, out_dir, expected_mixing_ratio, expected_head_input)
    count, shard_size = int(key["num_prompts"]), int(key["shard_size"])
    names = [_table(s) for s in range(num_shards(count, shard_size))]
    fix = "rebuild it with build_hidden_cache, or let AcceptanceHeadModule(hidden_cache=HiddenCache(...)) build it"
    return _concatenated(load_checked(out_dir, KEY_FILE, key, names, fix))
