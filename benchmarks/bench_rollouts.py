"""Rollout prompts/s on the embedded pair: two target passes per rollout (before) vs one (generation's own logits).

A rollout generates the target's response and labels a draft token at every response position with
min(1, p/q). Before, the labels' target distribution came from a second, teacher-forced target pass over
prompt + response; now it is the raw logits generation computed anyway (`generate_scored_responses`). Both paths run
the library functions on the same prompts, batches and seeds, round-robin so machine drift hits them alike; the
script checks that responses and draft tokens are identical and labels equal to float rounding, and prints prompts/s
and the ratio (goal >= 1.5x).

    python benchmarks/bench_rollouts.py [--prompts 64] [--batch-size 16] [--max-new-tokens 64] [--repeats 3]

The embedded pair (`conf/models/tiny.yaml`, random weights, arith prompts from the train split) is composed with
Hydra and loaded by the rollout stage's own builders.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.sampling import SamplingConfig
from specdistill.rollout.generate import generate_responses, generate_scored_responses, label_responses
from specdistill.stages.build import build_datamodule, load_frozen_target_and_drafts, model_spec

ROOT = Path(__file__).resolve().parents[1]


def rollouts(one_pass: bool, target, draft, prompts, sampling, args, eos: int, pad: int, vocab: int):
    """Responses, draft tokens and labels of every prompt, as `run_rollouts` computes one shard."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    out = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        logits = None
        if one_pass:
            responses, logits = generate_scored_responses(
                target, batch, sampling, args.max_new_tokens, eos, pad, vocab
            )
        else:
            responses = generate_responses(target, batch, sampling, args.max_new_tokens, eos, pad, vocab)
        tokens, labels = label_responses(
            target, draft, batch, responses, sampling, pad, vocab, generator, target_logits=logits
        )
        out += list(zip(responses, tokens, labels, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["stage=rollout"])
    tokenizer, target, drafts, vocab = load_frozen_target_and_drafts(
        cfg, {"draft": model_spec(cfg.models.draft)}, torch.device("cpu")
    )
    draft = drafts["draft"]
    datamodule = build_datamodule(cfg, tokenizer, max_length=cfg.rollout.max_length)
    prompts = [list(p["prompt_ids"]) for p in datamodule.prompts("train")][: args.prompts]
    sampling = SamplingConfig(temperature=args.temperature)
    common = (target, draft, prompts, sampling, args, tokenizer.eos_token_id, tokenizer.pad_token_id, vocab)

    seconds: dict[str, list[float]] = {"two_pass": [], "one_pass": []}
    results = {}
    for _ in range(args.repeats):
        for name in seconds:
            start = time.perf_counter()
            results[name] = rollouts(name == "one_pass", *common)
            seconds[name].append(time.perf_counter() - start)
    label_error = 0.0
    for (r1, t1, a1), (r2, t2, a2) in zip(results["one_pass"], results["two_pass"], strict=True):
        if r1 != r2 or t1 != t2:
            raise AssertionError("one-pass rollouts changed a response or a draft token")
        label_error = max([label_error, *(abs(x - y) for x, y in zip(a1, a2, strict=True))])
    tokens = sum(len(r) for r, _, _ in results["one_pass"])
    print(f"embedded pair, {len(prompts)} prompts ({tokens} response tokens), batch {args.batch_size}, "
          f"T = {args.temperature}, {args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    rates = {name: len(prompts) / statistics.median(s) for name, s in seconds.items()}
    for name, rate in rates.items():
        print(f"  {name:9s} {rate:8.1f} prompts/s")
    print(f"  one_pass / two_pass: {rates['one_pass'] / rates['two_pass']:.2f}x (goal >= 1.5x); responses and draft "
          f"tokens identical, max |label difference| {label_error:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
