"""Every preset architecture in the engine: GPT-NeoX, CodeGen, Phi, Llama, Qwen2 (with and without its sliding
window), Mistral and Gemma-2, tiny, random, untied, with a draft the target rejects (a perturbed copy).

Prompt plus output are at least three sliding windows long, so caches are rolled back after the window has slid.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength, Oracle
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.toy import perturbed_copy
from specdistill.models.cache import crop_cache, forward_with_cache, new_cache
from specdistill.rollout.generate import sample_responses
from tests.architectures import ARCHITECTURES, SLIDING, WINDOW
from tests.lossless import exact_two_token_distribution, matches_two_token_distribution, two_token_counts
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

GREEDY = SamplingConfig(greedy=True)
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
PROMPT = [3, 1, 4, 1, 5, 9]
NEW_TOKENS = 3 * WINDOW


def tiny_pair(arch: str, vocab_size: int, noise: float = 0.15, initializer_range: float = 0.3):
    """`(target, draft)`: a peaked random `arch` model without an EOS and a perturbed copy of it as the draft."""
    kwargs = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(
        kwargs.pop("model_type"),
        vocab_size=vocab_size,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    assert not config.tie_word_embeddings
    return target, perturbed_copy(target, noise)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


def test_sliding_architectures_get_sliding_cache_layers(arch):
    target, _ = tiny_pair(arch, 32)
    cache = new_cache(target)
    assert any(cache.is_sliding) == (arch in SLIDING)
    if StaticLayer.is_croppable:
        assert not any(new_cache(target, "static", 64).is_sliding)  # static: full-length layers everywhere


STATIC = pytest.param(
    "static",
    marks=pytest.mark.skipif(
        not StaticLayer.is_croppable, reason="static caches roll back from transformers 5.24"
    ),
)


@pytest.mark.parametrize("cache_implementation", ["dynamic", STATIC])
def test_greedy_output_equals_generate(arch, cache_implementation):
    target, draft = tiny_pair(arch, 32)
    reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = reference[0, len(PROMPT) :].tolist()
    assert len(reference) == NEW_TOKENS
    baseline = autoregressive(
        target, PROMPT, NEW_TOKENS, GREEDY, None, 32, cache_implementation=cache_implementation
    )
    assert baseline.tokens == reference
    accepted = rejected = 0
    for policy in (FixedLength(3), Oracle()):
        decoder = SpeculativeDecoder(
            target,
            draft,
            policy,
            GREEDY,
            None,
            32,
            max_draft_length=4,
            cache_implementation=cache_implementation,
        )
        result = decoder.generate(PROMPT, NEW_TOKENS)
        assert result.tokens == reference, f"{arch} ({type(policy).__name__}) diverged from generate()"
        accepted += result.stats.accepted_tokens
        rejected += result.stats.rejected_tokens
    assert accepted > 0 and rejected > 0  # rollbacks were exercised, and not only of the first candidate


def test_rollout_generation_equals_generate_as_rows_leave_the_batch(arch):
    """Rollouts' batched loop: left-padded prompts of several lengths, rows dropped from the cache as they end."""
    target, _ = tiny_pair(arch, 32)
    prompts = [PROMPT, PROMPT[:2], [7, 2, 7, 2, 9, 9, 1, 8, 2, 8, 1], [5]]
    reference = [
        target.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    seeds = list(range(len(prompts)))
    assert sample_responses(target, prompts, GREEDY, NEW_TOKENS, [], 0, 32, seeds)[0] == reference  # no EOS
    eos = reference[0][WINDOW + 1]  # ends some rows after the window has slid, others earlier or never
    ended = [r[: r.index(eos) + 1] if eos in r else r for r in reference]
    assert len({len(r) for r in ended}) > 1
    assert sample_responses(target, prompts, GREEDY, NEW_TOKENS, eos, 0, 32, seeds)[0] == ended


def _assert_cache_continues_like_a_fresh_forward(model, tokens: torch.Tensor, cache, length: int) -> None:
    with torch.inference_mode():
        cached, _ = forward_with_cache(model, tokens[:, length:], cache)
        fresh = model(input_ids=tokens).logits[0, -1]
    torch.testing.assert_close(cached.logits[0, -1], fresh, rtol=1e-4, atol=1e-4)


def test_sampling_matches_target_distribution_after_the_window(arch):
    """The first two tokens after a prompt longer than two windows follow the target's exact distribution, and
    after a long sampled output both caches still continue exactly like a fresh forward."""
    vocab = 8
    target, draft = tiny_pair(arch, vocab, noise=0.3, initializer_range=0.2)  # p, q overlap 0.4-0.8
    prompt = [(7 * i + 3) % vocab for i in range(3 * WINDOW - 2)]
    decoder = SpeculativeDecoder(target, draft, FixedLength(1), SAMPLING, None, vocab, max_draft_length=1)
    counts = two_token_counts(decoder, prompt, vocab, samples=400)
    assert matches_two_token_distribution(
        counts, exact_two_token_distribution(target, prompt, SAMPLING, vocab)
    )

    decoder = SpeculativeDecoder(target, draft, FixedLength(3), SAMPLING, None, vocab, max_draft_length=4)
    result = decoder.generate(PROMPT[:2], NEW_TOKENS, torch.Generator().manual_seed(0), keep_state=True)
    assert result.stats.rejected_tokens > 0
    state = result.state
    _assert_cache_continues_like_a_fresh_forward(
        target, state.tokens, state.target_cache, state.target_length
    )
    _assert_cache_continues_like_a_fresh_forward(draft, state.tokens, state.draft_cache, state.draft_length)


# ---------------------------------------------------------------------------------------------- crop_cache errors


def test_crop_cache_refuses_what_it_cannot_roll_back():
    target, _ = tiny_pair("mistral", 32)
    ids = torch.tensor([list(range(2 * WINDOW))])
    with torch.inference_mode():
        _, own = forward_with_cache(target, ids, DynamicCache(config=target.config))  # no past recording
    with pytest.raises(ValueError, match="sliding-window layer"):
        crop_cache(own, 2 * WINDOW - 1)
    with pytest.raises(ValueError, match="cannot crop a cache of 16 positions to 17"):
        crop_cache(own, 2 * WINDOW + 1)
    ring = StaticCache(config=target.config, max_cache_len=4 * WINDOW)  # sliding layers as ring buffers
    with pytest.raises(ValueError, match="cannot be rolled back"):
        crop_cache(ring, 0)
    with pytest.raises(ValueError, match="cache implementation must be one of"):
        new_cache(target, "hybrid")
    with pytest.raises(ValueError, match="max_length"):
        new_cache(target, "static")
