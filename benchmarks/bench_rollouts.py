"""Rollout prompts/s on the embedded pair: transformers' `generate` plus a teacher-forced target pass for the labels
(before) vs our batched sampling loop whose own logits are the labels' target distribution (after).

A rollout samples the target's response to a prompt and labels a draft token at every response position with
min(1, p/q). Before: `model.generate` (one batch runs until its longest response ends) and a second, teacher-forced
target pass over prompt + response for p. After: `specdistill.rollout.generate.sample_responses`, which drops each
row from the batch (and its KV cache) when it ends and returns the logits it computed anyway, so the target runs once.
Both paths run on the same prompts and batches, round-robin so machine drift hits them alike, and label with the
library's `label_responses`. Checks: greedy (`--temperature 0`) responses are identical; in every mode the one-pass
labels equal a teacher-forced labelling of the same responses and draft tokens. Prints prompts/s and the ratio
(goal >= 1.5x).

    python benchmarks/bench_rollouts.py [--prompts 64] [--batch-size 32] [--max-new-tokens 64] [--repeats 3]
        [--target DIR --draft DIR]    # trained exports (e.g. outputs/<run>/sft/export, .../adaspec/export)

Without --target/--draft the embedded pair (`conf/models/tiny.yaml`) has random weights, whose responses never end
early; trained weights end at EOS, as real rollouts do. Models, tokenizer and arith prompts (train split) come from
the rollout stage's own builders.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.sampling import SamplingConfig
from specdistill.rollout.generate import label_responses, left_pad, row_seeds, sample_responses
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts, model_spec

ROOT = Path(__file__).resolve().parents[1]


class Warp(LogitsProcessor):
    """Our warping inside transformers' `generate`, on the real vocabulary."""

    def __init__(self, sampling: SamplingConfig, vocab: int) -> None:
        self.sampling, self.vocab = sampling, vocab

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"), dtype=torch.float32)
        out[:, : self.vocab] = self.sampling.warp_logits(scores[:, : self.vocab])
        return out


def generate_before(target, batch, sampling, max_new_tokens, eos, pad, vocab) -> list[list[int]]:
    """Responses from transformers' `generate` (EOS kept, nothing after it)."""
    ids, mask = left_pad(batch, pad)
    config = GenerationConfig(
        do_sample=not sampling.is_greedy, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip
    out = target.generate(
        input_ids=ids, attention_mask=mask, generation_config=config,
        logits_processor=LogitsProcessorList([Warp(sampling, vocab)]),
    )[:, ids.shape[1] :].tolist()  # fmt: skip
    return [r[: r.index(eos) + 1] if eos in r else r for r in out]


def rollouts(after: bool, target, draft, prompts, sampling, args, eos: int, pad: int, vocab: int):
    """Responses, draft tokens and labels of every prompt, as `run_rollouts` computes one shard."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    out = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        logits = None  # before: the teacher-forced target pass inside label_responses
        if after:
            responses, logits = sample_responses(
                target, batch, sampling, args.max_new_tokens, eos, pad, vocab,
                seeds=row_seeds(0, range(start, start + len(batch))),
            )  # fmt: skip
        else:
            responses = generate_before(target, batch, sampling, args.max_new_tokens, eos, pad, vocab)
        tokens, labels = label_responses(
            target, draft, batch, responses, sampling, pad, vocab, generator, target_logits=logits
        )
        out += list(zip(responses, tokens, labels, strict=True))
    return out


def teacher_forced_label_error(
    results, target, draft, prompts, sampling, args, pad: int, vocab: int
) -> float:
    """Largest |one-pass label - teacher-forced label| over the same responses and draft-token draws."""
    generator = torch.Generator().manual_seed(0)
    error = 0.0
    for start in range(0, len(prompts), args.batch_size):
        rows = results[start : start + args.batch_size]
        batch = prompts[start : start + args.batch_size]
        tokens, labels = label_responses(
            target, draft, batch, [r for r, _, _ in rows], sampling, pad, vocab, generator
        )
        for (_, t1, a1), t2, a2 in zip(rows, tokens, labels, strict=True):
            if t1 != t2:
                raise AssertionError("the draft tokens changed with the labelling pass")
            error = max([error, *(abs(x - y) for x, y in zip(a1, a2, strict=True))])
    return error


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", help="a trained target export (default: the random embedded target)")
    parser.add_argument("--draft", help="a trained draft export (default: the random embedded draft)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = ["stage=rollout"]
    for role in ("target", "draft"):
        if getattr(args, role):
            overrides.append(
                f"models.{role}.pretrained_model_name_or_path={Path(getattr(args, role)).resolve()}"
            )
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    tokenizer, target, drafts, vocab = load_frozen_target_and_drafts(
        cfg, {"draft": model_spec(cfg.models.draft)}, torch.device("cpu")
    )
    draft = drafts["draft"].model
    datamodule = build_datamodule(cfg, tokenizer, max_length=cfg.rollout.max_length)
    prompts = [list(p["prompt_ids"]) for p in datamodule.prompts("train")][: args.prompts]
    sampling = SamplingConfig(temperature=args.temperature)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    common = (target, draft, prompts, sampling, args, eos, pad, vocab)

    seconds: dict[str, list[float]] = {"before": [], "after": []}
    results = {}
    for _ in range(args.repeats):
        for name in seconds:
            start = time.perf_counter()
            results[name] = rollouts(name == "after", *common)
            seconds[name].append(time.perf_counter() - start)
    if sampling.is_greedy and [r for r, _, _ in results["after"]] != [r for r, _, _ in results["before"]]:
        raise AssertionError("greedy responses differ from transformers' generate")
    label_error = teacher_forced_label_error(
        results["after"], target, draft, prompts, sampling, args, pad, vocab
    )
    lengths = [len(r) for r, _, _ in results["after"]]
    weights = "trained" if args.target else "random"
    print(f"embedded pair ({weights} weights), {len(prompts)} prompts, batch {args.batch_size}, response length "
          f"mean {statistics.mean(lengths):.1f} max {max(lengths)} (budget {args.max_new_tokens}), "
          f"T = {args.temperature}, {args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    rates = {name: len(prompts) / statistics.median(s) for name, s in seconds.items()}
    print(f"  before (generate + teacher-forced target pass) {rates['before']:8.1f} prompts/s")
    print(f"  after  (one-pass loop, rows leave at EOS)       {rates['after']:8.1f} prompts/s")
    same = "greedy responses identical to generate; " if sampling.is_greedy else ""
    print(f"  after / before: {rates['after'] / rates['before']:.2f}x (goal >= 1.5x); {same}max |one-pass label - "
          f"teacher-forced label| {label_error:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
