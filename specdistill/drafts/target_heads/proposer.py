"""The proposer of any draft head on the target's hidden states (`TargetStateHead`): it drafts from the target's
states of the verified prefix.

Head position `t` reads the target's states of sequence position `t` and the token `t + 1`, and scores position
`t + 2` (`specdistill.drafts.target_heads.head`). After each verification (`observe_target`) the proposer holds the
target's states of every kept position `0 .. F - 1` (`F` = the target's verified length, at most `n - 1`;
`VerifiedStates`); its next `propose` runs the head on the real states of the positions not yet cached, then
continues the draft chain on its own outputs (`HeadOutput.hidden`) up to position `n - 2`, whose logits score the
first candidate. Chain positions are dropped at the next verification and recomputed from the target's real states
(EAGLE's rule), so `length` counts the tokens read by real-state positions only: the engine's rollback then never
goes below it.

The draft distribution lives on the draft vocabulary: draft id `i` is target id `target_ids[i]`, and every other
target id gets draft probability 0 (logit -inf), so the engine's residual `max(p - q, 0)` gives those tokens the
target's mass and decoding stays lossless. Before the first verification the target has computed nothing, so the
engine's first round only prefills (`drafts_after_prefill`); asked anyway, the proposer has no opinion (uniform
logits), as a proposer without states must.
"""

from __future__ import annotations

import torch

from specdistill.decoding.proposers.base import DraftProposal, Proposer, TargetHidden, check_vocab_size
from specdistill.drafts.target_heads.head import HeadOutput, TargetStateHead
from specdistill.drafts.target_heads.states import VerifiedStates


class TargetHeadProposer(Proposer):
    """Drafts with a `TargetStateHead` on the target's states at its `target_layers`.

    Args:
        head: the head, in eval mode, ready to run (e.g. an EAGLE-3 head with the target's embeddings attached).
        vocab_size: the tokenizer's real vocabulary; every draft-vocabulary id must lie below it.
    """

    drafts_after_prefill = True

    def __init__(self, head: TargetStateHead, vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        self.head = head
        self.vocab_size = vocab_size
        self.target_hidden_layers = tuple(head.target_layers)
        target_ids = head.target_ids
        if int(target_ids.max()) >= vocab_size or int(target_ids.min()) < 0:
            raise ValueError(
                f"the {type(head).__name__}'s draft vocabulary names target ids up to {int(target_ids.max())}, "
                f"outside the tokenizer's {vocab_size} tokens: build the draft vocabulary from this tokenizer's data"
            )
        self._target_ids = target_ids
        self.forwards = 0
        self._cache = head.new_cache()
        self._states = VerifiedStates()
        self._real = 0  # cached positions computed from real target states (a prefix of the cache)
        self._last: HeadOutput | None = None  # the newest cached position's output

    @property
    def device(self) -> torch.device:
        return self.head.device

    @property
    def length(self) -> int:
        # position t reads tokens 0 .. t + 1 (the target's state of t covers 0 .. t)
        return len(self._cache) + 1 if len(self._cache) else 0

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._cache = self.head.new_cache()
        self._states = VerifiedStates()
        self._real = 0
        self._last = None
        self.forwards = 0

    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        available = len(self._states)
        if available == 0:  # nothing verified yet
            logits = torch.zeros(self.vocab_size, device=self.device)
            hidden = torch.zeros(self.head.hidden_size, device=self.device) if with_hidden else None
            return DraftProposal(logits, hidden)
        head, end = self.head, tokens.shape[1]
        if self._real < available:  # real-state positions: one forward over all of them
            positions = torch.arange(self._real, available, device=self.device)
            self._last = head.step(
                tokens[:, self._real + 1 : available + 1],
                head.fuse(self._states.rows[None, self._real : available]),
                positions,
                self._cache,
            )
            self._real = available
            self.forwards += 1
        while len(self._cache) < end - 1:  # the draft chain, one position at a time on its own outputs
            position = len(self._cache)
            self._last = head.step(
                tokens[:, position + 1 : position + 2],
                self._last.hidden[:, -1:],
                torch.tensor([position], device=self.device),
                self._cache,
            )
            self.forwards += 1
        draft = self._last.logits[0, -1]
        logits = torch.full((self.vocab_size,), float("-inf"), device=draft.device, dtype=draft.dtype)
        logits[self._target_ids] = draft
        return DraftProposal(logits, self._last.normed[0, -1] if with_hidden else None)

    def observe_target(self, verified: TargetHidden) -> None:
        self._states.observe(verified)
        # chain positions read the head's own outputs: recompute them from the target's states next time
        self._real = min(self._real, verified.start)
        self._cache.crop(self._real)
        self._last = None

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(
                f"rollback({length}) outside [0, {self.length}]: a proposer rolls back to at most what it covers "
                "(the engine's contract, see specdistill/decoding/proposers/base.py)"
            )
        keep = max(length - 1, 0)
        if keep < len(self._cache):
            self._cache.crop(keep)
            self._last = None
        self._real = min(self._real, keep)
