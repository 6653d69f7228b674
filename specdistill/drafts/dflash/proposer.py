"""The DFlash block proposer: one drafter pass per round proposes up to `block_size - 1` candidates.

After each verification (`observe_target`) the proposer holds the target's states of every kept position `0 .. F - 1`
(`VerifiedStates`, `F` the target's verified length; the newest token, at `F`, has no state yet). A round extends the
drafter's context cache by the positions not cached yet (one `fc` + per-layer key/value projection), then runs one
block: the newest token and `block_size - 1` masks (`DFlashDrafter.draft`). Block position `j >= 1` scores the token
at `F + j`; every candidate is drawn with the engine's sampler from the target's output layer on that state, so
`DraftBlock.q` row `i` is the distribution candidate `i` was drawn from, given the sequence only (none of the block's
own draws): the engine's verification is exact for it (docs/METHODS.md). The block is always run whole, as trained;
the engine's cap only cuts the candidates returned.

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

    def __init__(self, drafter: DFlashDrafter, vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.target_hidden_layers = tuple(drafter.target_layers)
        self._head = drafter.output_head(vocab_size)
        self.forwards = 0
        self._cache: DFlashCache = drafter.new_cache()
        self._states = VerifiedStates()

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def length(self) -> int:
        return len(self._cache)

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._cache = self.drafter.new_cache()
        self._states = VerifiedStates()
        self.forwards = 0

    @torch.no_grad()
    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        verified = len(self._states)
        if verified == 0:  # the target has computed nothing yet: no opinion
            return DraftBlock(tokens.new_zeros((0,)))
        if tokens.shape[1] != verified + 1:
            raise ValueError(
                f"a DFlash block drafts after the verified prefix and the newest token: the sequence has "
                f"{tokens.shape[1]} tokens, the target's states cover {verified}"
            )
        cached = len(self._cache)
        if cached < verified:
            self.drafter.extend_cache(self._cache, self._states.rows[None, cached:verified])
        states = self.drafter.draft(self._cache, tokens[0, verified:])[0, 1:]
        self.forwards += 1
        count = min(request.max_length, states.shape[0])
        drawn, q = request.draw(self._head(states[:count]).float())
        return DraftBlock(drawn, q, states[:count] if request.with_hidden else None)

    def observe_target(self, verified: TargetHidden) -> None:
        self._states.observe(verified)
        if len(self._cache) > len(self._states):
            self._cache.crop(len(self._states))

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(
                f"rollback({length}) outside [0, {self.length}]: a proposer rolls back to at most what it covers "
                "(the engine's contract, see specdistill/decoding/proposers/base.py)"
            )
        self._cache.crop(length)
