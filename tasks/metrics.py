"""Small task metrics with no extra dependency: ROUGE-L F-measure and number normalisation."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# rouge_score's default tokenisation: lowercase, anything but [a-z0-9] separates tokens (no stemming here)
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
# a number as written in word problems: optional sign, thousands commas, decimals ("-1,234.50", "$7", "3.")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def rouge_tokens(text: str) -> list[str]:
    """Lowercased alphanumeric tokens, as rouge_score tokenises without stemming."""
    return [t for t in _NON_ALNUM.split(text.lower()) if t]


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f(prediction: str, reference: str) -> float:
    """Sentence-level ROUGE-L F1 (beta = 1) of `prediction` against `reference`, in [0, 1].

    Matches `rouge_score.rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)`'s `fmeasure`. Two empty texts
    score 0 (nothing was summarised).
    """
    pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def normalise_number(text: str) -> str | None:
    """Canonical string of a number ("1,234.50" -> "1234.5", "72.0" -> "72", "-0" -> "0"); None if not a number."""
    cleaned = text.replace(",", "").strip().rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
