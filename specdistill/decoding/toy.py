"""Tiny random target/draft pairs for tests and benchmarks (no downloads).

Random models agree on almost nothing, so a draft built as a noisy copy of its target (`perturbed_copy`) gives an
acceptance rate strictly between 0 and 1 that the noise scale controls.
"""

from __future__ import annotations

import copy

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM


def tiny_gpt_neox(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    initializer_range: float = 0.02,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> GPTNeoXForCausalLM:
    """A randomly initialised GPT-NeoX causal LM in eval mode.

    `initializer_range` sets how peaked its next-token distributions are (0.02 is almost uniform on small models;
    ~0.3 gives confident, varied predictions).
    """
    config = GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPTNeoXForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of relative scale `noise` added to every weight matrix.

    Each tensor gets noise of standard deviation `noise * tensor.std()`, so `noise=0` is an exact copy.
    """
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for param in out.parameters():
        if param.dim() >= 2:
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * noise * param.std())
    return out.eval().requires_grad_(False)


def toy_pair(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    initializer_range: float = 0.3,
    noise: float = 0.6,
    seed: int = 0,
) -> tuple[GPTNeoXForCausalLM, torch.nn.Module]:
    """`(target, draft)`: a peaked random target (`tiny_gpt_neox`) and its `perturbed_copy` as the draft.

    The defaults give confident targets and a draft that agrees with them often but not always. The draft's noise
    is seeded with `seed + 1`, so one seed fixes the whole pair.
    """
    target = tiny_gpt_neox(
        vocab_size, hidden_size, num_layers, num_heads, initializer_range=initializer_range, seed=seed
    )
    return target, perturbed_copy(target, noise, seed=seed + 1)
