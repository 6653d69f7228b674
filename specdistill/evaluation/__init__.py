"""Evaluation of speculative decoding: runner (baseline + draft x policy), reports, tables, plots, selection."""

from specdistill.evaluation.report import Report, ReportEntry, format_table
from specdistill.evaluation.runner import best_fixed_length, evaluate_policies, select_policy

__all__ = ["Report", "ReportEntry", "best_fixed_length", "evaluate_policies", "format_table", "select_policy"]
