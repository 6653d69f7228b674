"""One or two new tokens: the draft never runs (a round may draft at most `remaining - 1`), so its cache is still
empty when the engine crops it; a sliding-window layer (Gemma-2, Mistral, Qwen2's window) must take that crop."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import StaticLayer

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.models.cache import cache_length, crop_cache, new_cache
from tests.architectures import SLIDING
from tests.test_architectures import GREEDY, PROMPT, tiny_pair
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

CACHES = [
    "dynamic",
    pytest.param(
        "static",
        marks=pytest.mark.skipif(
            not StaticLayer.is_croppable, reason="static caches roll back from transformers 5.24"
        ),
    ),
]


@pytest.mark.parametrize("cache_implementation", CACHES)
@pytest.mark.parametrize("arch", [*SLIDING, "llama"])
def test_one_or_two_new_tokens_equal_generate(arch, cache_implementation):
    target, draft = tiny_pair(arch, 32)
    for max_new_tokens in (1, 2):
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=max_new_tokens, do_sample=False)
        reference = reference[0, len(PROMPT) :].tolist()
        baseline = autoregressive(
            target, PROMPT, max_new_tokens, GREEDY, None, 32, cache_implementation=cache_implementation
        )
        decoder = SpeculativeDecoder(
            target,
            draft,
            FixedLength(3),
            GREEDY,
            None,
            32,
            max_draft_length=4,
            cache_implementation=cache_implementation,
        )
        result = decoder.generate(PROMPT, max_new_tokens)
        assert baseline.tokens == result.tokens == reference, (arch, max_new_tokens)


@pytest.mark.parametrize("cache_implementation", CACHES)
def test_an_empty_cache_crops_to_nothing(cache_implementation):
    target, _ = tiny_pair("gemma2", 32)
    cache = new_cache(target, cache_implementation, 16)
    crop_cache(cache, 0)
    assert cache_length(cache) == 0
    with pytest.raises(ValueError, match="cannot crop a cache of 0 positions to 1"):
        crop_cache(cache, 1)
