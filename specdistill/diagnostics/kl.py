"""Per-position forward KL between the target and the draft, for token-level analyses.

A thin, checked wrapper over `specdistill.losses.divergence.forward_kl` (the training loss's own code), with the
diagnostics' argument order `(draft_logits, target_logits)`.
"""

from __future__ import annotations

import torch

from specdistill.diagnostics.checks import check_logit_pair
from specdistill.losses.divergence import forward_kl


def per_token_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) per position, p = softmax(target), q = softmax(draft), via fp32 log_softmax.

    Args:
        draft_logits: `(N, V)` the draft's logits (any float dtype).
        target_logits: `(N, V)` the target's logits at the same positions, same vocabulary.

    Returns:
        `(N,)` fp32, >= 0 (up to rounding); 0 where the two distributions are equal.
    """
    check_logit_pair(draft_logits, target_logits)
    return forward_kl(target_logits, draft_logits)
