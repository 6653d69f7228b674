"""Our EAGLE-3 head in vLLM's `speculators` format (`specdistill.drafts.eagle3.export`).

Without speculators: the export's keys, shapes and config fields are the ones speculators 0.9.0 reads (checked by hand
against its code, cited at each constant). With it (its own environment, `bash tests/speculators_env.sh`, since it
pins an older transformers): `SpeculatorModel.from_pretrained` loads the export beside a tiny verifier, holds our
weights exactly, and its training-time forward computes our head's logits at every step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.drafts.eagle3.export import export_speculators
from specdistill.drafts.eagle3.model import DraftVocabulary, Eagle3Cache, Eagle3Head
from specdistill.drafts.target_heads.export import verifier_of
from tests.helpers import ROOT
from tests.test_eagle3 import AUX, DRAFT_V, V, fused_states, tiny_head, tiny_target
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

# ---------------------------------------------------------------------------------------------- what speculators reads

# speculators 0.9.0, models/eagle3/core.py `Eagle3DraftModel.__init__` (fc, layers, norm), model.py
# `DraftVocabMixin._init_vocab` (lm_head, d2t, t2d; the buffers only when draft_vocab_size != the verifier's
# vocab_size), models/eagle3/model_definitions.py `Eagle3FirstLayerMixin._patch_eagle3_projections` (q/k/v read 2H,
# hidden_norm) on transformers' LlamaDecoderLayer; convert/eagle/eagle3_converter.py
# `Eagle3Converter._save_converted_checkpoint` renames SpecForge's `midlayer.*` to `layers.0.*`, the rest unchanged.
# Shapes as (out, in) functions of (H, heads * head_dim, kv_heads * head_dim, intermediate, draft vocab, vocab).
SPECULATORS_SHAPES = {
    "fc.weight": lambda h, q, kv, i, d, v: (h, 3 * h),
    "layers.0.input_layernorm.weight": lambda h, q, kv, i, d, v: (h,),
    "layers.0.hidden_norm.weight": lambda h, q, kv, i, d, v: (h,),
    "layers.0.post_attention_layernorm.weight": lambda h, q, kv, i, d, v: (h,),
    "layers.0.self_attn.q_proj.weight": lambda h, q, kv, i, d, v: (q, 2 * h),
    "layers.0.self_attn.k_proj.weight": lambda h, q, kv, i, d, v: (kv, 2 * h),
    "layers.0.self_attn.v_proj.weight": lambda h, q, kv, i, d, v: (kv, 2 * h),
    "layers.0.self_attn.o_proj.weight": lambda h, q, kv, i, d, v: (h, q),
    "layers.0.mlp.gate_proj.weight": lambda h, q, kv, i, d, v: (i, h),
    "layers.0.mlp.up_proj.weight": lambda h, q, kv, i, d, v: (i, h),
    "layers.0.mlp.down_proj.weight": lambda h, q, kv, i, d, v: (h, i),
    "norm.weight": lambda h, q, kv, i, d, v: (h,),
    "lm_head.weight": lambda h, q, kv, i, d, v: (d, h),
    "d2t": lambda h, q, kv, i, d, v: (d,),
    "t2d": lambda h, q, kv, i, d, v: (v,),
}
# core.py `Eagle3DraftModel._keys_to_ignore_on_load_missing`: the verifier's, loaded from it by
# model.py `DraftVocabMixin._load_verifier_weights` (embed_tokens is in our export only with_embeddings);
# `input_norm` is off (norm_before_fc)
NOT_EXPORTED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight", "input_norm.weight")
# models/eagle3/config.py `Eagle3SpeculatorConfig` and config.py `SpeculatorModelConfig` fields, plus the
# PretrainedConfig ones speculators' own save_pretrained writes (dtype, tie_word_embeddings)
CONFIG_FIELDS = {
    "architectures", "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "draft_vocab_size", "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad", "tie_word_embeddings", "dtype",
}  # fmt: skip


def our_name(speculators_name: str) -> str:
    """The inverse of the converter's renaming, written out here (not the exporter's function)."""
    return speculators_name.replace("layers.0.", "midlayer.", 1)


def spread(head: Eagle3Head, seed: int = 1) -> Eagle3Head:
    """`head` with O(1) weights (the default std 0.02 makes every logit ~0, which any mapping would match)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            noise = torch.randn(parameter.shape, generator=gen)
            parameter.copy_(1 + 0.3 * noise if parameter.dim() == 1 else 0.3 * noise)
    return head


def variant(head: Eagle3Head, target: torch.nn.Module, **changes) -> Eagle3Head:
    """A head of `head`'s weights and vocabulary with some config fields changed."""
    other = Eagle3Head(dataclasses.replace(head.config, **changes))
    other.load_state_dict(head.state_dict())
    other.attach_embeddings(target.get_input_embeddings())
    return other.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_the_export_holds_the_keys_and_shapes_speculators_loads(target, tmp_path: Path):
    head = spread(tiny_head(target))
    out = export_speculators(head, tmp_path / "spec", verifier=None)
    weights = load_file(str(out / "model.safetensors"))
    c = head.config
    shape = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
             c.intermediate_size, DRAFT_V, V)  # fmt: skip
    assert set(weights) == set(SPECULATORS_SHAPES)
    assert not set(NOT_EXPORTED) & set(weights)
    for name, tensor in weights.items():
        assert tuple(tensor.shape) == SPECULATORS_SHAPES[name](*shape), name
        assert torch.equal(tensor, head.state_dict()[our_name(name)]), name
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool  # core.py's buffers
    # with_embeddings adds the attached target embeddings under DraftVocabMixin's name
    out = export_speculators(head, tmp_path / "embedded", verifier=None, with_embeddings=True)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(SPECULATORS_SHAPES) | {"embed_tokens.weight"}
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    detached = Eagle3Head(head.config)
    with pytest.raises(ValueError, match="attach them"):
        export_speculators(detached, tmp_path / "detached", verifier=None, with_embeddings=True)


def test_a_full_draft_vocabulary_has_no_mapping_buffers(target, tmp_path: Path):
    # model.py `_init_vocab`: draft_vocab_size == vocab_size -> use_draft_vocab False, t2d and d2t are None
    out = export_speculators(tiny_head(target, draft_vocab=V), tmp_path / "spec", verifier=None)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(SPECULATORS_SHAPES) - {"d2t", "t2d"}
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V


def test_the_config_states_every_eagle3_speculator_field(target, tmp_path: Path):
    head = tiny_head(target)
    verifier = "org/some-verifier"
    out = export_speculators(head, tmp_path / "spec", verifier, verifier_architectures=["LlamaForCausalLM"],
                             speculative_tokens=5)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert set(config) == CONFIG_FIELDS
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT_V and config["target_hidden_size"] == target.config.hidden_size
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # the same index convention, unchanged
    assert config["norm_before_residual"] is False  # stated: vLLM's reader defaults it to true
    assert not config["norm_before_fc"] and not config["fc_norm"] and not config["norm_output"]
    assert config["dtype"] == "float32"
    # config.py `SpeculatorsConfig` (its validator: the default method is one of the proposal methods) and
    # `VerifierConfig`; vLLM reads proposal_methods[0].speculative_tokens and verifier.name_or_path
    assert config["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
    }  # fmt: skip
    layer = config["transformer_layer_config"]
    c = head.config
    # config.py `validate_transformer_config` builds AutoConfig.for_model(model_type) from it; core.py reads
    # vocab_size (the verifier's: embed_tokens, t2d), hidden_size, num_hidden_layers, rms_norm_eps, rope parameters
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert (layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]) == (
        c.hidden_size, c.intermediate_size, c.head_dim)  # fmt: skip
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (
        c.num_attention_heads, c.num_key_value_heads)  # fmt: skip
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": c.rope_theta}
    assert layer["rms_norm_eps"] == c.rms_norm_eps and layer["hidden_act"] == c.hidden_act
    assert not layer["attention_bias"] and not layer["mlp_bias"] and not layer["tie_word_embeddings"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == verifier
    none = json.loads((export_speculators(head, tmp_path / "none", None) / "config.json").read_text())
    assert none["speculators_config"]["verifier"] == {"name_or_path": None, "architectures": []}


def test_norm_before_residual_is_exported_as_stated(target, tmp_path: Path):
    # speculators' first layer takes the option (model_definitions.py `Eagle3FirstLayerMixin.forward`)
    head = variant(tiny_head(target), target, norm_before_residual=True)
    config = json.loads((export_speculators(head, tmp_path / "spec", None) / "config.json").read_text())
    assert config["norm_before_residual"] is True


def test_the_tokenizer_is_saved_and_its_special_ids_recorded(tmp_path: Path):
    tokenizer = arith_tokenizer(vocab_size=300, train_size=200)
    target = tiny_target("llama", vocab=len(tokenizer))
    out = export_speculators(tiny_head(target, vocab=len(tokenizer)), tmp_path / "spec", None, tokenizer)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert (layer["bos_token_id"], layer["eos_token_id"], layer["pad_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)  # fmt: skip


def test_the_verifier_is_where_the_target_was_loaded_from(target, tmp_path: Path, monkeypatch):
    from transformers import AutoModelForCausalLM

    target.save_pretrained(tmp_path / "target")
    monkeypatch.chdir(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained("target")  # a relative path: recorded absolute
    assert verifier_of(loaded) == (str((tmp_path / "target").resolve()), ["LlamaForCausalLM"])
    assert verifier_of(tiny_target("llama"))[0] is None  # built from a config: no verifier to name


def test_heads_speculators_cannot_hold_are_refused(target, tmp_path: Path):
    head = tiny_head(target)
    wide = Eagle3Head(dataclasses.replace(head.config, target_hidden_size=2 * head.config.hidden_size))
    with pytest.raises(ValueError, match="fc: 3\\*hidden_size -> hidden_size"):
        export_speculators(wide, tmp_path / "wide", None)
    full = tiny_head(target, draft_vocab=V)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    full.set_vocabulary(DraftVocabulary(ids, ids - torch.arange(V), torch.ones(V, dtype=torch.bool)))
    with pytest.raises(ValueError, match="draft id i to target id i"):
        export_speculators(full, tmp_path / "full", None)
    odd = tiny_head(target)
    odd.t2d[odd.target_ids[0]] = False  # t2d no longer marks every drafted token
    with pytest.raises(ValueError, match="must name the same tokens"):
        export_speculators(odd, tmp_path / "odd", None)
    assert not any((tmp_path / name).exists() for name in ("wide", "full", "odd"))


# ---------------------------------------------------------------------------------------------- speculators itself


def find_speculators_python() -> str | None:
    """$SPECDISTILL_SPECULATORS_PYTHON, else the environment `tests/speculators_env.sh` makes."""
    given = os.environ.get("SPECDISTILL_SPECULATORS_PYTHON")
    if given:
        return given
    local = ROOT / ".venv-speculators" / "bin" / "python"
    return str(local) if local.is_file() else None


SPECULATORS_PYTHON = find_speculators_python()
needs_speculators = pytest.mark.skipif(
    SPECULATORS_PYTHON is None,
    reason="needs vLLM's speculators in its own environment: bash tests/speculators_env.sh (.venv-speculators)",
)

STEPS = 3
# speculators' flex-attention path extends its block mask by whole 128-position blocks per step
# (models/eagle3/attention.py `extend_mask_for_draft_tokens`): it needs a sequence of a multiple of 128 (its trainer
# pads to one), 128 here (the first token has no EAGLE position)
LENGTH = 129

# speculators in its own process: loads each export with its own API, notes whether the verifier's embeddings came
# with it, loads them (its own routine) for an export without them, compares its state dict with the expected
# tensors, runs its training-time forward (both of its attention paths on the CPU) capturing lm_head's logits at each
# step, and saves its own re-serialisation of the first export for the config comparison
WORKER = """
import json, sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
torch.set_num_threads(1)
request = json.loads(sys.argv[1])
inputs = load_file(request["inputs"])
report = {}
for case in request["cases"]:
    expected = load_file(case["expected"])
    for attention in ("simple_flex_attention", "eager"):
        if attention == "eager":
            config = Eagle3SpeculatorConfig.from_pretrained(case["export"])
            config.transformer_layer_config._attn_implementation = "eager"
            model = Eagle3DraftModel.from_pretrained(case["export"], config=config)
        else:
            model = SpeculatorModel.from_pretrained(case["export"])
        model.eval()
        embedded = torch.equal(model.embed_tokens.weight, expected["embed_tokens.weight"])
        if not case["with_embeddings"]:
            # model.py: from_pretrained loads the verifier's embeddings only over NaN, and transformers 5 leaves a
            # weight missing from the checkpoint uninitialised (garbage, NaN or not): its own routine, overwriting
            model._load_verifier_weights(overwrite_embed_tokens=True)
        state = model.state_dict()
        logits = []
        hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach()))
        with torch.no_grad():
            drafts = model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                           document_ids=torch.zeros_like(inputs["input_ids"]), ttt_steps=request["steps"])
        hook.remove()
        torch.save(logits, case["logits"] + "." + attention)
        report[case["name"] + "/" + attention] = {
            "type": type(model).__name__, "attention": model._attn_impl, "embedded": embedded,
            "missing": sorted(set(expected) - set(state)),
            "unchecked": sorted(set(state) - set(expected)),
            "different": sorted(k for k in expected if k in state and not torch.equal(state[k], expected[k])),
            "aux_layer_ids": model.target_layer_ids,
            "norm_before_residual": model.layers[0].norm_before_residual,
            "draft_tokens": len(drafts),
        }
    if case.get("resave"):
        model.save_pretrained(case["resave"])
print("RESULT " + json.dumps(report))
"""


def run_speculators(request: dict, cwd: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([SPECULATORS_PYTHON, "-c", WORKER, json.dumps(request)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow
@needs_speculators
def test_speculators_loads_our_export_with_our_weights_and_computes_our_logits(tmp_path: Path):
    # O(1) weights on both sides, so that logits differ wherever a weight or an option is read wrongly
    target = tiny_target("llama", initializer_range=0.3)
    target.save_pretrained(tmp_path / "verifier")  # what the export names as its verifier
    verifier = str(tmp_path / "verifier")
    base = spread(tiny_head(target))
    heads = {
        "draft_vocabulary": base,
        "norm_before_residual": variant(base, target, norm_before_residual=True),
        "full_vocabulary": spread(tiny_head(target, draft_vocab=V), seed=2),
        "with_embeddings": base,
    }
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (1, LENGTH), generator=gen)
    features = fused_states(target, ids)
    # speculators' layout: its step 0 reads input_ids[p] beside hidden_states[p] (our token p + 1), step j the ids
    # shifted j further; positions past the end read token 0 there and a zero embedding here, so rows p < L - 1 - j
    # (the real ones) are compared
    save_file({"hidden_states": features[:, : LENGTH - 1].contiguous(), "input_ids": ids[:, 1:].contiguous()},
              str(tmp_path / "inputs.safetensors"))  # fmt: skip
    cases = []
    for name, head in heads.items():
        embeddings = name == "with_embeddings"
        export = export_speculators(head, tmp_path / name, verifier, verifier_architectures=["LlamaForCausalLM"],
                                    with_embeddings=embeddings)  # fmt: skip
        # our weights under the converter's names (convert/eagle/eagle3_converter.py), written out here
        expected = {
            k.replace("midlayer.", "layers.0.", 1): v.contiguous() for k, v in head.state_dict().items()
        }
        if head.config.draft_vocab_size == head.config.vocab_size:
            expected = {k: v for k, v in expected.items() if k not in ("d2t", "t2d")}
        rows = head.t2d if head.config.draft_vocab_size < head.config.vocab_size else slice(None)
        # model.py `_load_verifier_weights`: embeddings, final norm and (draft rows of the) lm_head of the verifier
        expected["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
        expected["verifier_norm.weight"] = target.model.norm.weight.detach()
        expected["verifier_lm_head.weight"] = target.lm_head.weight.detach()[rows].contiguous()
        save_file(expected, str(tmp_path / f"{name}.expected.safetensors"))
        cases.append({"name": name, "export": str(export), "expected": str(tmp_path / f"{name}.expected.safetensors"),
                      "logits": str(tmp_path / f"{name}.logits"), "with_embeddings": embeddings})  # fmt: skip
    cases[0]["resave"] = str(tmp_path / "resaved")
    report = run_speculators({"cases": cases, "inputs": str(tmp_path / "inputs.safetensors"), "steps": STEPS},
                             tmp_path)  # fmt: skip

    ours_by_case = {}
    for case in cases:
        head = heads[case["name"]]
        with torch.no_grad():
            ours = [step.logits for step in head.unroll(features, ids, torch.ones_like(ids), STEPS)]
            # the decoding pass (forward with a cache) gives step 0 too
            decoded = head(head.embed(ids[:, 1:]), head.fuse(features[:, :-1]), torch.arange(LENGTH - 1),
                           Eagle3Cache()).logits  # fmt: skip
        torch.testing.assert_close(decoded, ours[0][:, :-1], atol=1e-5, rtol=0)
        ours_by_case[case["name"]] = ours
        assert ours[0].std() > 0.5  # logits of size: a wrong weight shows
        for attention in ("simple_flex_attention", "eager"):
            loaded = report[f"{case['name']}/{attention}"]
            assert loaded["type"] == "Eagle3DraftModel" and loaded["attention"] == attention
            if case["with_embeddings"]:
                assert loaded["embedded"]  # from_pretrained alone: every weight, the embeddings included
            assert loaded["missing"] == [] and loaded["unchecked"] == [] and loaded["different"] == [], loaded
            assert loaded["aux_layer_ids"] == list(AUX)
            assert loaded["norm_before_residual"] == head.config.norm_before_residual
            theirs = torch.load(f"{case['logits']}.{attention}")
            assert loaded["draft_tokens"] == len(theirs) == STEPS
            for step in range(STEPS):
                real = LENGTH - 1 - step
                where = f"{case['name']}, step {step}, {attention}"
                torch.testing.assert_close(theirs[step][:, :real], ours[step][:, :real], atol=1e-4, rtol=0,
                                           msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip
    # the option is read, not merely ignored by equal outputs: the same weights without it draft other logits
    assert (ours_by_case["norm_before_residual"][0] - ours_by_case["draft_vocabulary"][0]).abs().max() > 1e-2

    # speculators' own save of what it loaded states the same fields with the same values as our config
    ours_config = json.loads((tmp_path / "draft_vocabulary" / "config.json").read_text())
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    for key, value in resaved.items():
        if key in ("architectures", "auto_map", "transformers_version", "speculators_version"):
            continue  # save_pretrained writes its class name, its code reference and the versions it ran
        if key == "transformer_layer_config":
            for field, setting in value.items():
                if field != "transformers_version":
                    assert ours_config[key].get(field) == setting, (
                        field,
                        ours_config[key].get(field),
                        setting,
                    )
        else:
            assert ours_config.get(key) == value, (key, ours_config.get(key), value)
    assert set(load_file(str(tmp_path / "resaved" / "model.safetensors"))) == set(SPECULATORS_SHAPES) | {
        "embed_tokens.weight"}  # fmt: skip
