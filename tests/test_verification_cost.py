"""The target's verification cost (`specdistill.decoding.cost`): each timed pass verifies exactly `n` new tokens after
the same cached context, the curve is relative to one token, and tokens per unit of cost divide tokens per call at K
by the cost of K + 1 tokens."""

from __future__ import annotations

import pytest
import torch

from specdistill.decoding.cost import measure_verification_cost, relative_cost, tokens_per_cost
from specdistill.evaluation.offline import format_cost
from tests.test_architectures import tiny_pair
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 32


def test_every_pass_verifies_n_tokens_after_the_same_context():
    target, _ = tiny_pair("llama", V)
    seen: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        seen.append((kwargs["input_ids"].shape[1], 0 if cache is None else int(cache.get_seq_length())))

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        seconds = measure_verification_cost(target, [1, 3, 5], context_length=7, repeats=2)
    finally:
        handle.remove()
    assert sorted(seconds) == [1, 3, 5] and all(s > 0 for s in seconds.values())
    # the prefill, then (1 untimed + 2 timed) x (1, 3, 5), each after the 7 cached tokens: the cache is cropped back
    assert seen == [(7, 0)] + [(n, 7) for _ in range(3) for n in (1, 3, 5)]


def test_bad_lengths_are_refused():
    target, _ = tiny_pair("llama", V)
    for lengths in ([], [0, 1], [1.5]):
        with pytest.raises(ValueError, match="lengths"):
            measure_verification_cost(target, lengths)
    with pytest.raises(ValueError, match="context_length"):
        measure_verification_cost(target, [1], context_length=0)


def test_the_curve_is_relative_to_one_token_and_tokens_per_cost_divide_by_k_plus_one():
    assert relative_cost({1: 0.02, 2: 0.025, 4: 0.04}) == pytest.approx({1: 1.0, 2: 1.25, 4: 2.0})
    with pytest.raises(ValueError, match="lack 1"):
        relative_cost({2: 0.1})
    cost = {1: 1.0, 2: 1.1, 3: 1.5, 4: 1.2}
    # K = 3 verifies 4 tokens: 2.4 / 1.2; K = 4 has no measured cost of 5 tokens; K = 1's figure is missing
    assert tokens_per_cost({1: None, 2: 1.65, 3: 2.4, 4: 2.6}, cost) == pytest.approx({2: 1.1, 3: 2.0})
    lines = format_cost(cost, {"prompt_lookup": {1: None, 2: 1.65, 3: 2.4}, "none": {1: None}}).splitlines()
    assert lines[0].startswith("target verification cost") and "n=3 1.50" in lines[0]
    assert lines[1:] == [f"  {'prompt_lookup':<28} tokens per unit of target cost, best K=3: 2.000"]


def test_a_bfloat16_target_is_timed_in_bfloat16():
    target, _ = tiny_pair("llama", V)
    target = target.to(torch.bfloat16)
    seen = []
    handle = target.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    try:
        measure_verification_cost(target, [1, 2], context_length=4, repeats=1)
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}
