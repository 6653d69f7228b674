"""Training tokens/s and peak memory of the `distill` and `adaspec` steps in each loss mode, at real vocabularies.

Modes, all on the same models, batches and initialisation:
- full: the path before hidden-state rows, every model's `(B, T, V)` logits materialised, answer rows sliced;
- chunked: the default path, answer rows' final hidden states projected `--chunk-size` rows at a time
  (`divergence.chunk_size`, specdistill/losses/chunked.py);
- cached: the target's top-m answer distributions read from a cache built beforehand (`distill.target_cache=<m>` /
  `adaspec.target_cache=<m>`), and for adaspec the reference's scores too (`adaspec.cached_scores`): no target or
  reference model runs during training.

The models are scaled down (target 2x128, draft and reference 1x64) and carry the real vocabulary, so the loss path
weighs as it does at scale; the data is the embedded arith task (`--batch-size` problems per step), its token ids a
subset of the vocabulary. Each (vocabulary, stage, mode) runs in its own subprocess: the offline cache passes first
(not timed), then `--steps` training steps (`DistillModule.training_step`, backward, AdamW step) whose answer tokens/s
and resident-set high-water mark (minus the resident set before the steps) are reported, as in
`bench_loss_path.py`. The parent prints the ratios to `full` and checks that full and chunked give the same first
loss.

    python benchmarks/bench_training_modes.py [--vocab 50000 152064] [--steps 6] [--batch-size 8] [--m 64]

On a GPU (`--device cuda`, with `--bf16` for bf16 autocast over fp32 master weights and wider models, e.g.
`--target-hidden 2048 --draft-hidden 512`) peak memory is `torch.cuda.max_memory_allocated` over the steps minus
what was allocated before them, and the script adds the achieved fraction of the GPU's peak bf16 FLOP/s
(`gpu_preset_step.PEAK_BF16`) counting the output layers' matrix products on the answer rows (target and reference
forward, draft forward and backward: what dominates at these vocabularies), without the chunked path's recomputation.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_loss_path import WORKER_ENV, memory  # noqa: E402  (benchmarks/ is the script's own folder)
from gpu_preset_step import PEAK_BF16  # noqa: E402

from specdistill.data.target_cache import build_target_cache
from specdistill.decoding.toy import tiny_gpt_neox
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.rows import LogitRows
from specdistill.modules import DistillModule
from specdistill.selection.reference import CachedReferenceScores, OnlineReference, cached_reference_scores
from specdistill.selection.selectors import AdaSpecSelector
from specdistill.stages.datamodules import build_datamodule

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "chunked", "cached")
STAGES = ("distill", "adaspec")
TARGET_SHARPNESS = 30.0  # scales the random target's logits: about 0.9 of the mass in its top 64 at V = 50k


class FullLogitsModule(DistillModule):
    """The loss path before hidden-state rows: `(B, T, V)` logits of both models, then the answer rows."""

    def _answer_rows(self, batch, split):
        keep = answer_mask(batch["labels"])
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            target = self.target(**inputs).logits[:, :-1][keep][:, : self.vocab_size]
        draft = self.draft(**inputs).logits[:, :-1][keep][:, : self.vocab_size]
        return keep, LogitRows(target), LogitRows(draft)


def reference_runs(stage: str, mode: str) -> bool:
    return stage == "adaspec" and mode != "cached"


def worker(stage: str, mode: str, vocab: int, args: argparse.Namespace, tmp: str) -> dict:
    torch.set_num_threads(1)
    overrides = [
        "stage=adaspec",
        f"task.sizes.train={args.batch_size * args.steps}",
        "task.sizes.validation=8",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    tokenizer = instantiate(cfg.models.tokenizer)
    datamodule = build_datamodule(
        cfg, tokenizer, 256, batch_size=args.batch_size, eval_batch_size=args.batch_size
    )
    device = torch.device(args.device)
    target = tiny_gpt_neox(vocab, args.target_hidden, 2, 4, seed=1).to(device)
    with torch.no_grad():  # peaked like a trained target: its top-64 hold most of each answer distribution
        target.get_output_embeddings().weight.mul_(TARGET_SHARPNESS)
    draft = tiny_gpt_neox(vocab, args.draft_hidden, 1, 2, seed=2).to(device).train().requires_grad_(True)
    divergence = ForwardKL(chunk_size=None if mode == "full" else args.chunk_size)
    selector = AdaSpecSelector(k=0.4) if stage == "adaspec" else None
    reference = None
    target_or_cache = target
    if mode == "cached":
        target_or_cache = build_target_cache(
            Path(tmp) / "target", target, tokenizer, datamodule, vocab, m=args.m
        )
    if stage == "adaspec":
        model = tiny_gpt_neox(vocab, args.draft_hidden, 1, 2, seed=3).to(device)
        if mode == "cached":
            scores = cached_reference_scores(Path(tmp) / "ref", target, model, datamodule, divergence, vocab)
            datamodule.attach_column("train", "ref_divergence", scores)
            reference = CachedReferenceScores()
        else:
            reference = OnlineReference(model, divergence, vocab)
    if mode == "cached":
        del target  # trained without it
    batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
        | {"window_answer_tokens": answer_mask(b["labels"]).sum().to(device)}
        for b in datamodule.scoring_dataloader("train")
    ]
    cls = FullLogitsModule if mode == "full" else DistillModule
    module = cls(
        draft, target_or_cache, vocab, divergence, functools.partial(torch.optim.AdamW, lr=1e-4),
        selector=selector, reference=reference,
    )  # fmt: skip
    module.log = lambda *a, **k: None  # no Trainer: nothing to log to
    optimizer = module.configure_optimizers()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident set
        before, _ = memory()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    losses = []
    start = time.perf_counter()
    for batch in batches:
        with autocast:
            loss = module.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))  # synchronises
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else memory()[1]
    tokens = sum(int(b["window_answer_tokens"]) for b in batches)
    tail = None
    if mode == "cached":
        rows = [target_or_cache.rows(b, answer_mask(b["labels"]), "train") for b in batches]
        tail = float(torch.cat([r.tail_mass for r in rows]).mean())
    # output-layer products on the answer rows: target (and an online reference) forward, draft forward + backward
    frozen = (0 if mode == "cached" else args.target_hidden) + (
        args.draft_hidden if reference_runs(stage, mode) else 0
    )
    flops = 2 * tokens * vocab * (frozen + 3 * args.draft_hidden)
    return {
        "tail_mass": tail,
        "tflops": flops / seconds / 1e12,
        "first_loss": losses[0],
        "peak_bytes": peak - before,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, nargs="+", default=[50000, 152064])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU figures")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 master weights")
    parser.add_argument("--target-hidden", type=int, default=128)
    parser.add_argument("--draft-hidden", type=int, default=64)
    parser.add_argument("--worker", nargs=3, metavar=("STAGE", "MODE", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        stage, mode, vocab = args.worker[0], args.worker[1], int(args.worker[2])
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(worker(stage, mode, vocab, args, tmp)))
        return
    peak_flops = None
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)
        where = f"{name}, {'bf16 autocast' if args.bf16 else 'fp32'}; peak = max allocated during the steps"
    else:
        where = "CPU, 1 thread; peak = RSS high-water of the training steps"
    print(f"{args.steps} steps of {args.batch_size} arith problems per mode, chunk_size {args.chunk_size}, "
          f"m = {args.m}, target hidden {args.target_hidden}, draft hidden {args.draft_hidden}; {where}")  # fmt: skip
    for vocab in args.vocab:
        for stage in STAGES:
            results = {}
            for mode in MODES:
                command = [sys.executable, __file__, "--worker", stage, mode, str(vocab), "--steps", str(args.steps),
                           "--batch-size", str(args.batch_size), "--chunk-size", str(args.chunk_size),
                           "--m", str(args.m), "--device", args.device, "--target-hidden", str(args.target_hidden),
                           "--draft-hidden", str(args.draft_hidden), *(["--bf16"] if args.bf16 else [])]  # fmt: skip
                out = subprocess.run(
                    command, capture_output=True, text=True, check=True, env=WORKER_ENV
                ).stdout
                results[mode] = json.loads(out.strip().splitlines()[-1])
            full = results["full"]
            print(f"\nV = {vocab}, {stage} ({full['tokens']} answer tokens)")
            for mode in MODES:
                r = results[mode]
                print(f"  {mode:8s} peak {r['peak_bytes'] / 2**20:8.1f} MiB ({r['peak_bytes'] / full['peak_bytes']:.3f}x)"
                      f"  {r['tokens_per_s']:8.0f} tokens/s ({r['tokens_per_s'] / full['tokens_per_s']:.2f}x)"
                      f"  first loss {r['first_loss']:.6f}"
                      + (f"  {r['tflops']:.1f} TFLOP/s = {100 * r['tflops'] * 1e12 / peak_flops:.1f}% of peak"
                         if peak_flops else ""))  # fmt: skip
            print(f"  cached: mean tail mass beyond the top {args.m} {results['cached']['tail_mass']:.3f} (the cached "
                  "loss compares bucketed distributions; AdaSPEC may also keep other tokens)")  # fmt: skip
            difference = abs(results["chunked"]["first_loss"] - full["first_loss"])
            if difference > (2e-2 if args.bf16 else 1e-4) * abs(full["first_loss"]):
                raise AssertionError(f"chunked and full first losses differ by {difference:.2e}")


if __name__ == "__main__":
    main()
