"""An autoregressive `Proposer` behind the block contract: a chain of one-token blocks, drawn one after another."""

from __future__ import annotations

import torch

from specdistill.decoding.proposers.base import (
    BlockRequest,
    DraftBlock,
    DraftProposal,
    Proposer,
    WrappingProposer,
)


class ChainProposer(WrappingProposer):
    """Drafts one token per block with an autoregressive `Proposer`, which keeps its whole lifecycle.

    Each block holds the token drawn from the latest proposal. With `request.feed_newest` the token is fed back
    before the block returns (its hidden state is then the one whose input is the token) and that proposal is kept
    for the next block of the round; without it the next block proposes from the extended sequence. The inner
    proposer sees exactly the calls the one-token contract describes.

    Args:
        proposer: the autoregressive proposer (`DraftLMProposer`, `Eagle3Proposer`, ...).
    """

    chained = True

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = self.wrapped = proposer
        self._pending: DraftProposal | None = None
        self._pending_end = -1

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._pending = None
        super().start(prompt, capacity, cache_implementation)

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        end = tokens.shape[1]
        if self._pending is not None and self._pending_end == end:
            proposal = self._pending
        else:
            proposal = self.proposer.propose(tokens, request.with_hidden)
        self._pending = None
        token, probs = request.draw(proposal.logits)
        hidden = proposal.hidden
        if request.feed_newest:
            fed = torch.cat([tokens, token.view(1, 1).to(tokens.dtype)], dim=1)
            self._pending, self._pending_end = self.proposer.propose(fed, request.with_hidden), end + 1
            hidden = self._pending.hidden
        return DraftBlock(token.view(1), probs.unsqueeze(0), None if hidden is None else hidden.unsqueeze(0))

    def rollback(self, length: int) -> None:
        self._pending = None
        super().rollback(length)
