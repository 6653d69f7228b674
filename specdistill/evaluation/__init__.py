"""Evaluation of speculative decoding: runner (baseline + draft x policy), reports, tables, plots, selection, and the
protocol (selection on validation, report on test) that the evaluate stage runs."""

from specdistill.evaluation.protocol import (
    EvalProtocol,
    EvaluationResult,
    evaluate_drafts,
    format_ratios,
    policy_ratios,
)
from specdistill.evaluation.report import Report, ReportEntry, format_table
from specdistill.evaluation.runner import best_fixed_length, evaluate_policies, select_policy

__all__ = [
    "EvaluationResult",
    "Report",
    "ReportEntry",
    "best_fixed_length",
    "EvalProtocol",
    "evaluate_drafts",
    "evaluate_policies",
    "format_ratios",
    "format_table",
    "policy_ratios",
    "select_policy",
]
