"""AdaSPEC with a trained reference against AdaSPEC with the draft as its own reference (lagged, EMA) and DistillSpec,
at equal training compute, on one pair (docs/METHODS.md section 3, "A draft that is its own reference").

    python benchmarks/self_reference.py --out outputs/self_reference [--config experiment=smollm2_stdlib]
        [--every 20] [--decay 0.95] [--prompts 10]

Runs `train.py` (stage=pipeline) five times in `--out`, each resumable (a finished step is reused):

1. `main/`: target_answers -> distill -> adaspec -> analyse, the config's own chain (`--config`): the trained
   reference is the distill step's DistillSpec draft, AdaSPEC selects against it.
2. `lagged/`, `ema/`: the adaspec step alone with `selector=adaspec_lagged selector.every=N` and
   `selector=adaspec_ema selector.decay=d selector.warmup_steps=N`, on `main`'s target answers and target cache,
   for as many optimizer steps as the trained reference's two stages cost together (below).
3. `distillspec_matched/`: the distill step alone for the same compute.
4. `evaluate/`: every draft at fixed K = 4 (acceptance rate, tokens per target call, tokens/s against the
   autoregressive target, in one process) on the config's test prompts.

Compute is counted in draft sequence passes (a forward is 1, a forward and backward 3; the target is cached once for
all of them by `main`'s distill step and not counted): distill S_d steps of batch b_d cost 3 b_d S_d; AdaSPEC with the
trained reference S_a steps of batch b_a cost 4 b_a S_a (the reference's forward on every step, `cached_scores`
off); a self-reference costs 3 b_a per step and 1 b_a more on each step it scores (not during its first N steps).
The trained reference's budget B = 3 b_d S_d + 4 b_a S_a; the self-referencing runs get S with
3 b_a S + b_a (S - N) = B and DistillSpec alone B / (3 b_d) steps. Printed: the table with each draft's compute and
evaluate's report.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def self_reference_steps(budget: float, batch: int, warm: int) -> int:
    """Optimizer steps S of a self-referencing AdaSPEC run with 3 b S + b (S - warm) = budget (rounded down)."""
    return math.floor((budget + batch * warm) / (4 * batch))


def train(out: Path, overrides: list[str], log: Path) -> None:
    """One `train.py` pipeline run in `out` (resumes; each step writes `<out>/<step>/result.json`)."""
    command = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out}"]
    print("+", " ".join(command), flush=True)
    with log.open("a") as handle:
        subprocess.run(command, check=True, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)


def step_plan(step_dir: Path) -> tuple[int, int]:
    """(global batch, optimizer steps) a finished training step ran: its settings from the step's fingerprint record
    (the folder is named after its group, `distill` or `adaspec`; AdaSPEC's compute matching divides the batch by k)
    and its steps from the last checkpoint."""
    settings = json.loads((step_dir / "run_fingerprint.json").read_text())["config"][step_dir.name]
    if settings.get("cached_scores"):
        raise SystemExit(
            f"{step_dir}: adaspec.cached_scores=true scores the reference once, not on every step, which the budget "
            "B = 3 b_d S_d + 4 b_a S_a does not count; run the comparison with adaspec.cached_scores=false"
        )
    batch = int(settings["batch_size"])
    if settings.get("compute_matched"):
        batch = math.ceil(batch / float(settings["k"]))
    checkpoint = torch.load(
        step_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True
    )
    return batch, int(checkpoint["global_step"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", nargs="*", default=["experiment=smollm2_stdlib"])
    parser.add_argument(
        "--every", type=int, default=20, help="lagged refresh period N; also the EMA's warmup"
    )
    parser.add_argument("--decay", type=float, default=0.95, help="EMA decay (mean age d / (1 - d) steps)")
    parser.add_argument("--prompts", type=int, default=10, help="test prompts evaluated")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"

    train(out / "main", [*args.config, "pipeline.steps=[target_answers,distill,adaspec,analyse]"], log)
    main_dir = out / "main"
    b_d, s_d = step_plan(main_dir / "distill")
    b_a, s_a = step_plan(main_dir / "adaspec")
    budget = 3 * b_d * s_d + 4 * b_a * s_a
    answers = f"+task.answers_from={main_dir / 'target_answers' / 'answers'}"
    cache = main_dir / "distill" / "target_cache"
    s_self = self_reference_steps(budget, b_a, args.every)
    variants = {
        "lagged": ["selector=adaspec_lagged", f"selector.every={args.every}"],
        "ema": [
            "selector=adaspec_ema",
            f"selector.decay={args.decay}",
            f"selector.warmup_steps={args.every}",
        ],
    }
    for name, selector in variants.items():
        train(out / name, [*args.config, "pipeline.steps=[adaspec]", answers, f"adaspec.target_cache_dir={cache}", *selector,
                           f"adaspec.trainer.max_steps={s_self}", "adaspec.trainer.max_epochs=100"], log)  # fmt: skip
    s_matched = budget // (3 * b_d)
    train(out / "distillspec_matched", [
        *args.config, "pipeline.steps=[distill]", answers, f"distill.target_cache_dir={cache}",
        f"distill.trainer.max_steps={s_matched}", "distill.trainer.max_epochs=100",
    ], log)  # fmt: skip

    drafts = {
        "distillspec": main_dir / "distill",
        "adaspec": main_dir / "adaspec",
        "adaspec_lagged": out / "lagged" / "adaspec",
        "adaspec_ema": out / "ema" / "adaspec",
        "distillspec_matched": out / "distillspec_matched" / "distill",
    }
    self_cost = 3 * b_a * s_self + b_a * (s_self - args.every)  # no scoring in the first N steps
    compute = {
        "distillspec": 3 * b_d * s_d,
        "adaspec": budget,
        "adaspec_lagged": self_cost,
        "adaspec_ema": self_cost,
        "distillspec_matched": 3 * b_d * s_matched,
    }
    train(out / "evaluate", [
        *args.config, "pipeline.steps=[evaluate]", answers,
        *(f"+evaluate.drafts.{name}={path / 'export'}" for name, path in drafts.items()),
        "evaluate.fixed_lengths=[4]", "evaluate.acceptance_draft_length=4", "evaluate.policies.oracle=null",
        f"evaluate.num_prompts={args.prompts}",
    ], log)  # fmt: skip
    print(
        f"\ncompute budget B = {budget} draft sequence passes (fwd 1, fwd+bwd 3); target cached, not counted"
    )
    print(f"{'draft':<22}{'steps':>7}{'batch':>7}{'compute':>9}{'/ B':>7}  val/expected_acceptance")
    for name, path in drafts.items():
        result = json.loads((path / "result.json").read_text())
        batch, steps = step_plan(path)
        print(f"{name:<22}{steps:>7}{batch:>7}{compute[name]:>9}{compute[name] / budget:>7.2f}  "
              f"{result.get('val/expected_acceptance')}")  # fmt: skip
    print()
    print((out / "evaluate" / "evaluate" / "report.txt").read_text())


if __name__ == "__main__":
    main()
