"""SpecDec++ soft acceptance labels: a_i = min(1, p(Y_i | ctx) / q(Y_i | ctx)) under the decoding warping.

Both distributions are warped with the *same* `SamplingConfig` that decoding uses (temperature, top-k, top-p), so the
label is the probability that speculative sampling accepts `Y_i`. The public SpecDec++ code labels at temperature 1
while decoding with the target's warped config; `labelling_config(..., label_temperature_one=True)` reproduces it.
"""

from __future__ import annotations

import torch

from specdistill.decoding.sampling import SamplingConfig


def labelling_config(sampling: SamplingConfig, label_temperature_one: bool = False) -> SamplingConfig:
    """The warping used to sample draft tokens and compute labels.

    Args:
        sampling: the decoding warping (also used to generate the target responses).
        label_temperature_one: label with the raw distributions (temperature 1, no top-k/top-p) as the public
            SpecDec++ code does, instead of the decoding warping.
    """
    return SamplingConfig() if label_temperature_one else sampling


def sample_draft_tokens(
    draft_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Sample `Y ~ warped q` at every row.

    Args:
        draft_logits: `(N, V)` draft logits on the real vocabulary.
        sampling: warping (greedy gives the argmax).
        generator: torch generator on the logits' device, for reproducible draws.

    Returns:
        `(N,)` long token ids.
    """
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be (N, V), got shape {tuple(draft_logits.shape)}.")
    if draft_logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=draft_logits.device)
    if sampling.is_greedy:
        return draft_logits.argmax(dim=-1)
    return torch.multinomial(sampling.warp_probs(draft_logits), 1, generator=generator).squeeze(-1)


def soft_labels(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    sampling: SamplingConfig,
) -> torch.Tensor:
    """Probability that speculative sampling accepts each draft token: `min(1, p(Y)/q(Y))` on warped p and q.

    Args:
        target_logits: `(N, V)` target logits at the positions, on the real vocabulary.
        draft_logits: `(N, V)` draft logits at the same positions.
        draft_tokens: `(N,)` the draft tokens `Y`, sampled from the warped draft distribution.
        sampling: the warping applied to both distributions.

    Returns:
        `(N,)` float32 labels in [0, 1].

    Raises:
        ValueError: on mismatched shapes, or if some `Y` has zero warped draft probability (it cannot have been
            sampled from q with this warping: the tokens and the warping disagree).
    """
    if target_logits.shape != draft_logits.shape or target_logits.dim() != 2:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} and draft_logits {tuple(draft_logits.shape)} must both be "
            "(N, V) on the same real vocabulary (slice padded rows with logits[..., :vocab_size])."
        )
    if draft_tokens.shape != target_logits.shape[:1]:
        raise ValueError(
            f"draft_tokens must be (N,) = {tuple(target_logits.shape[:1])}, got {tuple(draft_tokens.shape)}."
        )
    index = draft_tokens.long().unsqueeze(-1)
    p = sampling.warp_probs(target_logits).gather(-1, index).squeeze(-1)
    q = sampling.warp_probs(draft_logits).gather(-1, index).squeeze(-1)
    if bool((q <= 0).any()):
        raise ValueError(
            "some draft token has zero probability under the warped draft distribution: draft tokens must be "
            "sampled with the same SamplingConfig that labels them."
        )
    return (p / q).clamp_max(1.0)
