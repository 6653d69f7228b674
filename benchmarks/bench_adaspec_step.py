"""Time one training step (forward + backward + optimizer) of distill vs AdaSPEC (online and cached reference).

Same models, same batch, one process; setups are run round-robin so machine drift hits them alike. Prints the
median step time of each and the ratios adaspec_cached / distill (goal <= 1.1x: selection itself should cost little
once the reference is cached) and adaspec_online / distill (adds one reference forward).

    python benchmarks/bench_adaspec_step.py [--device cuda] [--repeats 20] [--warmup 3] [--threads 1]

Timing covers the step work (`DistillModule.training_step`, backward, optimizer step), not Lightning's loop.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import GPTNeoXForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.toy import tiny_gpt_neox
from specdistill.losses import ForwardKL
from specdistill.modules import DistillModule
from specdistill.selection.reference import CachedReferenceScores, OnlineReference, ReferenceScores
from specdistill.selection.scoring import score_batch
from specdistill.selection.selectors import AdaSpecSelector

VOCAB = 512


def gpt_neox(hidden: int, layers: int, heads: int, intermediate: int, seed: int) -> GPTNeoXForCausalLM:
    """A trainable random GPT-NeoX (`tiny_gpt_neox` returns frozen ones)."""
    model = tiny_gpt_neox(VOCAB, hidden, layers, heads, intermediate, max_position_embeddings=256, seed=seed)
    return model.train().requires_grad_(True)


def make_batch(batch_size: int, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch: prompts of 16-40 tokens, sequences of 64-`seq_len` tokens."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)
    lengths = torch.randint(64, seq_len + 1, (batch_size,), generator=gen)
    prompts = torch.randint(16, 41, (batch_size,), generator=gen)
    positions = torch.arange(seq_len)[None]
    real = positions < lengths[:, None]
    labels = torch.where(real & (positions >= prompts[:, None]), input_ids, torch.full_like(input_ids, -100))
    batch = {
        "input_ids": input_ids,
        "attention_mask": real.long(),
        "labels": labels,
        "example_id": torch.arange(batch_size),
        "window_answer_tokens": (labels[:, 1:] != -100).sum(),
    }
    return {k: v.to(device) for k, v in batch.items()}


def build(args: argparse.Namespace, device: torch.device):
    target = gpt_neox(256, 4, 4, 1024, seed=0).to(device)
    draft = gpt_neox(96, 2, 4, 384, seed=1).to(device)
    reference = gpt_neox(96, 2, 4, 384, seed=2).to(device)
    batch = make_batch(args.batch_size, args.seq_len, device)
    cached_batch = {**batch, "ref_divergence": score_batch(target, reference, batch, ForwardKL(), VOCAB)}

    def module(provider: ReferenceScores | None = None) -> DistillModule:
        return DistillModule(
            draft=copy.deepcopy(draft),
            target=target,
            vocab_size=VOCAB,
            divergence=ForwardKL(),
            optimizer=functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
            selector=None if provider is None else AdaSpecSelector(k=0.4),
            reference=provider,
        ).to(device)

    return {
        "distill": (module(), batch),
        "adaspec_online": (module(OnlineReference(reference, ForwardKL(), VOCAB)), batch),
        "adaspec_cached": (module(CachedReferenceScores()), cached_batch),
    }


def step_fn(module: DistillModule, batch: dict, optimizer: torch.optim.Optimizer):
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module.training_step(batch, 0).backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # self.log outside a Trainer warns every step; the timing does not need the logger
    warnings.filterwarnings("ignore", message=".*self.log.*")

    setups = {name: step_fn(m, b, m.configure_optimizers()) for name, (m, b) in build(args, device).items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for i in range(args.warmup + args.repeats):
        for name, step in setups.items():  # round-robin
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)

    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"device={device} batch={args.batch_size}x{args.seq_len} vocab={VOCAB} repeats={args.repeats}")
    for name, value in median.items():
        print(f"{name:16s} {value * 1000:9.2f} ms/step (median)")
    print(f"adaspec_cached / distill = {median['adaspec_cached'] / median['distill']:.3f}x (goal <= 1.1x)")
    print(f"adaspec_online / distill = {median['adaspec_online'] / median['distill']:.3f}x")


if __name__ == "__main__":
    main()
