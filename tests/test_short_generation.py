"""One or two new tokens: the draft never runs (a round may draft at most `remaining - 1`), so its cache is still
empty when the engine crops it; a sliding-window layer (Gemma-2, Mistral, Qwen2's window) must take that crop."""

from __future__ import annotations

import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.models.cache import cache_length, crop_cache, new_cache
from tests.architectures import SLIDING
from tests.test_architectures import GREEDY, PROMPT, STATIC, tiny_pair
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

CACHES = ["dynamic", STATIC]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("arch", [*SLIDING, "llama"])
def test_one_or_two_new_tokens_equal_generate(arch, cache):
    target, draft = tiny_pair(arch, 32)
    for n in (1, 2):
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[
            0, len(PROMPT) :
        ]
        baseline = autoregressive(target, PROMPT, n, GREEDY, None, 32, cache_implementation=cache)
        decoder = SpeculativeDecoder(
            target, draft, FixedLength(3), GREEDY, None, 32, cache_implementation=cache
        )
        assert baseline.tokens == decoder.generate(PROMPT, n).tokens == reference.tolist(), (arch, n)


@pytest.mark.parametrize("cache_implementation", CACHES)
def test_an_empty_cache_crops_to_nothing(cache_implementation):
    target, _ = tiny_pair("gemma2", 32)
    cache = new_cache(target, cache_implementation, 16)
    crop_cache(cache, 0)
    assert cache_length(cache) == 0
    with pytest.raises(ValueError, match="cannot crop a cache of 0 positions to 1"):
        crop_cache(cache, 1)
