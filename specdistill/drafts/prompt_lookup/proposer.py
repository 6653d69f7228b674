"""Prompt lookup: candidates copied from the context, no model and nothing trained (vLLM's `ngram` method).

The longest suffix of the sequence, between `min_ngram` and `max_ngram` tokens, that occurred earlier in it is
looked up; the block is the tokens that followed its earliest earlier occurrence. These are the rules of vLLM's
n-gram proposer (`prompt_lookup_min`, `prompt_lookup_max`, `num_speculative_tokens`), so figures measured here
describe what vLLM serves with the exported settings. Each candidate is a point mass (`DraftBlock.q` is None): under
sampling the target accepts it with probability p(candidate) and resamples a rejection from p without it.
"""

from __future__ import annotations

import torch

from specdistill.decoding.proposers.base import BlockProposer, BlockRequest, DraftBlock, check_vocab_size


def lookup_match(
    context: torch.Tensor, min_ngram: int, max_ngram: int, max_tokens: int
) -> tuple[int, torch.Tensor]:
    """The longest suffix n-gram that occurred earlier, and the tokens after its earliest earlier occurrence.

    Args:
        context: `(L,)` token ids, the sequence so far.
        min_ngram / max_ngram: the suffix lengths tried, longest first.
        max_tokens: most tokens returned.

    Returns:
        `(n, continuation)`: `n = 0` and an empty `(0,)` when no suffix of `min_ngram..max_ngram` tokens occurred
        before (or the context is too short); otherwise the matched suffix's length and the `(m,)` tokens after
        its earliest earlier occurrence, `0 <= m <= max_tokens`, cut at the end of the context.
    """
    length = context.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows starting at 0 .. length - n - 1: every occurrence that ends before the suffix itself does
        earlier = context.unfold(0, n, 1)[: length - n]
        hits = (earlier == context[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[0, 0]) + n
            return n, context[start : start + max_tokens]
    return 0, context[:0]


def _check_ngram(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class PromptLookupProposer(BlockProposer):
    """Drafts by n-gram lookup in the sequence so far (`lookup_match`); stateless, no forward passes.

    The engine caps each block at the round's remaining draft length (its `max_draft_length`, the policy's stop);
    a round whose context offers no match drafts nothing, and the target emits one token as without speculation.
    One lookup per round, as vLLM does.

    Args:
        vocab_size: the tokenizer's real vocabulary.
        device: where the engine's sequence lives.
        min_ngram / max_ngram: shortest and longest suffix looked up (vLLM's `prompt_lookup_min` / `_max`).
    """

    def __init__(self, vocab_size: int, device: torch.device, min_ngram: int = 1, max_ngram: int = 3) -> None:
        check_vocab_size(vocab_size)
        self.vocab_size = vocab_size
        self.min_ngram = _check_ngram("min_ngram", min_ngram)
        self.max_ngram = _check_ngram("max_ngram", max_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self._device = torch.device(device)
        self.forwards = 0

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def length(self) -> int:
        return 0  # no state: nothing to roll back

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self.forwards = 0

    def propose_block(self, tokens: torch.Tensor, request: BlockRequest) -> DraftBlock:
        return self.matched_block(tokens, request)[1]

    def matched_block(self, tokens: torch.Tensor, request: BlockRequest) -> tuple[int, DraftBlock]:
        """`propose_block`'s block, with the length of the suffix it matched (`lookup_match`; 0: none, empty)."""
        if request.with_hidden:
            raise ValueError(
                "prompt lookup has no hidden states for a policy to read: use a policy without "
                "needs_hidden_states (fixed, heuristic, confidence, entropy, oracle) with it"
            )
        length, found = lookup_match(tokens[0], self.min_ngram, self.max_ngram, request.max_length)
        return length, DraftBlock(found.clone())

    def rollback(self, length: int) -> None:
        pass
