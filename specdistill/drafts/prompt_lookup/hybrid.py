"""Prompt lookup first, a trained draft otherwise: one round drafts from whichever the context favours.

Where the context offers an n-gram match (code that repeats its names, an answer that quotes its prompt)
lookup's block costs nothing to draft; elsewhere the trained draft proposes as it always does. The rule is
fixed: a match wins. Each side drafts at its own length: lookup up to the round's K, the trained draft up to
`draft_length` (the evaluation sets the K chosen for that draft alone, `specdistill.evaluation.protocol`),
since a lookup block costs nothing per candidate while every chain step of a trained draft costs a forward
pass. The trained draft keeps its whole lifecycle: it is rolled back and shown the target's states after every
round, lookup's rounds included, and it catches up on the tokens it did not see the next time it drafts (a
draft LM reads them in one pass; an EAGLE-3 head drafts from the target states it was shown).

`lookup_lengths` replaces the fixed rule with a choice: lookup drafts only where its matched suffix has one of those
lengths, the trained draft everywhere else (`specdistill.drafts.prompt_lookup.choice` fits them on held-out answers).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specdistill.decoding.proposers.base import (
    BlockProposer,
    BlockRequest,
    DraftBlock,
    Proposer,
    WrappingProposer,
)
from specdistill.decoding.proposers.chain import ChainProposer
from specdistill.decoding.proposers.draft_lm import DraftLMProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer


class HybridProposer(WrappingProposer):
    """Drafts each round from `lookup` when it finds a match, else from `draft`.

    A round drafted by lookup is one block (`chained` is False for it); a round drafted by an autoregressive draft is
    a chain, as that draft alone would draft it (`chained` is read after every block, so it follows the round).

    Args:
        lookup: the prompt-lookup proposer.
        draft: the trained draft: a `Proposer` (run as a chain), a `BlockProposer`, or a causal LM (drafted with
            through a `DraftLMProposer`), on the same vocabulary.
        draft_length: most candidates a round drafted by `draft` holds (None: the round's K, as lookup's).
        lookup_lengths: the matched suffix lengths at which lookup drafts (None: every match, the fixed rule);
            a round with a match of another length is the draft's.
    """

    def __init__(
        self,
        lookup: PromptLookupProposer,
        draft: Proposer | BlockProposer | nn.Module,
        draft_length: int | None = None,
        lookup_lengths: frozenset[int] | None = None,
    ) -> None:
        self.lookup = lookup
        self.draft_length = draft_length
        self.lookup_lengths = lookup_lengths
        if not isinstance(draft, Proposer | BlockProposer):  # a causal LM, as the engine takes one
            draft = DraftLMProposer(draft, lookup.vocab_size)
        self.draft = self.wrapped = draft if isinstance(draft, BlockProposer) else ChainProposer(draft)
        if lookup.vocab_size != self.draft.vocab_size:
            raise ValueError(
                f"the lookup's vocab_size ({lookup.vocab_size}) differs from the draft's ({self.draft.vocab_size}): "
                "build both with the tokenizer's len(tokenizer)"
            )
        self._from_draft = False
        self._drafted = 0  # candidates `draft` proposed this round
        self.lookup_rounds = 0
        self.draft_rounds = 0

    @property
    def draft_length(self) -> int | None:
        return self._draft_length

    @draft_length.setter
    def draft_length(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"draft_length must be None or an int >= 1, got {value!r}")
        self._draft_length = value

    @property
    def lookup_lengths(self) -> frozenset[int] | None:
        return self._lookup_lengths

    @lookup_lengths.setter
    def lookup_lengths(self, value: frozenset[int] | None) -> None:
        if value is not None:
            value = frozenset(value)
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value):
                raise ValueError(
                    f"lookup_lengths must be None or matched lengths (ints >= 1), got {sorted(value)!r}"
                )
        self._lookup_lengths = value

    @property
    def chained(self) -> bool:  # type: ignore[override]
        return self._from_draft and self.draft.chained

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._from_draft, self._drafted = False, 0
        self.lookup_rounds = self.draft_rounds = 0
        self.lookup.start(prompt, capacity, cache_implementation)
        super().start(prompt, capacity, cache_implementation)

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        # every round starts with lookup, which refuses a policy that reads hidden states (it has none)
        if not self._from_draft:
            matched, block = self.lookup.matched_block(tokens, request)
            if len(block) and (self.lookup_lengths is None or matched in self.lookup_lengths):
                self.lookup_rounds += 1
                return block
            self._from_draft = True
            self.draft_rounds += 1
        # the draft's round, or the rest of its chain: at most `draft_length` candidates in all (an empty block ends
        # the round)
        left = request.max_length if self.draft_length is None else self.draft_length - self._drafted
        if left < 1:
            return DraftBlock(tokens[0, :0])
        block = self.draft.propose_block(
            tokens, dataclasses.replace(request, max_length=min(left, request.max_length))
        )
        self._drafted += len(block)
        return block

    def rollback(self, length: int) -> None:
        self._from_draft, self._drafted = False, 0  # every round starts by looking up
        super().rollback(length)
