"""Coarse classes of decoded token strings, for case studies of which tokens a selector kept or dropped.

`token_class` checks, in this order, and returns the first that holds:

1. `whitespace`: the text is non-empty and only whitespace (spaces, tabs, newlines, indentation).
2. `digits_operators`: after stripping surrounding whitespace, every character is an ASCII digit or one of
   `OPERATOR_CHARS` (arithmetic, comparison, bitwise operators, `=` and parentheses), e.g. "12", " +", "==", ")".
3. `keyword`: the stripped text is a Python keyword (`keyword.kwlist`, which includes True, False and None).
4. `identifier`: the stripped text satisfies `str.isidentifier()` (so non-ASCII letters such as "é" count).
5. `other`: everything else, including the empty string, punctuation such as "." or ",", and mixed text
   such as "foo(" or "1x".

Only 3 and 4 overlap (every keyword is an identifier), so the order matters there: keywords win.
"""

from __future__ import annotations

import keyword
import string
from collections.abc import Sequence

import torch

TOKEN_CLASSES = ("digits_operators", "keyword", "identifier", "whitespace", "other")
OPERATOR_CHARS = frozenset("+-*/%=<>!&|^~()")
_DIGITS_OPERATORS = frozenset(string.digits) | OPERATOR_CHARS
_KEYWORDS = frozenset(keyword.kwlist)


def token_class(text: str) -> str:
    """The class of one decoded token string: one of `TOKEN_CLASSES` (precedence in the module docstring)."""
    if text and text.isspace():
        return "whitespace"
    stripped = text.strip()
    if stripped and all(char in _DIGITS_OPERATORS for char in stripped):
        return "digits_operators"
    if stripped in _KEYWORDS:
        return "keyword"
    if stripped.isidentifier():
        return "identifier"
    return "other"


def kept_dropped_by_class(
    token_texts: Sequence[str], kept: Sequence[bool] | torch.Tensor
) -> dict[str, dict[str, int | float]]:
    """Kept and dropped counts per token class.

    Args:
        token_texts: `N` decoded token strings, N >= 1.
        kept: `N` bools (a list, or an `(N,)` bool tensor), True where the selector kept the token.

    Returns:
        For each class that occurs, in `TOKEN_CLASSES` order: `{"kept": int, "dropped": int, "kept_fraction":
        float}` with kept_fraction = kept / (kept + dropped).
    """
    if isinstance(kept, torch.Tensor):
        if kept.dim() != 1 or kept.dtype != torch.bool:
            raise ValueError(
                f"kept must be an (N,) bool tensor, got shape {tuple(kept.shape)} and {kept.dtype}"
            )
        kept = kept.tolist()
    if len(token_texts) != len(kept):
        raise ValueError(
            f"token_texts has {len(token_texts)} entries but kept has {len(kept)}; pass one kept flag per token"
        )
    if not token_texts:
        raise ValueError("kept_dropped_by_class got no tokens; pass at least one token and its kept flag")
    bad = next((flag for flag in kept if not isinstance(flag, bool)), None)
    if bad is not None:
        raise ValueError(
            f"kept must hold Python bools, got {type(bad).__name__}; pass mask.tolist() for a tensor"
        )
    return class_counts(token_texts, [int(flag) for flag in kept], [int(not flag) for flag in kept])


def class_counts(
    token_texts: Sequence[str], kept: Sequence[int], dropped: Sequence[int]
) -> dict[str, dict[str, int | float]]:
    """Kept and dropped counts per token class, from per-token counts (e.g. one row per vocabulary id).

    Args:
        token_texts: `N` decoded token strings.
        kept, dropped: `N` non-negative counts each: how often that token was kept / dropped.

    Returns:
        As `kept_dropped_by_class`: for each class with a count, in `TOKEN_CLASSES` order, `{"kept", "dropped",
        "kept_fraction"}`.
    """
    if not len(token_texts) == len(kept) == len(dropped):
        raise ValueError(
            f"class_counts needs one kept and one dropped count per token: {len(token_texts)} tokens, {len(kept)} "
            f"kept and {len(dropped)} dropped counts"
        )
    counts = {name: [0, 0] for name in TOKEN_CLASSES}
    for text, k, d in zip(token_texts, kept, dropped, strict=True):
        if k < 0 or d < 0:
            raise ValueError(f"class_counts got a negative count (kept {k}, dropped {d}) for token {text!r}")
        counts[token_class(text)][0] += int(k)
        counts[token_class(text)][1] += int(d)
    return {
        name: {"kept": k, "dropped": d, "kept_fraction": k / (k + d)}
        for name, (k, d) in counts.items()
        if k + d
    }
