"""Prompt lookup first, a trained draft otherwise: one round drafts from whichever the context favours.

Where the context offers an n-gram match (code that repeats its names, an answer that quotes its prompt) lookup's
block costs nothing to draft; elsewhere the trained draft proposes as it always does. The rule is fixed: a match
wins. The trained draft keeps its whole lifecycle: it is rolled back and shown the target's states after every
round, lookup's rounds included, and it catches up on the tokens it did not see the next time it drafts (a draft LM
reads them in one pass; an EAGLE-3 head drafts from the target states it was shown).
"""

from __future__ import annotations

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
    """

    def __init__(self, lookup: PromptLookupProposer, draft: Proposer | BlockProposer | nn.Module) -> None:
        self.lookup = lookup
        if not isinstance(draft, Proposer | BlockProposer):  # a causal LM, as the engine takes one
            draft = DraftLMProposer(draft, lookup.vocab_size)
        self.draft = self.wrapped = draft if isinstance(draft, BlockProposer) else ChainProposer(draft)
        if lookup.vocab_size != self.draft.vocab_size:
            raise ValueError(
                f"the lookup's vocab_size ({lookup.vocab_size}) differs from the draft's ({self.draft.vocab_size}): "
                "build both with the tokenizer's len(tokenizer)"
            )
        self._from_draft = False
        self.lookup_rounds = 0
        self.draft_rounds = 0

    @property
    def chained(self) -> bool:  # type: ignore[override]
        return self._from_draft and self.draft.chained

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._from_draft = False
        self.lookup_rounds = self.draft_rounds = 0
        self.lookup.start(prompt, capacity, cache_implementation)
        super().start(prompt, capacity, cache_implementation)

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        # every round starts with lookup, which refuses a policy that reads hidden states (it has none)
        if self._from_draft:  # the rest of a chain this round
            return self.draft.propose_block(tokens, request)
        block = self.lookup.propose_block(tokens, request)
        if len(block):
            self.lookup_rounds += 1
            return block
        self._from_draft = True
        self.draft_rounds += 1
        return self.draft.propose_block(tokens, request)

    def rollback(self, length: int) -> None:
        self._from_draft = False  # every round starts by looking up
        super().rollback(length)
