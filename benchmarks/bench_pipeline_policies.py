"""SpecDec++ against the best fixed K and the oracle on a finished pipeline run, as throughput ratios, in one process.

    python benchmarks/bench_pipeline_policies.py --run DIR [--draft adaspec|distillspec|both] [--prompts 40]
        [--selection-prompts N] [--max-new-tokens 64] [--repeats 3] [--selection-repeats 1] [--warmup 1]
        [--threads N] [--thresholds H ...] [--score-newest both|false|true] [--fixed-lengths K ...]
        [--head-min-draft-length N] [--max-draft-length N] [--temperature 0] [--seed S] [--device cpu]
    (the K and h grids, the head's minimum, the engine's maximum, the seed and the number of selection prompts
    default to the run's evaluate settings)

Inputs, all from the run directory `DIR` written by `python train.py`: the target `DIR/sft/export`, the drafts
`DIR/distill/export` (distillspec) and `DIR/adaspec/export` (adaspec), their acceptance heads
`DIR/acceptance_head/<draft>/export`, and the resolved config `DIR/.hydra/config.yaml`, from which the task's prompts
are tokenised as the pipeline's evaluate stage does (`build_datamodule(cfg, tokenizer, max_length)`,
`datamodule.prompts(split)`); the training-free policies are the run's `evaluate.policies` (heuristic, confidence,
entropy and oracle by default).

The measurement is the evaluate stage's own protocol, `specdistill.evaluation.protocol.evaluate_drafts`: K and h
(with the scoring mode) are chosen by tokens/s on the first `--selection-prompts` prompts of the run's selection
split (never "test"), then the autoregressive target and, per draft, the chosen fixed K, every training-free policy
and every acceptance-head policy of the grid decode the first `--prompts` prompts of the test split, interleaved
prompt by prompt in a rotating order over `--repeats` passes (see `specdistill/evaluation/runner.py`). Every engine
drafts at most `--max-draft-length` candidates per round.

Printed, in this order:

1. one line with the run, the drafts, the prompt counts, the decoding mode, the threads and the device;
2. per draft, the selection's tokens/s for each K and each acceptance-head policy;
3. the test table of `format_table` (one row per configuration: `autoregressive`, `<draft>/fixed_k{K}`,
   `<draft>/<policy>`, `<draft>/<draft>_acceptance_head_h{h}[_newest]`; columns: the docs/METHODS.md section 0
   metrics, `speedup` over the autoregressive row and the task metric), followed by the chosen K and head per draft
   and the ratios `<draft>/acceptance_head_over_best_fixed_k` and `<draft>/acceptance_head_over_oracle`;
4. per draft, both ratios next to the goals of the issue (>= 1.07, the low end of the paper's 7-11% gain over the
   best fixed K; >= 0.90 of the oracle), marked met or not met; the goals are reported, not enforced;
5. with greedy decoding (the default), whether every configuration's outputs equal the autoregressive ones token
   for token. Exit status 1 if one differs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing; the run's task is `tasks.<name>`

from specdistill.decoding.policies import DraftPolicy  # noqa: E402
from specdistill.decoding.sampling import SamplingConfig  # noqa: E402
from specdistill.evaluation.protocol import EvalProtocol, EvaluationResult, evaluate_drafts  # noqa: E402
from specdistill.evaluation.report import BASELINE_NAME  # noqa: E402
from specdistill.models.acceptance_head import AcceptanceHead  # noqa: E402
from specdistill.stages.datamodules import build_datamodule  # noqa: E402
from specdistill.stages.model_loading import load_frozen_target_and_drafts, named_drafts  # noqa: E402

# draft name (as in the pipeline's evaluate.drafts) -> the stage directory holding its export
DRAFT_STAGES = {"distillspec": "distill", "adaspec": "adaspec"}
GOAL_VS_FIXED = 1.07
GOAL_VS_ORACLE = 0.90


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", required=True, help="finished pipeline run directory (has .hydra/config.yaml)"
    )
    parser.add_argument("--draft", choices=[*DRAFT_STAGES, "both"], default="both")
    parser.add_argument("--prompts", type=int, default=40, help="test prompts")
    parser.add_argument(
        "--selection-prompts", type=int, default=None, help="prompts for choosing K, h (default: the run's)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the test prompts")
    parser.add_argument("--selection-repeats", type=int, default=1, help="timed passes for the selection")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations per configuration")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=None, help="h grid (default: the run's)"
    )
    parser.add_argument(
        "--score-newest",
        choices=["both", "false", "true"],
        default="both",
        help="head scoring modes to select from: one-behind (false, the public code), newest (true), or both",
    )
    parser.add_argument(
        "--fixed-lengths", type=int, nargs="+", default=None, help="K grid (default: the run's)"
    )
    parser.add_argument(
        "--head-min-draft-length", type=int, default=None, help="acceptance-head minimum (default: the run's)"
    )
    parser.add_argument(
        "--max-draft-length",
        type=int,
        default=None,
        help="the engine's most candidates per round, for every policy (default: the run's)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    parser.add_argument("--seed", type=int, default=None, help="default: the run's")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for name in ("prompts", "selection_prompts", "max_new_tokens", "repeats", "selection_repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.fixed_lengths is not None and min(args.fixed_lengths) < 1:
        parser.error("--fixed-lengths must all be >= 1")
    return args


def load_run_config(run: Path) -> DictConfig:
    """The run's resolved config; only the task, models, evaluate and seed nodes are used (no Hydra runtime)."""
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --run must be a directory written by `python train.py`.")
    cfg = OmegaConf.load(path)
    if OmegaConf.select(cfg, "evaluate.acceptance_head.thresholds") is None:
        raise ValueError(
            f"{run} was written by a specdistill before the configuration redesign (no evaluate.acceptance_head); "
            "re-run the pipeline with this version, or pass --thresholds, --fixed-lengths, --selection-prompts, "
            "--head-min-draft-length, --max-draft-length and --seed"
        )
    return cfg


def run_paths(run: Path, drafts: Sequence[str]) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """(target export, draft name -> export, draft name -> acceptance head export), each checked to exist."""
    target = run / "sft" / "export"
    exports = {d: run / DRAFT_STAGES[d] / "export" for d in drafts}
    heads = {d: run / "acceptance_head" / d / "export" for d in drafts}
    missing = [str(p) for p in [target, *exports.values(), *heads.values()] if not p.is_dir()]
    if missing:
        raise FileNotFoundError(
            f"missing in the run directory: {missing}; run the full pipeline (sft, distill, adaspec, rollout, "
            "acceptance_head) into it first, or pick one draft with --draft."
        )
    return target, exports, heads


def run_policies(cfg: DictConfig) -> dict[str, DraftPolicy]:
    """The run's training-free policies (`evaluate.policies`), built as its evaluate stage built them."""
    return {str(name): instantiate(node) for name, node in (cfg.evaluate.policies or {}).items()}


def fill_defaults(args: argparse.Namespace, cfg: DictConfig) -> None:
    """Settings not given on the command line come from the run's evaluate settings."""
    settings = cfg.evaluate
    if args.thresholds is None:
        args.thresholds = list(settings.acceptance_head.thresholds)
    if args.head_min_draft_length is None:
        args.head_min_draft_length = int(settings.acceptance_head.min_draft_length)
    if args.max_draft_length is None:
        args.max_draft_length = int(settings.max_draft_length)
    if args.fixed_lengths is None:
        args.fixed_lengths = [int(k) for k in settings.fixed_lengths]
    if args.selection_prompts is None:
        args.selection_prompts = int(settings.selection_prompts)
    if args.seed is None:
        args.seed = int(cfg.seed)


def print_selection(result: EvaluationResult, selection_split: str, num_prompts: int) -> None:
    for draft, choice in result.choices.items():
        print(f"\nselection for {draft} ({num_prompts} {selection_split} prompts), tokens/s:")
        per_policy = {f"fixed_k{k}": v for k, v in choice["tokens_per_second_by_k"].items()}
        per_policy |= choice.get("tokens_per_second_by_head", {})
        for name, value in per_policy.items():
            print(f"  {name:<34}{'-' if value is None else f'{value:.1f}':>9}")


def print_goals(result: EvaluationResult, selection_split: str) -> None:
    def verdict(value: float | None, goal: float) -> str:
        if value is None:
            return "- (not measured)"
        return f"{value:.3f} (goal >= {goal:.2f}: {'met' if value >= goal else 'not met'})"

    for draft, choice in result.choices.items():
        vs_fixed = result.ratios.get(f"{draft}/acceptance_head_over_best_fixed_k")
        vs_oracle = result.ratios.get(f"{draft}/acceptance_head_over_oracle")
        print(
            f"{draft}: chosen on {selection_split}: K = {choice['best_k']}, {choice.get('best_head')}; "
            f"acceptance_head / best_fixed_k = {verdict(vs_fixed, GOAL_VS_FIXED)}, "
            f"acceptance_head / oracle = {verdict(vs_oracle, GOAL_VS_ORACLE)}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    run = Path(args.run).expanduser().resolve()
    cfg = load_run_config(run)
    fill_defaults(args, cfg)
    draft_names = list(DRAFT_STAGES) if args.draft == "both" else [args.draft]
    target_dir, draft_dirs, head_dirs = run_paths(run, draft_names)
    selection_split, test_split = cfg.evaluate.selection_split, cfg.evaluate.split
    device = torch.device(args.device)
    sampling = SamplingConfig(temperature=args.temperature, greedy=args.temperature == 0)

    # the models the run's evaluate stage used: its exports, with the pair's dtypes
    with open_dict(cfg):
        cfg.models.target.pretrained_model_name_or_path = str(target_dir)
    drafts = named_drafts(cfg, {d: str(p) for d, p in draft_dirs.items()})
    tokenizer, target, loaded, vocab = load_frozen_target_and_drafts(cfg, drafts, device)
    models = {name: draft.proposer(vocab) for name, draft in loaded.items()}
    heads = {d: AcceptanceHead.load(p, device=device) for d, p in head_dirs.items()}
    datamodule = build_datamodule(cfg, tokenizer, max_length=cfg.evaluate.max_length)
    task = datamodule.task
    selection_prompts = datamodule.prompts(selection_split)[: args.selection_prompts]
    test_prompts = datamodule.prompts(test_split)[: args.prompts]
    mode = "greedy" if sampling.is_greedy else f"temperature {args.temperature}"
    print(
        f"run {run}: drafts {draft_names}; {len(selection_prompts)} {selection_split} prompts for selection, "
        f"{len(test_prompts)} {test_split} prompts x {args.max_new_tokens} new tokens x {args.repeats} passes; "
        f"{mode}, at most {args.max_draft_length} candidates per round, {torch.get_num_threads()} threads, {device}"
    )

    score_newest = {"both": [False, True], "false": False, "true": True}[args.score_newest]
    protocol = EvalProtocol(
        fixed_lengths=args.fixed_lengths, head_thresholds=args.thresholds, head_score_newest=score_newest,
        head_min_draft_length=args.head_min_draft_length, max_draft_length=args.max_draft_length,
        selection_split=selection_split, split=test_split, sampling=sampling, max_new_tokens=args.max_new_tokens,
        seed=args.seed, warmup=args.warmup, repeats=args.repeats, selection_repeats=args.selection_repeats,
    )  # fmt: skip
    result = evaluate_drafts(
        target, models, heads, run_policies(cfg), protocol, test_prompts=test_prompts,
        selection_prompts=selection_prompts, tokenizer=tokenizer, vocab_size=vocab,
        score_fn=task.score if task.scoring_available else None, task_metric_name=task.metric_name,
    )  # fmt: skip
    print_selection(result, selection_split, len(selection_prompts))
    print(f"\n{test_split} split:\n{result.table}\n")
    print_goals(result, selection_split)
    if not sampling.is_greedy:
        print("sampling: outputs are not compared token for token (only greedy decoding is deterministic)")
        return 0
    reference = [o["tokens"] for o in result.report.entry(BASELINE_NAME).outputs]
    mismatched = [e.name for e in result.report.entries if [o["tokens"] for o in e.outputs] != reference]
    print(
        f"greedy outputs identical to {BASELINE_NAME}: {'all' if not mismatched else 'NOT ' + ', '.join(mismatched)}"
    )
    return int(bool(mismatched))


if __name__ == "__main__":
    sys.exit(main())
