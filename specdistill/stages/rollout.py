"""Stage `rollout`: label draft tokens with their acceptance probability under the target (SpecDec++ data).

For every draft in `rollout.drafts` (name -> export path; default the pair's draft) the target samples a response to
each training prompt, one teacher-forced draft pass (the draft's kind's, `DraftKind.teacher_forced`: an EAGLE-3 head
reads the target's states) samples a draft token at every position, and each gets the soft label min(1, p/q) under
the decoding warping (`sampling`, docs/METHODS.md section 4). Rollouts are written in shards:
re-launching the same run resumes where it stopped.

`rollout.devices` processes per node on `rollout.num_nodes` nodes share the shards (`specdistill.rollout.ranks`):
each rank loads the models, rolls out its shards and, after the others are done, reads the one merged dataset; rank 0
writes the result. A target placed with `models.target.device_map` spans the GPUs of its node, so it runs one process
per node (`rollout.devices=1`, `rollout.num_nodes=N`).

With `rollout.backend=vllm` the target's responses come from vLLM (`specdistill.rollout.vllm_backend`, one process
that parallelises the target itself, `rollout.vllm.*`), generated before our models load and kept in
`rollouts/vllm/` for a re-launch; our models then label them with exact target and draft passes.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specdistill.decoding.sampling import SamplingConfig
from specdistill.errors import ConfigError
from specdistill.rollout.generate import row_seeds
from specdistill.rollout.ranks import Ranks, launch_ranks
from specdistill.rollout.run import run_rollouts
from specdistill.rollout.vllm_backend import generate_with_vllm, target_engine, vllm_model, vllm_request
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import (
    load_frozen_target_and_drafts,
    model_spec,
    named_drafts,
    pick_device,
    shared_tokenizer,
)
from specdistill.stages.outputs import write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import RolloutSettings, build_settings


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "rollout")
    seed_everything(cfg)
    drafts = named_drafts(cfg, settings.drafts)
    device, ranks = launch_ranks(
        pick_device(settings.device), settings.devices, settings.num_nodes, settings.barrier_timeout_minutes
    )
    sampling = SamplingConfig(**cfg.sampling)
    given = prompts = None
    if settings.backend == "vllm":  # before our models take the GPUs
        check_single_process_for_vllm(ranks)
        tokenizer = shared_tokenizer(cfg, {})
        prompts = _prompts(cfg, settings, tokenizer)
        given = _vllm_responses(cfg, settings, prompts, sampling, tokenizer.eos_token_id, out_dir)
    tokenizer, target, loaded, vocab_size = load_frozen_target_and_drafts(cfg, drafts, device)
    if prompts is None:
        prompts = _prompts(cfg, settings, tokenizer)
    rollouts, metrics = {}, {}
    for name, draft in loaded.items():
        directory = out_dir / "rollouts" / name
        # teacher-forced labels need the draft's own distributions: its kind's pass over the loaded model
        dataset = run_rollouts(
            target, draft.model, prompts, directory, sampling=sampling, max_new_tokens=settings.max_new_tokens,
            batch_size=settings.batch_size, shard_size=settings.shard_size, seed=cfg.seed, vocab_size=vocab_size,
            label_temperature_one=settings.label_temperature_one, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            # the target's responses do not depend on the draft: generate them once, label them for each draft
            responses_from=next(iter(rollouts.values()), None) if given is None else None, ranks=ranks,
            responses=given, kind=draft.kind,
        )  # fmt: skip
        rollouts[name] = str(directory)
        labels = [a for row in dataset["labels"] for a in row]
        if labels:  # the mean soft label is the rollouts' expected acceptance of a draft token
            metrics[f"{name}/mean_acceptance_label"] = sum(labels) / len(labels)
    result = {"stage": "rollout", "rollouts": rollouts, **metrics}
    return write_result(out_dir, result) if ranks.is_main else result


def check_single_process_for_vllm(ranks: Ranks) -> None:
    """vLLM spreads the target over the node's GPUs itself, from one process: refuse to start it on every rank."""
    if ranks.world_size > 1:
        raise ConfigError(
            f"rollout.backend=vllm runs in one process, but these rollouts run on {ranks.world_size} ranks (the process "
            "group a pipeline's multi-GPU training started): run stage=rollout on its own with rollout.devices=1, "
            "or use rollout.backend=transformers."
        )


def _prompts(cfg: DictConfig, settings: RolloutSettings, tokenizer) -> list[list[int]]:
    datamodule = build_datamodule(cfg, tokenizer, max_length=settings.max_length)
    prompts = [list(p["prompt_ids"]) for p in datamodule.prompts(settings.split)]
    return prompts[: settings.num_prompts] if settings.num_prompts else prompts


def _vllm_responses(
    cfg: DictConfig,
    settings: RolloutSettings,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_token_id: int,
    out_dir: Path,
) -> list[list[int]]:
    """The target's responses from vLLM (or the ones an earlier launch of this run generated with the same request)."""
    spec = model_spec(cfg.models.target)
    model = vllm_model(spec.pretrained_model_name_or_path, spec.gguf_file, "rollout")
    request = vllm_request(
        model, prompts, sampling, settings.max_new_tokens, [eos_token_id],
        row_seeds(cfg.seed, range(len(prompts))), target_engine(spec, settings.vllm),
    )  # fmt: skip
    return generate_with_vllm(request, out_dir / "rollouts" / "vllm", settings.vllm_python)
