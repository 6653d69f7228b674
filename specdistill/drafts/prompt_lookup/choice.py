"""Which of lookup's matches the hybrid drafts from: a choice per matched suffix length, fitted on held-out answers.

The hybrid's fixed rule (`HybridProposer` with `lookup_lengths=None`) drafts from lookup whenever the context offers
a match, however short. A one-token match often continues differently from the text it copies, and a trained draft
may do better there. The fitted choice compares, over teacher-forced anchors of held-out sequences (each prompt with
the target's greedy answer, `specdistill.evaluation.offline`), how many tokens the target accepts from lookup's block
(capped at the hybrid's K) and from the draft's chain (capped at the draft's own K), per matched length `n`; lookup
keeps the lengths where it accepts at least as many on average. It is a decision per round from what the context
shows before anything is drafted, so it costs no forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from specdistill.evaluation.offline import accepted_runs


def lookup_rows(lengths: torch.Tensor, lookup_lengths: Iterable[int] | None) -> torch.Tensor:
    """`(T,)` bool: the anchors where the hybrid drafts from lookup (a match of a length it keeps; None: any)."""
    if lookup_lengths is None:
        return lengths > 0
    kept = torch.tensor(sorted(lookup_lengths), dtype=lengths.dtype)
    return torch.isin(lengths, kept) & (lengths > 0)


def accepted_by_length(
    lengths: Sequence[torch.Tensor],
    lookup_runs: Sequence[torch.Tensor],
    draft_runs: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
) -> dict[int, tuple[int, float, float]]:
    """Matched length n -> (anchors, lookup's mean accepted tokens, the draft's) over the output anchors (from the
    prompt's last token to the one before the sequence's last) where lookup matched.

    Args:
        lengths: per sequence, the matched length at every anchor (`specdistill.evaluation.offline.lookup_blocks`).
        lookup_runs / draft_runs: per sequence, `accepted_runs` of each side, already capped at its K.
        prompt_lengths: per sequence, the prompt's length.
    """
    sums: dict[int, list[float]] = {}
    for n, lookup, draft, prompt in zip(lengths, lookup_runs, draft_runs, prompt_lengths, strict=True):
        anchors = torch.arange(n.numel()) >= prompt - 1
        anchors[-1:] = False  # nothing follows the last token
        for length in n[anchors & (n > 0)].unique().tolist():
            rows = anchors & (n == length)
            entry = sums.setdefault(length, [0, 0.0, 0.0])
            entry[0] += int(rows.sum())
            entry[1] += float(lookup[rows].sum())
            entry[2] += float(draft[rows].sum())
    return {n: (int(c), lsum / c, dsum / c) for n, (c, lsum, dsum) in sorted(sums.items())}


def fit_lookup_lengths(table: dict[int, tuple[int, float, float]], max_ngram: int) -> frozenset[int]:
    """The matched lengths at which lookup drafts: where it accepts at least as many tokens as the draft on
    average (`accepted_by_length`), and the lengths never seen (there the fixed rule stands)."""
    return frozenset(n for n in range(1, max_ngram + 1) if n not in table or table[n][1] >= table[n][2])


def fit_choice(
    sequences: Sequence[torch.Tensor],
    lookup: Sequence[tuple[torch.Tensor, torch.Tensor]],
    draft: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    k: int,
    draft_k: int,
    max_ngram: int,
) -> tuple[dict[int, tuple[int, float, float]], frozenset[int]]:
    """The choice fitted on `sequences` at the hybrid's K and the draft's: `accepted_by_length`'s table and the
    lengths lookup keeps (`fit_lookup_lengths`).

    Args:
        sequences: each prompt with the target's greedy answer, `(T,)`.
        lookup: per sequence, `lookup_blocks` (blocks and matched lengths).
        draft: per sequence, the draft's greedy chains `(T, J)` (`DraftKind.chain_candidates`).
        prompt_lengths: per sequence, the prompt's length.
    """
    lookup_runs = [accepted_runs(b, s).clamp(max=k) for (b, _), s in zip(lookup, sequences, strict=True)]
    draft_runs = [accepted_runs(c, s).clamp(max=draft_k) for c, s in zip(draft, sequences, strict=True)]
    table = accepted_by_length([n for _, n in lookup], lookup_runs, draft_runs, prompt_lengths)
    return table, fit_lookup_lengths(table, max_ngram)
