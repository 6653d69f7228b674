"""The proposer contract: what the speculative-decoding engine asks of whatever drafts its candidates.

The engine (`specdistill/decoding/engine.py`) owns the sequence, verification, acceptance, the target cache, every
bound on the draft length (the policy's minimum, `max_draft_length`, the remaining budget, EOS), the oracle probe,
timing and `DecodingStats`. A proposer owns drafting only: its own state (KV caches built with
`specdistill.models.cache.new_cache`, n-gram tables, ...) and the candidates. A new draft kind (a draft LM, an
EAGLE-style head on the target's hidden states, a block drafter, prompt lookup) is a new proposer; the engine does
not change.

The engine drafts in **blocks**: `BlockProposer.propose_block` returns a `DraftBlock`, candidate tokens with the
distribution each was drawn from, and the engine verifies the round's candidates in one target pass. A block
drafter (DFlash) draws all of its tokens from one forward pass, scoring and drawing each only when the engine asks
for it (`chained`, one token per call, so a round stopped early scores no more rows); prompt lookup copies them from
the context (each a point mass); an autoregressive `Proposer` gives the logits of one next token per call and the engine drives it
through `ChainProposer` (`specdistill/decoding/proposers/chain.py`), whose blocks hold one token each, so a chain is
a sequence of one-token blocks, drawn one after another. The engine asks the draft-length policy after every
candidate of every block, in order, and ends the round at the first stop (the rest of the block is dropped), so
every policy, the acceptance head and the oracle work the same for every kind. A round asks a block proposer for
one block (a chain, `chained`, for blocks until the policy stops, the round's cap is reached or a candidate is EOS);
a block may come back empty (a proposer with nothing to propose: the target then emits one token, as without
speculation).

Exactness for any block: the engine accepts candidate i with probability min(1, p_i(d_i) / q_i(d_i)) and resamples
a rejection from norm(max(0, p_i - q_i)), where p_i is the target's distribution given the sequence up to d_i and
q_i the distribution `DraftBlock.q` says d_i was drawn from, given the same prefix. Whatever q_i depends on (the
context, the earlier candidates or neither) the emitted token then has distribution p_i; docs/METHODS.md gives the
argument.

Call order, for each generated sequence:

1. `start(prompt, capacity, cache_implementation)` once, before anything else of that sequence. It resets the
   proposer's state (`length` becomes 0, `forwards` 0); it need not process the prompt, which the first proposal
   hands over anyway.
2. Every round: `propose_block(tokens, request)` with `tokens` the sequence so far (for a chain, again with
   `tokens` extended by the candidates drafted so far, while the round goes on). (For a `Proposer`: `propose(tokens,
   with_hidden)` once at the start of drafting, then once more per candidate the engine wants fed back.) A round
   that may draft nothing (the token budget is spent) asks for nothing.
3. After every verification, only when `target_hidden_layers` is not None: `observe_target(TargetHidden)`, with the
   target's hidden states of the positions that verification pass computed.
4. After every verification (also of a round without candidates): `rollback(length)`.

Cache invariant: `length` is the number of leading sequence tokens the proposer's state covers. The engine never
changes a token the proposer covers before the next `rollback`, except the candidates after the accepted ones
(which the rollback then drops). A proposal consumes `tokens[:, length:]` (at least one token: the engine keeps
every state at most `n - 1` tokens long, so the newest token is always new) and afterwards covers at most
`tokens.shape[1]` tokens, plus the block's own candidates for a proposer that feeds them back. `rollback(length)`
keeps the first `length` tokens (the accepted prefix the engine keeps) and forgets the rest: `length <=
self.length` and `length >=` the length of the previous `rollback` of this sequence (a sliding-window cache has
dropped what lies before it, see `specdistill.models.cache.crop_cache`), so rollbacks are crops, never
recomputations. A proposer without state (prompt lookup) covers nothing: `length` stays 0.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


def check_vocab_size(vocab_size: int) -> None:
    """`vocab_size` must be a positive int: the tokenizer's real vocabulary, `len(tokenizer)`."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int (len(tokenizer)), got {vocab_size!r}")


@dataclass
class DraftProposal:
    """The draft's view of the next token, after the proposer consumed `tokens` (`end = tokens.shape[1]`).

    Attributes:
        logits: `(V,)` unwarped draft logits of the token at position `end`, on the real vocabulary (`V` =
            `vocab_size`). The engine warps them exactly as the target's and samples the candidate from them.
        hidden: `(H,)` the hidden state an acceptance head reads when `propose(..., with_hidden=True)`, else None.
            For a draft LM it is the last hidden state after the final norm (what its LM head reads), whose input
            is the token at position `end - 1` and from which `logits` are computed.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class DraftBlock:
    """Candidates drafted in one `propose_block` call, each with the distribution it was drawn from.

    Attributes:
        tokens: `(k,)` long candidate ids on the proposer's device, `0 <= k <= request.max_length` (0: nothing to
            propose this time).
        q: `(k, V)` row i is the distribution `tokens[i]` was drawn from, given the sequence and `tokens[:i]`, as
            `BlockRequest.draw` returns it (the warped distribution when sampling; in greedy mode the softmax of
            the raw draft logits, what policies read as the draft's confidence). None when every token was chosen
            deterministically: a point mass on it (prompt lookup).
        hidden: `(k, H)` the states an acceptance head reads (only when `request.with_hidden`), else None. For a
            block drafter row i is the state its head read to draw `tokens[i]`; for a chain see `BlockRequest`.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class BlockRequest:
    """What the engine asks of one `propose_block` call.

    Attributes:
        max_length: most candidates the block may hold (>= 1); the engine's cap for the rest of the round.
        with_hidden: fill `DraftBlock.hidden` (the policy reads states: `needs_hidden_states`).
        feed_newest: for a chain (`ChainProposer`), feed each candidate back before returning it, so its hidden
            state is the one whose input is the candidate (`DraftPolicy.feed_newest`); without it the state is the
            one that predicted the candidate. A block drafter ignores it.
        draw: the engine's sampler, `logits (..., V) -> (tokens (...), distributions (..., V))`: argmax in greedy
            mode, else a sample from the warped distribution with the round's generator. A proposer that draws
            from logits draws with it, so its candidates follow the warping the target is verified under.
    """

    max_length: int
    with_hidden: bool
    feed_newest: bool
    draw: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TargetHidden:
    """The target's hidden states of the tokens one verification pass ran on (for `observe_target`).

    Attributes:
        start: sequence position of the first row (the target cache length before the pass).
        states: one `(T, H_target)` tensor per entry of the proposer's `target_hidden_layers`, in that order: row
            `i` is the state whose input is the token at position `start + i` (the state the target's LM head reads
            to score position `start + i + 1`, for the last layer).
        num_candidates: the last `num_candidates` rows belong to this round's candidates (positions `n .. n + k -
            1`, `n` the sequence length before the round); the rows before them to tokens already in the sequence.
        accepted: how many candidates the target accepted (the engine's count: a withdrawn candidate accepted after
            all counts, so it may be `num_candidates + 1`; only `num_candidates` of them have a row).
        verified_length: rows of positions below it belong to tokens that stay in the sequence; the target cache is
            cropped to it after the round. Rows at or after it (rejected candidates, tokens past EOS) are stale.
    """

    start: int
    states: tuple[torch.Tensor, ...]
    num_candidates: int
    accepted: int
    verified_length: int


class Drafter(abc.ABC):
    """What every proposer shares: its state over one sequence (see the module docstring for the call order).

    Attributes:
        vocab_size: the tokenizer's real vocabulary; the logits and distributions it proposes have this many entries. The engine
            refuses a proposer whose `vocab_size` differs from its own.
        target_hidden_layers: indices into the target's `output_hidden_states` tuple (0: the embeddings, `i`: after
            layer `i`, -1: the last, after the final norm) whose states this proposer reads, or None (default) for
            none. When set, verification runs the target with `output_hidden_states=True` and calls
            `observe_target` after every round; when None the target forward stays as cheap as without proposers.
        forwards: forward passes (of whatever model the proposer runs) since `start`; the engine reports it as
            `DecodingStats.draft_forwards`. Subclasses reset it in `start` and count in `propose`.
        drafts_after_prefill: True for a proposer that drafts only from the target's states (an EAGLE head): the
            engine's first round then sends no candidates (the target prefills the prompt and emits its next
            token) and drafting starts at the second round. False (default): the first round drafts too.
    """

    vocab_size: int
    target_hidden_layers: tuple[int, ...] | None = None
    forwards: int = 0
    drafts_after_prefill: bool = False

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the proposer computes: the sequence's tokens and the generator live here (the target too, unless
        it is placed across devices with a device_map)."""

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Leading sequence tokens the proposer's state covers (its cache length)."""

    @property
    def cache(self) -> Cache | None:
        """The proposer's KV cache, if it has one (exposed in `DecodeState.draft_cache` for tests); default None."""
        return None

    @abc.abstractmethod
    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        """Begin a new sequence: forget the previous one, build fresh state, `length` and `forwards` become 0.

        Args:
            prompt: `(1, P)` prompt ids on `device` (the first `propose` passes them again).
            capacity: most positions the sequence will reach (prompt, output and one round's candidates), the
                `max_length` of a static cache.
            cache_implementation: `"dynamic"` or `"static"` (`specdistill.models.cache.new_cache`), the same as
                the target's.
        """

    def observe_target(self, verified: TargetHidden) -> None:
        """Receive the target's hidden states of a verification pass (only when `target_hidden_layers` is set).

        Called after every verification, before `rollback`. A proposer that sets `target_hidden_layers` overrides
        it; the default refuses, so a forgotten override is an error rather than states silently dropped.
        """
        raise NotImplementedError(
            f"{type(self).__name__} sets target_hidden_layers = {self.target_hidden_layers!r} but does not "
            "override observe_target: implement it (or set target_hidden_layers to None)."
        )

    @abc.abstractmethod
    def rollback(self, length: int) -> None:
        """Keep the state of the first `length` tokens only (`previous rollback's length <= length <= self.length`).

        Called after every verification with the accepted prefix the engine keeps; afterwards `self.length == length`.
        """


class Proposer(Drafter):
    """An autoregressive proposer: the draft's logits of one next token per call (a draft LM, an EAGLE head).

    The engine drafts a chain with it through `ChainProposer`, sampling each candidate from the logits of the latest
    `propose` and feeding it back with the next call.
    """

    @abc.abstractmethod
    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        """Consume `tokens[:, length:]` and return the draft's view of the token at position `tokens.shape[1]`.

        Args:
            tokens: `(1, end)` the sequence so far (prompt, accepted tokens, this round's candidates), on `device`.
            with_hidden: also return `DraftProposal.hidden` (the policy reads it: `needs_hidden_states`).
        """


class BlockProposer(Drafter):
    """Drafts a block of candidates per call: the contract the engine drafts through (see the module docstring).

    Attributes:
        chained: False (default): one block per round. True: the engine asks again after every block the policy
            did not stop, each time with the sequence extended by it (`ChainProposer`'s one-token blocks; a DFlash
            proposer's candidates, handed out one per call from the round's one pass).
        drafts_in_one_pass: True when one drafting pass per round yields every candidate the round can hold, so
            that more of them cost only their scoring (DFlash); False (default) for chains and lookup.
    """

    chained: bool = False
    drafts_in_one_pass: bool = False

    @abc.abstractmethod
    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        """Consume `tokens[:, length:]` and draft at most `request.max_length` candidates after `tokens`.

        Args:
            tokens: `(1, end)` the sequence so far (prompt, accepted tokens, the candidates kept so far in this
                round), on `device`.
            request: the round's cap, what to return and how to draw.
        """


class WrappingProposer(BlockProposer):
    """A block proposer around another proposer, `wrapped`, whose state is the state over the sequence: every
    lifecycle member (`Drafter`'s) is the wrapped proposer's. Subclasses set `wrapped` and write `propose_block`."""

    wrapped: Drafter

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.wrapped.vocab_size

    @property
    def target_hidden_layers(self) -> tuple[int, ...] | None:  # type: ignore[override]
        return self.wrapped.target_hidden_layers

    @property
    def drafts_after_prefill(self) -> bool:  # type: ignore[override]
        return self.wrapped.drafts_after_prefill

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return self.wrapped.forwards

    @property
    def device(self) -> torch.device:
        return self.wrapped.device

    @property
    def length(self) -> int:
        return self.wrapped.length

    @property
    def cache(self) -> Cache | None:
        return self.wrapped.cache

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self.wrapped.start(prompt, capacity, cache_implementation)

    def observe_target(self, verified: TargetHidden) -> None:
        self.wrapped.observe_target(verified)

    def rollback(self, length: int) -> None:
        self.wrapped.rollback(length)
