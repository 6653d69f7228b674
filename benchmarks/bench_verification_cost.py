"""The target's verification cost in float32 and bfloat16, in one process: one forward over n new tokens after a
cached context, relative to one token, for each dtype, and bf16's time over float32's.

    python benchmarks/bench_verification_cost.py                      # the embedded pair's target (conf defaults)
    python benchmarks/bench_verification_cost.py --config models=smollm2_135m   # the real pair (README)
        [--max-tokens 9] [--context 128] [--repeats 7] [--threads 2]

Speculation at K verifies K + 1 tokens per target call, so `cost(K + 1)` is what a round costs against one
autoregressive step; tokens per target call over it is the speedup a drafter that costs nothing reaches
(`specdistill.decoding.cost.tokens_per_cost`). The two dtypes are timed interleaved, repeat by repeat, so that machine
drift hits them alike. Prints the table; nothing is checked.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from specdistill.decoding.cost import measure_verification_cost, relative_cost


def load_target(overrides: list[str]) -> torch.nn.Module:
    """The target `train.py` composes from conf/ with `overrides`, frozen, in float32."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from specdistill.models import load_model
    from specdistill.models.loading import freeze

    with initialize_config_dir(
        config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"
    ):
        cfg = compose("train", overrides=overrides)
    return freeze(load_model(instantiate(cfg.models.target))).float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", nargs="*", default=[], help="Hydra overrides composing the pair from conf/"
    )
    parser.add_argument("--max-tokens", type=int, default=9, help="time 1 .. this many tokens per pass")
    parser.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per length and dtype (median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two dtypes")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_target(args.config)
    models = {"float32": target, "bfloat16": copy.deepcopy(target).to(torch.bfloat16)}
    lengths = list(range(1, args.max_tokens + 1))
    seconds: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            for n, s in measure_verification_cost(model, lengths, args.context, args.repeats).items():
                seconds[name][n].append(s)
    median = {name: {n: sorted(v)[len(v) // 2] for n, v in by_n.items()} for name, by_n in seconds.items()}
    rel = {name: relative_cost(by_n) for name, by_n in median.items()}
    print(f"threads {torch.get_num_threads()}, context {args.context}, {args.rounds} x {args.repeats} passes")
    print(f"{'n':>3} {'f32 ms':>8} {'f32 x1':>7} {'bf16 ms':>8} {'bf16 x1':>8} {'bf16/f32':>9}")
    for n in lengths:
        f32, bf16 = median["float32"][n], median["bfloat16"][n]
        print(f"{n:>3} {f32 * 1e3:>8.2f} {rel['float32'][n]:>7.3f} {bf16 * 1e3:>8.2f} {rel['bfloat16'][n]:>8.3f} "
              f"{bf16 / f32:>9.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
