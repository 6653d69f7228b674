"""The evaluation protocol: choose K and h per draft on a selection split, then report every policy on the test split.

`evaluate_drafts` is the one entry point, called by the evaluate stage and by `benchmarks/bench_pipeline_policies.py`
with an `EvalProtocol` (the grids, splits, decoding and timing below):

1. Selection, on `selection_prompts` from `selection_split` (never "test"): for each draft, the fastest
   `FixedLength(K)` over `fixed_lengths` (`best_fixed_length`, tokens/s); for each draft with an acceptance head, one
   `AcceptanceHeadPolicy` per threshold h, scoring mode and stop (`head_policy_grid`, `head_stops`: plain, withdrawn,
   and plain stops padded to the target's cheaper verification lengths on a whole-block drafter, `head_candidates`),
   the fastest chosen by `select_policy`.
2. Test, on `test_prompts` from `split`, in one `evaluate_policies` call (configurations interleaved prompt by
   prompt): the autoregressive target, then per draft, in this order, `<draft>/fixed_k{K}` (the chosen K), the
   given training-free `policies` in their order (e.g. heuristic, confidence, entropy, oracle), and every head
   policy of the grid, `<draft>/<draft>_acceptance_head_h{h}` (`_newest` suffix for newest-candidate scoring,
   `_withdrawn` for a policy that withdraws the candidate it stops on, `_padded` for padded stops). Every engine, in
   selection and test, gets the same bound `max_draft_length`.
   The `lookups` (prompt lookup alone, and a draft behind it: `HybridProposer`) follow the drafts with one row each,
   `<name>/fixed_k{K}` at the K chosen for them the same way. With `fit_hybrid`, a hybrid's choice of the matches
   it drafts from lookup (`HybridProposer.lookup_lengths`) is then fitted at the chosen K and its draft's K.
   With `acceptance_draft_length` = K0 (AdaSPEC's alpha, measured at one fixed draft length), every draft also runs
   `<draft>/fixed_k{K0}` on the test split (if K0 is not already its chosen K), and `acceptance_at_fixed_length`
   reports each draft's `acceptance_rate` there, beside the speed results.
3. `policy_ratios`: tokens/s of each draft's chosen head policy over its chosen fixed K
   (`<draft>/acceptance_head_over_best_fixed_k`) and over its oracle (`<draft>/acceptance_head_over_oracle`, when a
   policy named "oracle" is given), the SpecDec++ comparison of docs/METHODS.md section 4. All head policies are on
   the test table; the ratios use only the one chosen on the selection split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.decoding.head_policy import head_policy_grid
from specdistill.decoding.policies import CostPadded, DraftPolicy, FixedLength
from specdistill.decoding.proposers import Drafter
from specdistill.decoding.proposers.base import BlockProposer
from specdistill.decoding.sampling import SamplingConfig
from specdistill.evaluation.agreement import format_agreement, output_agreement
from specdistill.evaluation.report import Report, format_table
from specdistill.evaluation.runner import ScoreFn, best_fixed_length, evaluate_policies, select_policy
from specdistill.models.acceptance_head import AcceptanceHead

ORACLE_NAME = "oracle"
HEAD_NAME = "acceptance_head"


@dataclass
class EvaluationResult:
    """What `evaluate_drafts` measured.

    Attributes:
        report: the test-split report (`report.settings["selection"]` = `{"split": selection_split, **choices}`,
            `report.settings["ratios"]` = `ratios`); `Report.save(dir)` writes it.
        choices: per draft `{"best_k": K, "tokens_per_second_by_k": {K: tokens/s}}`, plus for drafts with a head
            `"best_head"` (the chosen policy's name in the report, `<draft>_acceptance_head_h{h}[_newest]`) and
            `"tokens_per_second_by_head"` (grid name `acceptance_head_h{h}[_newest]` -> tokens/s on selection).
        ratios: `<draft>/acceptance_head_over_best_fixed_k` and `<draft>/acceptance_head_over_oracle` (tokens/s
            ratios on the test split; a key is absent when either side is missing or has no tokens/s).
        table: `format_table(report)`, a newline, then `format_ratios(choices, ratios)`.
    """

    report: Report
    choices: dict[str, dict[str, Any]]
    ratios: dict[str, float]
    table: str


def policy_ratios(report: Report, choices: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """tokens/s of each draft's selection-chosen head policy over its chosen fixed K and over its oracle."""
    speed = {e.name: e.stats.metrics()["tokens_per_second"] for e in report.entries}
    ratios: dict[str, float] = {}
    for draft, choice in choices.items():
        head = speed.get(f"{draft}/{choice.get('best_head')}")
        fixed = speed.get(f"{draft}/fixed_k{choice['best_k']}")
        oracle = speed.get(f"{draft}/{ORACLE_NAME}")
        if head and fixed:
            ratios[f"{draft}/{HEAD_NAME}_over_best_fixed_k"] = head / fixed
        if head and oracle:
            ratios[f"{draft}/{HEAD_NAME}_over_oracle"] = head / oracle
    return ratios


def format_ratios(choices: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, float]) -> str:
    """One line with each draft's choices (`d: K=3, d_acceptance_head_h0.5`), then one `name = value` per ratio."""
    chosen = "; ".join(
        f"{d}: K={c['best_k']}"
        + (f" (the draft's rounds K={c['draft_k']})" if c.get("draft_k") else "")
        + (f", lookup at matched lengths {c['lookup_lengths']}" if "lookup_lengths" in c else "")
        + (f", {c['best_head']}" if c.get("best_head") else "")
        for d, c in choices.items()
    )
    lines = [f"chosen on the selection split (tokens/s): {chosen}"]
    lines += [f"{name} = {value:.3f}" for name, value in ratios.items()]
    return "\n".join(lines)


def acceptance_at_fixed_length(
    report: Report, drafts: Sequence[str], draft_length: int
) -> dict[str, float | None]:
    """Per draft, `acceptance_rate` of its `fixed_k{draft_length}` entry: AdaSPEC's alpha at a fixed draft length."""
    return {d: report.entry(f"{d}/fixed_k{draft_length}").stats.metrics()["acceptance_rate"] for d in drafts}


def format_acceptance(alpha: Mapping[str, float | None], draft_length: int) -> str:
    """One line: `acceptance_rate at fixed K = 4 (AdaSPEC's alpha): a 0.812, b 0.790`."""
    values = ", ".join(f"{d} {'n/a' if v is None else f'{v:.3f}'}" for d, v in alpha.items())
    return f"acceptance_rate at fixed K = {draft_length} (AdaSPEC's alpha): {values}"


@dataclass(frozen=True, kw_only=True)
class EvalProtocol:
    """How `evaluate_drafts` compares drafts (module doc): the grids chosen from on the selection split, the decoding
    every configuration shares, and the timing. The evaluate stage builds it from its settings
    (`specdistill.stages.evaluate.eval_protocol`), where the ranges are checked.

    Attributes:
        fixed_lengths: the K grid, each <= `max_draft_length`.
        head_thresholds: the h grid of the head policies.
        head_score_newest: candidate heads' scoring mode(s): False (public code), True, or both `[False, True]`.
        head_min_draft_length: the head policies' `min_draft_length` (enforced by the engine).
        head_stops: what the head policies' stops do (`plain`, `withdrawn`, `padded`: `HeadPolicyGrid.stops`); a
            padded policy needs `padding_cost`.
        max_draft_length: the engine's bound, most candidates per round, for every policy in selection and test.
        selection_split / split: the splits the selection / test prompts come from (`selection_split` must not be
            "test").
        sampling / max_new_tokens / seed: shared by every decoding, selection included.
        warmup: untimed generations per configuration, in selection and test.
        repeats / selection_repeats: timed passes over the test / selection prompts.
        acceptance_draft_length: the fixed K at which every draft's `acceptance_rate` is reported (AdaSPEC's
            alpha; None: not reported).
        padding_cost: the target's relative verification cost (`specdistill.decoding.cost`), which padded stops
            read: with `padded` in `head_stops`, every plain head policy on a draft that drafts a whole block in one
            pass also runs padded (`CostPadded`, named `<policy>_padded`) among the selection's candidates.
    """

    fixed_lengths: Sequence[int]
    head_thresholds: Sequence[float]
    head_score_newest: bool | Sequence[bool] = False
    head_min_draft_length: int = 2
    head_stops: Sequence[str] = ("plain",)
    max_draft_length: int = 20
    selection_split: str
    split: str
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    selection_repeats: int = 1
    acceptance_draft_length: int | None = None
    padding_cost: Mapping[int, float] | None = None


def drafts_whole_blocks(draft: Any) -> bool:
    """Whether `draft` drafts a round's whole block in one pass (a DFlash proposer), so that verifying more of it
    costs no drafting pass: a `BlockProposer` with `drafts_in_one_pass` (a hybrid's rounds differ, so it has not)."""
    return isinstance(draft, BlockProposer) and draft.drafts_in_one_pass


def head_candidates(head: AcceptanceHead, draft: Any, protocol: EvalProtocol) -> dict[str, DraftPolicy]:
    """The head policies chosen from on the selection split: the h grid (`head_policy_grid`) with the stops of
    `protocol.head_stops`, plain and withdrawn, and with `padded` on a whole-block drafter each plain policy padded
    (`<name>_padded`, its own policy state).

    Raises:
        ValueError: `padded` in `head_stops` without `padding_cost` to pad by.
    """
    stops = set(protocol.head_stops)
    if "padded" in stops and protocol.padding_cost is None:
        raise ValueError(
            "padded head stops need the target's verification cost: pass EvalProtocol(padding_cost=...)"
        )
    grid = functools.partial(
        head_policy_grid,
        head,
        list(protocol.head_thresholds),
        protocol.head_score_newest,
        protocol.head_min_draft_length,
    )
    withdraw = [drop for drop, stop in ((False, "plain"), (True, "withdrawn")) if stop in stops]
    candidates: dict[str, DraftPolicy] = dict(grid(withdraw=withdraw))
    if "padded" in stops and drafts_whole_blocks(draft):
        # a withdrawing policy takes a candidate out where padding adds some: only plain stops are padded
        cost = dict(protocol.padding_cost)
        candidates.update(
            {f"{name}_padded": CostPadded(policy, cost) for name, policy in grid(withdraw=False).items()}
        )
    return candidates


def greedy_agreement(
    target: torch.nn.Module, report: Report, prompts: Sequence[Mapping[str, Any]], vocab_size: int
) -> dict[str, dict[str, Any]]:
    """entry name -> `output_agreement` of its outputs with the autoregressive target's (greedy runs)."""
    baseline = report.baseline
    if baseline is None:
        return {}
    return {
        e.name: output_agreement(target, prompts, baseline.outputs, e.outputs, vocab_size)
        for e in report.entries
        if e is not baseline
    }


def evaluate_drafts(
    target: torch.nn.Module,
    drafts: Mapping[str, torch.nn.Module],
    heads: Mapping[str, AcceptanceHead],
    policies: Mapping[str, DraftPolicy],
    protocol: EvalProtocol,
    *,
    test_prompts: Sequence[Mapping[str, Any]],
    selection_prompts: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    vocab_size: int | None,
    score_fn: ScoreFn | None = None,
    task_metric_name: str | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    lookups: Mapping[str, Drafter] | None = None,
    hybrids: Mapping[str, str] | None = None,
    fit_hybrid: Callable[[str, int, int], frozenset[int]] | None = None,
) -> EvaluationResult:
    """Choose K (and h) per draft on the selection split, then decode the test prompts with everything (module doc).

    Args:
        target: the target causal LM (eval mode, on its device).
        drafts: draft name -> draft model; the report lists the drafts in this order.
        heads: draft name -> its trained `AcceptanceHead` (on the drafts' device); drafts without one get no head
            policies. Every key must be a draft.
        policies: training-free policies run on every draft (name -> policy, e.g. heuristic, confidence, entropy,
            oracle); not changed (the runner copies a policy shared by several drafts).
        protocol: the grids, splits, decoding and timing (`EvalProtocol`).
        test_prompts / selection_prompts: prompt dicts `{prompt_ids, record, example_id}` (see `evaluate_policies`)
            from `protocol.split` / `protocol.selection_split`.
        tokenizer: decodes outputs and gives the EOS and vocabulary defaults (may be None with `vocab_size`).
        vocab_size: the tokenizer's real vocabulary (None: `len(tokenizer)`).
        score_fn / task_metric_name: the task metric of the test outputs (e.g. `task.score`, `task.metric_name`).
        eos_token_id: overrides the tokenizer's EOS.
        lookups: proposers that draft from prompt lookup (name -> a `PromptLookupProposer`, or a `HybridProposer`
            of lookup and a draft), reported after the drafts at their own K chosen on the selection split; the
            policies and heads are the drafts' only.
        hybrids: lookup name -> the draft a `HybridProposer` in `lookups` drafts from where lookup finds nothing;
            its rounds from that draft are capped at the K chosen for the draft alone (`choices[name]["draft_k"]`),
            set on the proposer (`draft_length`) before its own K is chosen.
        fit_hybrid: `(draft name, the hybrid's K, the draft's K) -> the matched lengths lookup keeps`, called once
            per hybrid after its K is chosen; the result is set on the proposer (`lookup_lengths`) for the test
            split (`specdistill.drafts.prompt_lookup.choice`). None: the fixed rule, lookup on every match.
    """
    unknown = sorted(set(heads) - set(drafts))
    if unknown:
        raise ValueError(f"heads given for drafts that are not evaluated: {unknown}")
    hybrids = dict(hybrids or {})
    lookups = dict(lookups or {})
    stray = sorted(k for k, v in hybrids.items() if k not in lookups or v not in drafts)
    if stray:
        raise ValueError(
            f"hybrids {stray} must name a lookup given in `lookups` and a draft given in `drafts`"
        )
    clash = sorted(set(lookups) & set(drafts))
    if clash:
        raise ValueError(f"lookups {clash} have the names of drafts: give them other names")
    common: dict[str, Any] = dict(
        sampling=protocol.sampling, max_new_tokens=protocol.max_new_tokens, seed=protocol.seed, tokenizer=tokenizer,
        vocab_size=vocab_size, eos_token_id=eos_token_id, warmup=protocol.warmup,
        max_draft_length=protocol.max_draft_length,
    )  # fmt: skip
    selection = dict(
        prompts=selection_prompts,
        split=protocol.selection_split,
        repeats=protocol.selection_repeats,
        **common,
    )
    all_policies: dict[str, DraftPolicy] = dict(policies)
    combinations = [(d, p) for d in drafts for p in policies]
    choices: dict[str, dict[str, Any]] = {}
    for draft_name, draft in drafts.items():
        best_k, per_k = best_fixed_length(target, draft, list(protocol.fixed_lengths), **selection)
        choices[draft_name] = {"best_k": best_k, "tokens_per_second_by_k": per_k}
        fixed_name = f"fixed_k{best_k}"
        all_policies.setdefault(fixed_name, FixedLength(best_k))
        combinations.insert(0, (draft_name, fixed_name))
        alpha_k = protocol.acceptance_draft_length
        if alpha_k is not None and alpha_k != best_k:
            alpha_name = f"fixed_k{alpha_k}"
            all_policies.setdefault(alpha_name, FixedLength(alpha_k))
            combinations.insert(1, (draft_name, alpha_name))
        head = heads.get(draft_name)
        if head is None:
            continue
        candidates = head_candidates(head, draft, protocol)
        best, per_h = select_policy(target, draft, candidates, **selection)
        choices[draft_name].update(best_head=f"{draft_name}_{best}", tokens_per_second_by_head=per_h)
        for name, policy in candidates.items():
            all_policies[f"{draft_name}_{name}"] = policy
            combinations.append((draft_name, f"{draft_name}_{name}"))
    for name, lookup in lookups.items():
        draft_k = {}
        if name in hybrids:
            lookup.draft_length = draft_k["draft_k"] = choices[hybrids[name]]["best_k"]
        best_k, per_k = best_fixed_length(target, lookup, list(protocol.fixed_lengths), **selection)
        choices[name] = {"best_k": best_k, "tokens_per_second_by_k": per_k, **draft_k}
        if name in hybrids and fit_hybrid is not None:
            lookup.lookup_lengths = fit_hybrid(hybrids[name], best_k, draft_k["draft_k"])
            choices[name]["lookup_lengths"] = sorted(lookup.lookup_lengths)
        all_policies.setdefault(f"fixed_k{best_k}", FixedLength(best_k))
        combinations.append((name, f"fixed_k{best_k}"))
    order = [*drafts, *lookups]
    combinations.sort(key=lambda c: order.index(c[0]))  # stable: per draft fixed K, given policies, head grid

    report = evaluate_policies(
        target, {**drafts, **lookups}, all_policies, test_prompts, score_fn, combinations=combinations, repeats=protocol.repeats,
        task_metric_name=task_metric_name, split=protocol.split, **common,
    )  # fmt: skip
    if protocol.sampling.is_greedy:
        agreement = greedy_agreement(target, report, test_prompts, vocab_size or len(tokenizer))
        report.settings["greedy_agreement"] = agreement
    ratios = policy_ratios(report, choices)
    report.settings["selection"] = {"split": protocol.selection_split, **choices}
    report.settings["ratios"] = ratios
    table = format_table(report) + "\n" + format_ratios(choices, ratios)
    if protocol.sampling.is_greedy:
        table += "\n" + format_agreement(report.settings["greedy_agreement"], next(target.parameters()).dtype)
    acceptance_draft_length = protocol.acceptance_draft_length
    if acceptance_draft_length is not None:
        alpha = acceptance_at_fixed_length(report, list(drafts), acceptance_draft_length)
        report.settings["acceptance_at_fixed_length"] = {"draft_length": acceptance_draft_length, **alpha}
        table += "\n" + format_acceptance(alpha, acceptance_draft_length)
    return EvaluationResult(report, choices, ratios, table)
