"""The DFlash block proposer: one drafter pass per round drafts up to `block_size - 1` candidates.

After each verification (`observe_target`) the proposer holds the target's states of every kept position `0 .. F - 1`
(`VerifiedStates`, `F` the target's verified length; the newest token, at `F`, has no state yet). A round's first
call extends the drafter's context cache by the positions not cached yet (one `fc` + per-layer key/value
projection), then runs one block: the newest token and `block_size - 1` masks (`DFlashDrafter.draft`). Block position
`j >= 1` scores the token at `F + j`. The block is always run whole, as trained.

Its candidates are handed out one per call (`chained`): call `j` of the round scores block position `j + 1` with the
target's output layer and draws candidate `j` from it with the engine's sampler, so a round that the policy stops
after `k` candidates scores and draws `k` rows, not `block_size - 1` (the output layer over the target's whole
vocabulary and, when sampling, the warping's sort are what a block's extra rows cost). Every row's state comes from
the one pass, which saw none of the round's draws: `DraftBlock.q` of candidate `j` is the distribution it was drawn
from given the sequence only, and the engine's verification is exact for it (docs/METHODS.md).

Rejected candidates leave nothing behind: the context cache covers verified positions only, so `rollback` crops it
to the accepted prefix and the next round re-reads the target's states of what was accepted.
"""

from __future__ import annotations

import torch

from specdistill.decoding.proposers.base import (
    BlockProposer,
    BlockRequest,
    DraftBlock,
    TargetHidden,
    check_vocab_size,
)
from specdistill.drafts.dflash.model import DFlashCache, DFlashDrafter
from specdistill.drafts.target_heads.states import VerifiedStates


class DFlashProposer(BlockProposer):
    """Drafts blocks with a `DFlashDrafter` (in eval mode, its target attached).

    Args:
        drafter: the drafter.
        vocab_size: the tokenizer's real vocabulary (the target's output rows beyond it are dropped).
    """

    drafts_after_prefill = True
    chained = True  # one candidate per call, scored on demand from the round's one pass
    drafts_in_one_pass = True

    def __init__(self, drafter: DFlashDrafter, vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.target_hidden_layers = tuple(drafter.target_layers)
        self._head = drafter.output_head(vocab_size)
        self.forwards = 0
        self._cache: DFlashCache = drafter.new_cache()
        self._states = VerifiedStates()
        self._block: torch.Tensor | None = None  # the round's candidate states, `(block_size - 1, H)`

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def length(self) -> int:
        return len(self._cache)

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._cache = self.drafter.new_cache()
        self._states = VerifiedStates()
        self._block = None
        self.forwards = 0

    @torch.no_grad()
    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        verified = len(self._states)
        if verified == 0:  # the target has computed nothing yet: no opinion
            return DraftBlock(tokens.new_zeros((0,)))
        served = tokens.shape[1] - verified - 1  # this round's candidates already handed out
        if served == 0:
            self._block = self._run_block(tokens, verified)
        elif self._block is None or served < 0:
            raise ValueError(
                f"a DFlash block drafts after the verified prefix and the newest token: the sequence has "
                f"{tokens.shape[1]} tokens, the target's states cover {verified}"
            )
        if served >= self._block.shape[0]:  # the block is used up: the round verifies what it holds
            return DraftBlock(tokens.new_zeros((0,)))
        state = self._block[served : served + 1]
        drawn, q = request.draw(self._head(state).float())
        return DraftBlock(drawn, q, state if request.with_hidden else None)

    def _run_block(self, tokens: torch.Tensor, verified: int) -> torch.Tensor:
        """The round's one drafter pass: `(block_size - 1, H)` the states of the block's candidate positions."""
        cached = len(self._cache)
        if cached < verified:
            self.drafter.extend_cache(self._cache, self._states.rows[None, cached:verified])
        self.forwards += 1
        return self.drafter.draft(self._cache, tokens[0, verified:])[0, 1:]

    def observe_target(self, verified: TargetHidden) -> None:
        self._block = None
        self._states.observe(verified)
        if len(self._cache) > len(self._states):
            self._cache.crop(len(self._states))

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(
                f"rollback({length}) outside [0, {self.length}]: a proposer rolls back to at most what it covers "
                "(the engine's contract, see specdistill/decoding/proposers/base.py)"
            )
        self._block = None
        self._cache.crop(length)
