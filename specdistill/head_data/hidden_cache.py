"""Cache of the head's inputs at the judged positions, so head training need not run the draft every epoch.

For a candidate head the mixing of each example is drawn once (seeded by `(seed, prompt_index)`) and frozen into the
cache: every epoch then sees the same mixed sequence Z, unlike uncached training, which redraws Z each epoch. A
proposer head's inputs (no mixing) are the same every epoch anyway. Rows hold `prompt_index`, `hidden (n, D)` (the
head inputs, in order: hidden states, plus the draft features for a proposer head) and `head_labels (n,)`. Stored
like rollouts, in resumable shards.

The cache's settings are its key: they hold the draft's `weights_digest` (every weight), the rollouts' fingerprint
and settings, and the mixing, sampling and storage settings. A directory whose key differs (a draft retrained into the
same path, other rollouts or settings) is rebuilt from scratch, as the fit-start caches are
(`specdistill.caches.store`); one with the same key resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

import datasets
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from specdistill.caches.digest import weights_digest
from specdistill.decoding.sampling import SamplingConfig
from specdistill.head_data.collate import RolloutCollator
from specdistill.head_data.inputs import judged_head_inputs
from specdistill.models.acceptance_head import NUM_DRAFT_FEATURES
from specdistill.rollout.run import load_rollouts
from specdistill.rollout.storage import (
    load_shards,
    num_shards,
    prepare_out_dir,
    read_settings,
    write_shard,
)

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@torch.no_grad()
def build_hidden_cache(
    draft: torch.nn.Module,
    rollout_dir: str | Path,
    out_dir: str | Path,
    mixing_ratio: float = 0.15,
    seed: int = 0,
    batch_size: int = 8,
    shard_size: int = 1024,
    pad_token_id: int = 0,
    dtype: str = "float16",
    head_input: str = "candidate",
    sampling: SamplingConfig | None = None,
) -> datasets.Dataset:
    """Run the frozen draft once over every rollout and store the head's inputs at the judged positions.

    Args:
        draft: the frozen draft the head is trained for.
        rollout_dir: output of `run_rollouts`.
        out_dir: cache directory (resumable; rebuilt when it holds a cache of another draft, rollouts or settings).
        mixing_ratio: r of the mixed sequence.
        seed: seed of the per-example mixing.
        batch_size: rollouts per draft forward pass.
        shard_size: rollouts per stored shard.
        pad_token_id: padding id.
        dtype: storage dtype of the hidden states: float16 or float32.
        head_input: `"candidate"` or `"proposer"` (`specdistill.models.acceptance_head`).
        sampling: decoding settings whose `policy_probs` a proposer head reads (default: greedy).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    rollouts = load_rollouts(rollout_dir)
    rollout_settings = read_settings(rollout_dir)
    sampling = sampling or SamplingConfig(greedy=True)
    width = int(draft.config.hidden_size) + (NUM_DRAFT_FEATURES if head_input == "proposer" else 0)
    settings = {
        "kind": "hidden_cache",
        "head_input": head_input,
        "sampling": asdict(sampling),
        "num_prompts": len(rollouts),
        "shard_size": shard_size,
        "mixing_ratio": mixing_ratio,
        "seed": seed,
        "dtype": dtype,
        "input_size": width,  # the head's input width (AcceptanceHead.input_size)
        "rollout_settings_sha256": hashlib.sha256(
            repr(sorted(rollout_settings.items())).encode()
        ).hexdigest(),
        "rollouts_fingerprint": rollouts._fingerprint,  # the stored rollouts themselves
        "draft_weights": weights_digest(draft),
    }
    _drop_stale(out_dir, settings)
    finished = set(prepare_out_dir(out_dir, settings))
    features = datasets.Features(
        {
            "prompt_index": datasets.Value("int64"),
            "hidden": datasets.Array2D(shape=(None, width), dtype=dtype),
            "head_labels": datasets.Sequence(datasets.Value("float32")),
        }
    )
    collate = RolloutCollator(pad_token_id, mixing_ratio, seed, head_input)
    device = next(draft.parameters()).device
    draft.eval()
    for shard in tqdm(range(num_shards(len(rollouts), shard_size)), desc="hidden cache", unit="shard"):
        if shard in finished:
            continue
        rows = rollouts.select(range(shard * shard_size, min((shard + 1) * shard_size, len(rollouts))))
        columns: dict[str, list] = {"prompt_index": [], "hidden": [], "head_labels": []}
        for batch in DataLoader(rows, batch_size=batch_size, collate_fn=collate):
            on_device = {key: value.to(device) for key, value in batch.items()}
            inputs = judged_head_inputs(draft, on_device, head_input, sampling).float()
            per_example = inputs.split(batch["loss_mask"].sum(1).tolist())
            for i, example_inputs in enumerate(per_example):
                columns["prompt_index"].append(int(batch["example_id"][i]))
                columns["hidden"].append(example_inputs.to(_DTYPES[dtype]).cpu().numpy())
                columns["head_labels"].append(batch["head_labels"][i][batch["loss_mask"][i]].tolist())
        write_shard(out_dir, shard, columns, features)
    return load_hidden_cache(out_dir)


def _drop_stale(out_dir: str | Path, settings: dict) -> None:
    """Remove a hidden cache at `out_dir` built with other settings (another key), so that it is rebuilt."""
    try:
        previous = read_settings(out_dir)
    except FileNotFoundError:
        return
    if previous != settings and previous.get("kind") == "hidden_cache":
        changed = sorted(k for k in settings.keys() | previous.keys() if settings.get(k) != previous.get(k))
        log.info("rebuilding the hidden cache in %s: built with another %s", out_dir, ", ".join(changed))
        shutil.rmtree(out_dir)


def load_hidden_cache(
    out_dir: str | Path, expected_mixing_ratio: float | None = None, expected_head_input: str | None = None
) -> datasets.Dataset:
    """The complete cache in prompt order; checks the head input and (candidate heads) the mixing ratio if given."""
    settings = read_settings(out_dir)
    if settings.get("kind") != "hidden_cache":
        raise ValueError(f"{out_dir} is not a hidden-state cache (built by build_hidden_cache).")
    cached_input = settings.get("head_input", "candidate")
    if expected_head_input is not None and cached_input != expected_head_input:
        raise ValueError(
            f"the hidden cache at {out_dir} holds {cached_input} head inputs, not {expected_head_input}: rebuild it "
            "for this head."
        )
    if (
        expected_mixing_ratio is not None
        and cached_input == "candidate"
        and settings["mixing_ratio"] != expected_mixing_ratio
    ):
        raise ValueError(
            f"the hidden cache at {out_dir} was built with mixing_ratio={settings['mixing_ratio']}, not "
            f"{expected_mixing_ratio}: rebuild it or use the same ratio."
        )
    return load_shards(out_dir)
