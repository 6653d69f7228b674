"""Stage `target_answers`: the target's own answers to the task's prompts, the text the drafts then learn from.

DistillSpec and EAGLE train drafts on what the target writes, not on the dataset's answers: a draft is accepted when
it predicts the target's next token on the target's own text, and a dataset's answers can look nothing like it (an
instruction-tuned target answers a code prompt with prose where the dataset has a function body). This step answers
the first `max_prompts` prompts of each split in `target_answers.splits` (at most `max_new_tokens` tokens, batches
sorted by prompt length) and writes them as `<out_dir>/answers/<split>.jsonl` (`specdistill.tasks.answers`); in a
pipeline its `answers` output fills `task.answers_from`, so every later step trains and validates on them (scores
still compare with the dataset's answers).

Greedy by default, because the drafts are evaluated under greedy decoding first (the losses match whole
distributions at every answer position, so a sampled evaluation learns from it too); `target_answers.sampling`
samples instead, as EAGLE's recipe regenerates at the serving temperature, each prompt from its own seed
(`prompt_seeds`). `target_answers.backend=vllm` generates with vLLM (`specdistill.rollout.vllm_backend`, in its own
process and environment: `target_answers.vllm_python`) from the target's hub id or safetensors folder; the default,
transformers, needs nothing else. Either way the answers are written in shards of `shard_size` prompts
(`specdistill.tasks.answer_shards`, `<out_dir>/answer_shards/<split>/`), so a relaunch into the same run folder
generates only the shards still missing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.caches.digest import json_digest
from specdistill.decoding.sampling import SamplingConfig
from specdistill.evaluation.generation import greedy_texts, sampled_texts
from specdistill.rollout.vllm_backend import generate_with_vllm, target_engine, vllm_model, vllm_request
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import (
    load_frozen_target_and_drafts,
    model_spec,
    pick_device,
    shared_tokenizer,
)
from specdistill.stages.outputs import write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import TargetAnswersSettings, build_settings
from specdistill.tasks import answer_shards
from specdistill.tasks.answers import prompt_key, write_answers
from specdistill.tasks.base import Task
from specdistill.tasks.turns import assistant_turns, with_replies

log = logging.getLogger(__name__)

# (prompt ids, their prompt keys, shard indices, folder) -> answers of the shards, each written as it is done
ShardWriter = Callable[[list[list[list[int]]], list[list[str]], list[int], Path], None]


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings: TargetAnswersSettings = build_settings(cfg, "target_answers")
    seed_everything(cfg)
    sampling = settings.decoding()
    if settings.backend == "vllm":  # vLLM loads the target itself, in its own process: ours stays unloaded
        tokenizer = shared_tokenizer(cfg, {})
        write_shards = vllm_writer(cfg, settings, sampling, tokenizer)
    else:
        tokenizer, target, _, vocab_size = load_frozen_target_and_drafts(
            cfg, {}, pick_device(settings.device)
        )
        write_shards = transformers_writer(settings, sampling, cfg.seed, target, tokenizer, vocab_size)
    datamodule = build_datamodule(cfg, tokenizer, max_length=settings.max_length)
    folder = out_dir / "answers"
    result: dict = {"stage": "target_answers", "answers": str(folder)}
    task = datamodule.task
    for split in settings.splits:
        folder_of_split = out_dir / "answer_shards" / split
        chats = chats_of(task, datamodule.records(split), settings.max_prompts)
        if chats is not None:  # a chat trained on every assistant turn: answered turn by turn, in context
            record = functools.partial(split_record, cfg, settings, sampling)
            pairs = answer_turns(chats, tokenizer, folder_of_split, record, settings, write_shards)
        else:
            prompts = unique_prompts(task, datamodule.prompts(split)[: settings.max_prompts])
            pairs = answer_split(
                prompts,
                folder_of_split,
                split_record(cfg, settings, sampling, prompts),
                settings,
                write_shards,
            )
        write_answers(folder, split, sorted(pairs))
        texts = [text for _, text in pairs]
        result[f"{split}/answers"] = len(texts)
        result[f"{split}/empty_answers"] = sum(not text.strip() for text in texts)
        log.info("target answers: %d for %s (%d empty)", len(texts), split, result[f"{split}/empty_answers"])
    return write_result(out_dir, result)


def answer_split(
    prompts: dict[str, list[int]],
    folder: Path,
    record: dict[str, Any],
    settings: TargetAnswersSettings,
    write_shards: ShardWriter,
) -> list[tuple[str, str]]:
    """`(prompt key, answer)` of every prompt, generating only the shards `folder` does not hold yet.

    The prompts are sorted by length (stable: ties keep split order) before they are cut into shards, so with
    `shard_size` a multiple of `batch_size` every batch is the one an unsharded run would generate.
    """
    shards = answer_shards.shards_of(sorted(prompts, key=lambda key: len(prompts[key])), settings.shard_size)
    finished = set(answer_shards.open_split(folder, record, len(shards)))
    todo = [i for i in range(len(shards)) if i not in finished]
    if finished:
        log.info("target answers: %d of %d shards already in %s", len(finished), len(shards), folder)
    if todo:
        write_shards([[prompts[k] for k in shards[i]] for i in todo], [shards[i] for i in todo], todo, folder)
    return answer_shards.read_shards(folder, len(shards))


def chats_of(task: Task, records: datasets.Dataset, max_prompts: int | None) -> list[list[dict]] | None:
    """The first `max_prompts` chats of a task that trains on every assistant turn (`Task.conversation`), else None."""
    if max_prompts is not None:
        records = records.select(range(min(max_prompts, len(records))))
    chats = [task.conversation(record) for record in records]
    return chats if chats and all(chat is not None for chat in chats) else None


def answer_turns(
    chats: list[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    record: Callable[[dict[str, list[int]]], dict[str, Any]],
    settings: TargetAnswersSettings,
    write_shards: ShardWriter,
) -> list[tuple[str, str]]:
    """`(context key, answer)` for every assistant turn of every chat, each generated in the context of the
    target's own answers to the turns before it (`specdistill.tasks.turns`): round r answers turn r of every chat
    that has one, as one sharded, resumable split in `<folder>/turn-<r>` (`answer_split`; `record(prompts)` is the
    round's record), so a relaunch redoes no finished round or shard."""
    replies: list[list[str]] = [[] for _ in chats]
    answered: dict[str, str] = {}
    for turn in range(max(assistant_turns(chat) for chat in chats)):
        live = [i for i, chat in enumerate(chats) if assistant_turns(chat) > turn]
        contexts = {i: with_replies(chats[i], replies[i]) for i in live}
        keys = {i: prompt_key(context) for i, context in contexts.items()}
        prompts: dict[str, list[int]] = {}
        for i in live:
            if keys[i] not in prompts:
                prompts[keys[i]] = context_ids(contexts[i], tokenizer, settings.max_length)
        found = dict(answer_split(prompts, folder / f"turn-{turn}", record(prompts), settings, write_shards))
        for i in live:
            replies[i].append(found[keys[i]])
        answered.update(found)
    return list(answered.items())


def context_ids(context: list[dict], tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[int]:
    """A chat's tokens before an assistant turn, as training renders them (the chat template with its generation
    prompt), its last `max_length` kept (the prompt-left truncation of training)."""
    text = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:]


def split_record(
    cfg: DictConfig, settings: TargetAnswersSettings, sampling: SamplingConfig, prompts: dict[str, list[int]]
) -> dict[str, Any]:
    """What decides a split's answers, kept beside its shards: a relaunch with any of it changed is refused."""
    sampled = not sampling.is_greedy
    return {
        "format_version": 1,
        "prompts_sha256": json_digest(list(prompts.items())),
        "num_prompts": len(prompts),
        "shard_size": settings.shard_size,
        "max_new_tokens": settings.max_new_tokens,
        "sampling": asdict(sampling) if sampled else {"greedy": True},  # a greedy temperature changes nothing
        "seed": int(cfg.seed) if sampled else None,  # greedy answers do not depend on it
        "backend": settings.backend,
        # padding can move a float32 greedy argmax: batches count for our generate, vLLM batches by itself
        "batch_size": settings.batch_size if settings.backend == "transformers" else None,
        "vllm": settings.vllm if settings.backend == "vllm" else None,
        "models_sha256": json_digest(OmegaConf.to_container(cfg.models, resolve=True)),
    }


def prompt_seeds(seed: int, keys: Sequence[str]) -> list[int]:
    """One sampling seed per prompt, from the run's seed and the prompt itself: a prompt draws the same answer
    whatever its shard, batch or position (another `max_prompts` or `shard_size` leaves it unchanged)."""
    return [
        int.from_bytes(hashlib.sha256(f"{seed}\n{key}".encode()).digest()[:8], "big") % (2**63 - 1)
        for key in keys
    ]


def transformers_writer(
    settings: TargetAnswersSettings,
    sampling: SamplingConfig,
    seed: int,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
) -> ShardWriter:
    """Shards answered by our target in this process: `greedy_texts` (transformers' `generate`), or `sampled_texts`
    with one seed per prompt."""

    def write_shards(
        prompt_ids: list[list[list[int]]], keys: list[list[str]], indices: list[int], folder: Path
    ) -> None:
        for ids, shard_keys, index in zip(prompt_ids, keys, indices, strict=True):
            desc = f"target answers ({folder.name}, shard {index})"
            if sampling.is_greedy:
                texts = greedy_texts(
                    target, tokenizer, ids, settings.max_new_tokens, batch_size=settings.batch_size, desc=desc
                )
            else:
                texts = sampled_texts(
                    target, tokenizer, ids, settings.max_new_tokens, sampling, prompt_seeds(seed, shard_keys),
                    vocab_size, batch_size=settings.batch_size, desc=desc,
                )  # fmt: skip
            answer_shards.write_shard(folder, index, zip(shard_keys, texts, strict=True))

    return write_shards


def vllm_writer(
    cfg: DictConfig,
    settings: TargetAnswersSettings,
    sampling: SamplingConfig,
    tokenizer: PreTrainedTokenizerBase,
) -> ShardWriter:
    """Shards answered by vLLM: one launch for all the missing shards of a split, which writes each shard's tokens
    (`<folder>/vllm/shard-NNNNN.json`) as soon as it is done; tokens a killed launch left are used before it starts."""
    spec = model_spec(cfg.models.target)
    model = vllm_model(spec.pretrained_model_name_or_path, spec.gguf_file, "target_answers")
    engine = target_engine(spec, settings.vllm)

    def write_shards(
        prompt_ids: list[list[list[int]]], keys: list[list[str]], indices: list[int], folder: Path
    ) -> None:
        work = folder / "vllm"
        tokens = {index: work / f"{answer_shards.shard_name(index)}.json" for index in indices}

        def write(j: int) -> None:
            responses = json.loads(tokens[indices[j]].read_text())
            if len(responses) != len(keys[j]):
                raise RuntimeError(
                    f"{tokens[indices[j]]} holds {len(responses)} answers for {len(keys[j])} prompts"
                )
            texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
            answer_shards.write_shard(folder, indices[j], zip(keys[j], texts, strict=True))

        missing = []
        for j, index in enumerate(indices):  # a killed launch's finished shards first: they need no vLLM
            if tokens[index].is_file():
                write(j)
            else:
                missing.append(j)
        if missing:
            request = vllm_request(
                model, [p for j in missing for p in prompt_ids[j]], sampling, settings.max_new_tokens,
                [tokenizer.eos_token_id], [s for j in missing for s in prompt_seeds(cfg.seed, keys[j])], engine,
                chunks=[(len(prompt_ids[j]), tokens[indices[j]]) for j in missing],
            )  # fmt: skip
            generate_with_vllm(request, work, settings.vllm_python, "target_answers")
            for j in missing:
                write(j)

    return write_shards


def unique_prompts(task: Task, prompts: list[dict]) -> dict[str, list[int]]:
    """`{prompt key: prompt ids}`, one per distinct prompt (two records can share one: the standard library defines
    some functions twice with the same signature and docstring), in split order."""
    unique: dict[str, list[int]] = {}
    for prompt in prompts:
        unique.setdefault(prompt_key(task.prompt(prompt["record"])), list(prompt["prompt_ids"]))
    return unique
