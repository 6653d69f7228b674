"""Peak memory and tokens/s of the distillation loss path: full logits (before) vs chunked from hidden states (now).

At a real vocabulary the loss path, not the model bodies, sets the memory of a distillation step: the full-logits
path materialises `(B, T, V)` logits of target and draft plus their fp32 softmax temporaries; the chunked path keeps
answer hidden states and projects `--chunk-size` rows at a time under activation checkpointing
(`specdistill.losses.chunked`); by default as many rows as the divergence's memory budget allows
(`divergence.chunk_budget_mb`, `DEFAULT_CHUNK_BUDGET_MB`), what every preset trains with. Models are scaled down (a few narrow layers) with the real vocabulary, so the loss
path dominates as it does at scale.

    python benchmarks/bench_loss_path.py [--vocab 50000 152064] [--seq 2048 512] [--chunk-size ROWS] [--repeats 2]

The loss path is everything between the models' final hidden states and the loss, forward and backward (output
layers, softmaxes, divergence, reduction); the bodies run once before it is measured, the draft's output as a leaf
that receives the gradient. Each (vocabulary, mode) runs in its own subprocess: peak memory is the process's
resident-set high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` just before the loss path) minus its
resident set at that moment, so it counts every allocation of the loss path (torch or not) and nothing else; the
workers run with a fixed glibc mmap threshold so that freed tensors leave the resident set (see `WORKER_ENV`).
Tokens/s is answer tokens per second of the loss path. The parent checks that the loss and the gradients (draft
output layer and hidden states) agree between the modes and prints the ratios. `--seq` pairs with `--vocab` (152k
full logits at T = 2048 need ~10 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.toy import tiny_gpt_neox
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.chunked import DEFAULT_CHUNK_BUDGET_MB
from specdistill.losses.reduction import reduce_tokens, window_normaliser
from specdistill.losses.rows import HiddenRows, OutputHead, final_hidden_states

MODES = ("full", "chunked")
# glibc serves allocations below its (adaptive, up to 32 MiB) mmap threshold from heaps it keeps resident after free,
# so a loop of chunk-sized tensors would show up as resident memory that is free; a fixed threshold makes every large
# tensor its own mapping, returned on free, so the high-water mark is the memory that was live at once.
WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


def build(vocab: int, seq: int) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]:
    """Target (2x128) and draft (1x64) with the real vocabulary, and one batch of `seq` tokens, 1/8 of them prompt."""
    target = tiny_gpt_neox(vocab, 128, 2, 4, max_position_embeddings=seq, seed=1)
    draft = tiny_gpt_neox(vocab, 64, 1, 2, max_position_embeddings=seq, seed=2).train().requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = input_ids.clone()
    labels[:, : seq // 8] = -100
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    batch["window_answer_tokens"] = answer_mask(labels).sum()
    return target, draft, batch


def loss_path(
    mode: str, target_hidden, target_head, draft_hidden, draft_head, batch, chunk_size
) -> torch.Tensor:
    """The distillation loss from both models' final hidden states `(B, T, H)`.

    full: what `answer_logits` did before (the output layer over every position, `(B, T, V)` logits, then the answer
    rows), then `ForwardKL()`; chunked: `ForwardKL(chunk_size).rows` on the answer rows' hidden states (None: the
    default budget's chunk).
    """
    keep = answer_mask(batch["labels"])
    if mode == "full":
        with torch.no_grad():
            target_rows = target_head(target_hidden)[:, :-1][keep]
        per_token = ForwardKL()(target_rows, draft_head(draft_hidden)[:, :-1][keep])
    else:
        target_rows = HiddenRows(target_hidden[:, :-1][keep], target_head)
        per_token = ForwardKL(chunk_size=chunk_size).rows(
            target_rows, HiddenRows(draft_hidden[:, :-1][keep], draft_head)
        )
    return reduce_tokens(per_token, None, window_normaliser(batch))


def memory() -> tuple[int, int]:
    """`(VmRSS, VmHWM)` of this process in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def worker(mode: str, vocab: int, seq: int, chunk_size: int | None, repeats: int, grads_path: str) -> dict:
    torch.set_num_threads(1)
    target, draft, batch = build(vocab, seq)
    with torch.no_grad():
        target_hidden = final_hidden_states(target, batch)
        draft_hidden = final_hidden_states(draft, batch).requires_grad_(True)  # the body's output, as a leaf
    heads = OutputHead(target, vocab), OutputHead(draft, vocab)

    def step() -> torch.Tensor:
        draft.zero_grad(set_to_none=True)
        draft_hidden.grad = None
        loss = loss_path(mode, target_hidden, heads[0], draft_hidden, heads[1], batch, chunk_size)
        loss.backward()
        return loss.detach()

    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident set
    before, _ = memory()
    start = time.perf_counter()
    loss = step()
    first = time.perf_counter() - start
    _, peak = memory()
    start = time.perf_counter()
    for _ in range(repeats - 1):
        step()
    seconds = (first + time.perf_counter() - start) / repeats
    grads = {
        "hidden": draft_hidden.grad,
        **{n: p.grad for n, p in draft.named_parameters() if p.grad is not None},
    }
    torch.save(grads, grads_path)
    tokens = int(batch["window_answer_tokens"])
    return {
        "loss": float(loss),
        "peak_bytes": peak - before,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, nargs="+", default=[50000, 152064])
    parser.add_argument(
        "--seq", type=int, nargs="+", default=[2048, 512], help="one per --vocab (or one for all)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="rows per chunk; default: the divergence's memory budget"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "VOCAB", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--grads", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, vocab, seq = args.worker[0], int(args.worker[1]), int(args.worker[2])
        print(json.dumps(worker(mode, vocab, seq, args.chunk_size, args.repeats, args.grads)))
        return
    seqs = args.seq * len(args.vocab) if len(args.seq) == 1 else args.seq
    if len(seqs) != len(args.vocab):
        parser.error("give one --seq, or one per --vocab")
    chunk = args.chunk_size or f"from the {DEFAULT_CHUNK_BUDGET_MB:g} MiB budget"
    print(f"chunk_size {chunk}, {args.repeats} steps per mode, 1 thread, peak = RSS high-water of the step")
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, seq in zip(args.vocab, seqs, strict=True):
            results, grads = {}, {}
            for mode in MODES:
                path = str(Path(tmp) / f"{mode}.pt")
                command = [sys.executable, __file__, "--worker", mode, str(vocab), str(seq), "--grads", path,
                           "--repeats", str(args.repeats)]  # fmt: skip
                if args.chunk_size is not None:
                    command += ["--chunk-size", str(args.chunk_size)]
                out = subprocess.run(
                    command, capture_output=True, text=True, check=True, env=WORKER_ENV
                ).stdout
                results[mode] = json.loads(out.strip().splitlines()[-1])
                grads[mode] = torch.load(path, weights_only=True)
            full, chunked = results["full"], results["chunked"]
            grad_error = max(
                ((grads["full"][n] - g).abs().max() / grads["full"][n].abs().max().clamp_min(1e-30)).item()
                for n, g in grads["chunked"].items()
            )
            rows = ForwardKL(chunk_size=args.chunk_size).rows_per_chunk(full["tokens"], vocab)
            print(
                f"\nV = {vocab}, T = {seq} ({full['tokens']} answer tokens, {rows or 'all'} rows per chunk)"
            )
            for mode in MODES:
                r = results[mode]
                print(f"  {mode:8s} peak {r['peak_bytes'] / 2**20:9.1f} MiB  {r['tokens_per_s']:9.0f} tokens/s  "
                      f"loss {r['loss']:.6f}")  # fmt: skip
            print(f"  chunked / full: peak memory {chunked['peak_bytes'] / full['peak_bytes']:.3f}x "
                  f"(goal <= 0.125), tokens/s {chunked['tokens_per_s'] / full['tokens_per_s']:.2f}x; "
                  f"|loss difference| {abs(chunked['loss'] - full['loss']):.2e}, "
                  f"max relative gradient difference {grad_error:.2e} (output layer, hidden states)")  # fmt: skip


if __name__ == "__main__":
    main()
