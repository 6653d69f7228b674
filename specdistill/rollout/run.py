"""`run_rollouts`: target responses, draft tokens and soft labels for every prompt, stored in resumable shards."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm

from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import DraftKind
from specdistill.rollout.generate import label_responses, row_seeds, sample_responses
from specdistill.rollout.labels import labelling_config
from specdistill.rollout.ranks import Ranks, rank_shards
from specdistill.rollout.storage import load_shards, num_shards, prepare_out_dir, read_settings, write_shard

log = logging.getLogger(__name__)

FEATURES = datasets.Features(
    {
        "prompt_index": datasets.Value("int64"),
        "prompt_ids": datasets.Sequence(datasets.Value("int32")),
        "response_ids": datasets.Sequence(datasets.Value("int32")),
        "draft_tokens": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("float32")),
    }
)


def _fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps([int(t) for t in prompt]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _shard_seed(seed: int, shard: int) -> int:
    # One seed per shard: a resumed run draws exactly what an uninterrupted run would have drawn.
    return (seed * 1_000_003 + shard) % (2**63 - 1)


def _special_ids(model: torch.nn.Module, eos_token_id, pad_token_id) -> tuple[Any, int]:
    generation_config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if eos_token_id is None:
        eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        raise ValueError(
            "the target has no eos_token_id: pass eos_token_id (the tokenizer's EOS) to run_rollouts."
        )
    if pad_token_id is None:
        pad_token_id = getattr(generation_config, "pad_token_id", None)
        if pad_token_id is None:
            # Padding is masked out of attention, so any valid id works; EOS is the usual choice.
            pad_token_id = eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0]
    return eos_token_id, int(pad_token_id)


def run_rollouts(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    out_dir: str | Path,
    sampling: SamplingConfig,
    max_new_tokens: int,
    batch_size: int,
    shard_size: int,
    seed: int,
    vocab_size: int,
    label_temperature_one: bool = False,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_shard_done: Callable[[int], None] | None = None,
    responses_from: str | Path | None = None,
    ranks: Ranks | None = None,
    responses: Sequence[Sequence[int]] | None = None,
    kind: DraftKind | None = None,
) -> datasets.Dataset:
    """Label every prompt's rollout for acceptance-head training and store the result in `out_dir`.

    Finished shards already in `out_dir` (from an interrupted run with the same settings) are kept and skipped, so
    re-running the same call resumes; each shard draws from its own seed, so the result does not depend on where the
    run was interrupted.

    Args:
        target: causal LM that generates the responses and scores the draft tokens (frozen; eval mode is set).
        draft: the draft that proposes the draft tokens (same vocabulary), of kind `kind`.
        prompts: token ids of the training prompts.
        out_dir: storage directory (see `specdistill.rollout.storage`).
        sampling: decoding warping, used for the target responses and (unless `label_temperature_one`) the labels.
        max_new_tokens: longest response.
        batch_size: prompts per generation / teacher-forcing batch.
        shard_size: prompts per shard (the unit of resumption).
        seed: base seed of every random draw.
        vocab_size: the tokenizer's real vocabulary (padded embedding rows are ignored).
        label_temperature_one: label at temperature 1 with no top-k/top-p, as the public SpecDec++ code does.
        eos_token_id: ends a response; default the target's generation config.
        pad_token_id: pads batches; default the target's generation config, else EOS.
        on_shard_done: called with the shard index after each shard is saved (progress hooks, tests).
        responses_from: a finished rollout directory made with the same prompts, sampling, seed, budget and shards
            (e.g. for another draft): its target responses are reused instead of generated again. They are exactly
            what this call would generate (the same per-shard seeds), so only the labelling passes run.
        ranks: the processes sharing this call (`specdistill.rollout.ranks.Ranks`; default one): every rank makes
            the same call, rolls out only its shards (`rank_shards`) and, after a barrier, loads the whole dataset.
            The result is the same for any number of ranks.
        responses: the target's responses to `prompts`, generated elsewhere (e.g. by vLLM,
            `specdistill.rollout.vllm_backend`): only the labelling passes run, the target's probabilities coming
            from a teacher-forced pass, so the labels are exact for these responses. Recorded by their sha256: a
            resumed run must be given the same ones.
        kind: the draft's kind (`specdistill.drafts.DraftKind`), whose teacher-forced pass gives the draft's
            distributions (`DraftKind.teacher_forced`); default a causal LM's own pass.

    Returns:
        The whole rollout dataset (`load_rollouts(out_dir)`), on every rank.
    """
    for name, value in {
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "shard_size": shard_size,
    }.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1.")
    if len(prompts) == 0:
        raise ValueError("no prompts to roll out.")
    if responses is not None and responses_from is not None:
        raise ValueError(
            "give the responses (responses=...) or a rollout to reuse them from (responses_from=...), not both"
        )
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(
            f"{len(responses)} responses were given for {len(prompts)} prompts: one per prompt is needed"
        )
    eos_token_id, pad_token_id = _special_ids(target, eos_token_id, pad_token_id)
    label_sampling = labelling_config(sampling, label_temperature_one)
    settings = {
        "kind": "rollouts",
        "format_version": 2,  # 2: a generator per prompt (1: one per shard, via generate)
        "num_prompts": len(prompts),
        "prompts_sha256": _fingerprint(prompts),
        "shard_size": shard_size,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "vocab_size": vocab_size,
        "sampling": asdict(sampling),
        "label_sampling": asdict(label_sampling),
        "label_temperature_one": label_temperature_one,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        # how the responses were made: "sampled" here (per-prompt seeds), or the sha256 of the ones given
        "responses": "sampled" if responses is None else _fingerprint(responses),
    }
    ranks = ranks or Ranks()
    reused = _reusable_responses(responses_from, settings) if responses_from is not None else None
    if responses is not None:
        reused = [list(r) for r in responses]
    finished = set(prepare_out_dir(out_dir, settings, write=ranks.is_main))
    ranks.barrier()  # the directory exists, leftovers are gone, before any rank writes a shard
    total_shards = num_shards(len(prompts), shard_size)
    mine = rank_shards(total_shards, ranks.rank, ranks.world_size)
    if finished:
        log.info(
            "resuming rollouts in %s: %d of %d shards already done", out_dir, len(finished), total_shards
        )
    target.eval()
    draft.eval()

    def prompts_in(shards: Iterable[int]) -> int:
        return sum(min(shard_size, len(prompts) - s * shard_size) for s in shards)

    with tqdm(
        total=prompts_in(mine), initial=prompts_in(finished.intersection(mine)), unit="prompt",
        desc="rollouts" if ranks.world_size == 1 else f"rollouts (rank {ranks.rank})",
    ) as progress:  # fmt: skip
        for shard in mine:
            if shard in finished:
                continue
            indices = range(shard * shard_size, min((shard + 1) * shard_size, len(prompts)))
            columns = _roll_out_shard(
                target,
                draft,
                [list(prompts[i]) for i in indices],
                list(indices),
                sampling=sampling,
                label_sampling=label_sampling,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                shard_seed=_shard_seed(seed, shard),
                vocab_size=vocab_size,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                progress=progress,
                responses=None if reused is None else [reused[i] for i in indices],
                kind=kind or DraftKind(),
            )
            write_shard(out_dir, shard, columns, FEATURES)
            if on_shard_done is not None:
                on_shard_done(shard)
    ranks.barrier()  # every shard is written: loading checks that none is missing or duplicated
    return load_rollouts(out_dir)


def _roll_out_shard(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: list[list[int]],
    indices: list[int],
    *,
    sampling: SamplingConfig,
    label_sampling: SamplingConfig,
    max_new_tokens: int,
    batch_size: int,
    shard_seed: int,
    vocab_size: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    progress: tqdm,
    responses: list[list[int]] | None = None,
    kind: DraftKind,
) -> dict[str, list]:
    """Columns of one shard: `prompts[j]` is the prompt with index `indices[j]`; `responses`, when given, are the
    shard's target responses (generated otherwise)."""
    draft_device = next(draft.parameters()).device
    generator = torch.Generator(device=draft_device).manual_seed(shard_seed)
    columns: dict[str, list] = {name: [] for name in FEATURES}
    for start in range(0, len(indices), batch_size):
        batch_indices = indices[start : start + batch_size]
        batch_prompts = prompts[start : start + batch_size]
        target_logits = None  # reused responses: the target scores them in a teacher-forced pass
        if responses is None:
            # one target pass: the generation's own logits are the labels' target distribution
            batch_responses, target_logits = sample_responses(
                target, batch_prompts, sampling, max_new_tokens, eos_token_id, pad_token_id, vocab_size,
                seeds=row_seeds(shard_seed, batch_indices),
            )  # fmt: skip
        else:
            batch_responses = responses[start : start + batch_size]
        tokens, labels = label_responses(
            target, draft, batch_prompts, batch_responses, label_sampling, pad_token_id, vocab_size, generator,
            target_logits=target_logits, kind=kind,
        )  # fmt: skip
        columns["prompt_index"] += batch_indices
        columns["prompt_ids"] += batch_prompts
        columns["response_ids"] += batch_responses
        columns["draft_tokens"] += tokens
        columns["labels"] += labels
        progress.update(len(batch_indices))
    return columns


# settings that decide the target responses (the labels also depend on the draft and the labelling warping)
_RESPONSE_SETTINGS = (
    "num_prompts", "prompts_sha256", "shard_size", "seed", "max_new_tokens", "vocab_size", "sampling",
    "eos_token_id", "pad_token_id", "responses",
)  # fmt: skip


def _reusable_responses(source_dir: str | Path, settings: dict[str, Any]) -> list[list[int]]:
    """The response of every prompt in `source_dir`, after checking it was generated exactly as this run would."""
    source = read_settings(source_dir)
    differing = [k for k in _RESPONSE_SETTINGS if source.get(k) != settings[k]]
    if differing:
        raise ValueError(
            f"cannot reuse the responses in {source_dir}: they were generated with other {', '.join(differing)}. "
            "Drop responses_from, or point it at rollouts of the same prompts and settings."
        )
    return [list(r) for r in load_rollouts(source_dir)["response_ids"]]


def load_rollouts(out_dir: str | Path) -> datasets.Dataset:
    """The complete rollout dataset in prompt order (columns: prompt_index, prompt_ids, response_ids, draft_tokens,
    labels); raises if a shard is missing or an example is duplicated or lost."""
    settings = read_settings(out_dir)
    if settings.get("kind", "rollouts") != "rollouts":
        raise ValueError(f"{out_dir} holds a {settings['kind']}, not rollouts.")
    return load_shards(out_dir)
