"""Divergences between target and draft distributions, and token reductions."""

from specdistill.losses.divergence import (
    JSD,
    TVD,
    Divergence,
    ForwardKL,
    ReverseKL,
    chunked_divergence,
    expected_acceptance,
    forward_kl,
    jsd,
    reverse_kl,
    tvd,
)
from specdistill.losses.reduction import reduce_tokens

__all__ = [
    "JSD",
    "TVD",
    "Divergence",
    "ForwardKL",
    "ReverseKL",
    "chunked_divergence",
    "expected_acceptance",
    "forward_kl",
    "jsd",
    "reduce_tokens",
    "reverse_kl",
    "tvd",
]
