"""The hybrid's fitted choice (`specdistill/drafts/prompt_lookup/choice.py`) and `benchmarks/hybrid_choice.py`,
which fits it on half the validation answers and scores it on the other half (the real pair's figures:
docs/results/best.md)."""

from __future__ import annotations

import pytest
import torch

from specdistill.drafts.base import NO_CANDIDATE
from specdistill.drafts.prompt_lookup.choice import accepted_by_length, fit_lookup_lengths, lookup_rows
from specdistill.drafts.prompt_lookup.proposer import lookup_match
from specdistill.evaluation.offline import hybrid_candidates, lookup_blocks
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def study():
    return load_benchmark("hybrid_choice")


def test_the_match_length_is_the_longest_suffix_seen_before():
    tokens = torch.tensor([5, 6, 7, 5, 6])
    # anchor 3: "5" seen at 0 (n = 1); anchor 4: "5 6" seen at 0 (n = 2); earlier anchors: nothing repeats
    blocks, lengths = lookup_blocks(tokens, 1, 3, 2)
    assert lengths.tolist() == [0, 0, 0, 1, 2]
    assert lookup_blocks(tokens, 2, 3, 2)[1].tolist() == [0, 0, 0, 0, 2]
    # each anchor's block is what lookup drafts after the sequence up to it, padded
    assert blocks.tolist() == [[-1, -1], [-1, -1], [-1, -1], [6, 7], [7, 5]]
    n, block = lookup_match(tokens, 1, 3, 4)
    assert n == 2 and block.tolist() == [7, 5, 6]


def test_the_choice_keeps_lookup_where_it_accepts_as_much_and_at_lengths_never_seen():
    lengths = [torch.tensor([0, 1, 1, 2, 1, 2])]
    lookup_runs = [torch.tensor([9, 0, 1, 3, 0, 2])]
    draft_runs = [torch.tensor([9, 1, 2, 1, 5, 2])]
    # prompt of 2: anchors 1 .. 4 (the last token has nothing after it); anchor 0 is in the prompt
    table = accepted_by_length(lengths, lookup_runs, draft_runs, [2])
    assert table == {1: (3, 1 / 3, 8 / 3), 2: (1, 3.0, 1.0)}
    assert fit_lookup_lengths(table, 3) == frozenset({2, 3})
    assert fit_lookup_lengths({1: (4, 1.0, 1.0)}, 2) == frozenset({1, 2})  # a tie keeps lookup
    assert lookup_rows(torch.tensor([0, 1, 2, 3]), [2, 3]).tolist() == [False, False, True, True]
    assert lookup_rows(torch.tensor([0, 1, 2]), None).tolist() == [False, True, True]


def test_the_fitted_candidates_take_lookup_only_at_the_kept_lengths():
    lookup = torch.tensor([[1, 1], [2, 2], [NO_CANDIDATE, NO_CANDIDATE]])
    draft = torch.tensor([[7, 8], [7, 8], [7, 8]])
    rows = lookup_rows(torch.tensor([1, 2, 0]), [2, 3])
    # n = 1: the draft, cut to its K; n = 2: lookup's block; no match: the draft
    assert hybrid_candidates(lookup, draft, 1, rows).tolist() == [
        [7, NO_CANDIDATE],
        [2, 2],
        [7, NO_CANDIDATE],
    ]


def oracle(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """A draft that proposes the sequence's own next tokens at every anchor."""
    padded = torch.cat([tokens, tokens.new_full((depth + 1,), NO_CANDIDATE)])
    return padded.unfold(0, depth, 1)[1 : tokens.numel() + 1].clone()


def sequences(draft: str, depth: int = 4) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in range(6):
        tokens = torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(seed))
        blocks, lengths = lookup_blocks(tokens, 1, 3, depth)
        out.append(
            {
                "tokens": tokens,
                "lengths": lengths,
                "lookup": blocks,
                "draft": oracle(tokens, depth)
                if draft == "oracle"
                else torch.full((40, depth), NO_CANDIDATE),
            }
        )
    return out


def test_a_draft_that_is_always_right_takes_the_weak_matches(study):
    fold = study.fold_figures(sequences("oracle"), [5] * 6, [0, 2, 4], [1, 3, 5], 4, 4, 3)
    # on random tokens a one-token match rarely continues as before; the oracle draft accepts its whole K
    table = fold["accepted_by_matched_length"]
    assert table[1][2] == pytest.approx(4.0, abs=0.5) and table[1][1] < table[1][2]
    assert 1 not in fold["lookup_lengths"]
    per_call = fold["tokens_per_target_call"]
    assert per_call["hybrid_fitted"] > per_call["hybrid_fixed_rule"]


def test_a_draft_that_never_proposes_leaves_the_fixed_rule(study):
    fold = study.fold_figures(sequences("none"), [5] * 6, [0, 2, 4], [1, 3, 5], 4, 2, 3)
    assert fold["lookup_lengths"] == [1, 2, 3]
    per_call = fold["tokens_per_target_call"]
    assert per_call["hybrid_fitted"] == per_call["hybrid_fixed_rule"] == per_call["prompt_lookup"]
    assert per_call["draft"] == 1.0
