"""A small causal LM as the proposer: the classic speculative-decoding draft (same tokenizer as the target)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from specdistill.decoding.forward import forward_keep_last, model_device
from specdistill.decoding.proposers.base import DraftProposal, Proposer, check_vocab_size
from specdistill.models.acceptance_head import draft_logits
from specdistill.models.cache import crop_cache, forward_with_cache, new_cache
from specdistill.models.vocab import check_model_covers_vocab


class DraftLMProposer(Proposer):
    """Drafts with a causal LM on its own rollable KV cache: one forward per `propose` over the unseen tokens.

    With `with_hidden` the draft runs as its base model followed by its LM head (`draft_logits`): asking transformers
    for `output_hidden_states` costs more than the head that reads them on small drafts. The first such call checks,
    once per proposer, that the last hidden state is the final-norm state the LM head reads (it runs the model's own
    forward for that call).

    Args:
        model: a Hugging Face causal LM (`PreTrainedModel`) in eval mode.
        vocab_size: the tokenizer's real vocabulary; logits beyond it (padding rows) are dropped.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        check_model_covers_vocab("draft", model, vocab_size)
        self.model = model
        self.vocab_size = vocab_size
        self.forwards = 0
        self._cache: Cache | None = None
        self._length = 0
        self._cropped = 0
        self._hidden_checked = False

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def length(self) -> int:
        return self._length

    @property
    def cache(self) -> Cache | None:
        return self._cache

    def start(self, prompt: torch.Tensor, capacity: int, cache_implementation: str) -> None:
        self._cache = new_cache(self.model, cache_implementation, capacity)
        self._length = 0
        self._cropped = 0
        self.forwards = 0

    def propose(self, tokens: torch.Tensor, with_hidden: bool) -> DraftProposal:
        ids = tokens[:, self._length :]
        if not with_hidden:
            out, self._cache = forward_keep_last(self.model, ids, self._cache, 1)
            proposal = DraftProposal(out.logits[0, -1, : self.vocab_size])
        elif not self._hidden_checked:
            out, self._cache = forward_keep_last(self.model, ids, self._cache, 1, hidden=True)
            self._check_hidden_is_final(out.hidden_states[-1][0, -1:], out.logits[0, -1:])
            proposal = DraftProposal(out.logits[0, -1, : self.vocab_size], out.hidden_states[-1][0, -1])
        else:
            out, self._cache = forward_with_cache(self.model.base_model, ids, self._cache)
            hidden = out.last_hidden_state[0, -1]
            proposal = DraftProposal(draft_logits(self.model, hidden)[: self.vocab_size], hidden)
        self._length = tokens.shape[1]
        self.forwards += 1
        return proposal

    def rollback(self, length: int) -> None:
        if not self._cropped <= length <= self._length:
            raise ValueError(
                f"rollback({length}) outside [{self._cropped}, {self._length}]: a proposer rolls back to at most "
                "what it covers and never below its previous rollback (the engine's contract, see "
                "specdistill/decoding/proposers/base.py)."
            )
        self._length = self._cropped = length
        crop_cache(self._cache, length)

    def _check_hidden_is_final(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """hidden_states[-1] must be the state the LM head reads (after the final norm), or policies get garbage."""
        recomputed = draft_logits(self.model, hidden)
        if not torch.allclose(recomputed.float(), logits.float(), rtol=1e-3, atol=1e-3):
            raise ValueError(
                f"{type(self.model).__name__}: output_hidden_states[-1] is not the final-norm state the LM head "
                "reads, so hidden-state policies would score the wrong features. Use a draft architecture whose "
                "last hidden state is post-norm (GPT-NeoX, Llama, Qwen2, Gemma2 in transformers >= 5)."
            )
        self._hidden_checked = True
