"""EAGLE-3 heads trained elsewhere (no `draft_kind.json`, no `specdistill_eagle3`) load as EAGLE-3 drafts, and
EAGLE-3 mistakes are one line: `Eagle3.from_layout` and `Eagle3.load` (`specdistill.drafts.eagle3`).

A head in the layout vLLM and SGLang read, as SpecForge saves it (`LlamaForCausalLMEagle3`, `midlayer.*` or vLLM's
`layers.0.*` names, the target's embeddings maybe saved beside it, aux layer ids maybe absent), and a head in vLLM's
`speculators` layout (our export's `speculators/`), load with the original head's weights and draft its logits; a
plain causal LM folder is no EAGLE-3 head; a head that cannot be read, or a target it does not fit, is one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.drafts import KIND_FILE, load_draft
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.errors import ConfigError, InputFileError
from specdistill.models.loading import ModelSpec
from tests.test_eagle3 import tiny_target
from tests.test_eagle3_kind import _Data
from tests.test_eagle3_speculators import spread
from tests.test_engine import GREEDY
from tests.test_export_records import Marker
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

LAYERS = 8
AUX = (2, 4, 5)  # vLLM's default for a target of 8 layers, (2, L // 2, L - 3): a head may leave them out
DRAFT_V = 200
STEPS = 3


@pytest.fixture(scope="module")
def tokenizer():
    return arith_tokenizer(vocab_size=300, train_size=200)


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_target("llama", vocab=len(tokenizer), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def head(tokenizer, target):
    """A trained-looking head (O(1) weights, a draft vocabulary of the most frequent answer tokens)."""
    vocab = len(tokenizer)
    kind = Eagle3(draft_vocab_size=DRAFT_V, aux_layer_ids=list(AUX), ttt_steps=STEPS)
    head = kind.build(target, vocab_size=vocab)
    labels = [[-100, *torch.randint(0, vocab, (60,), generator=torch.Generator().manual_seed(2)).tolist()]]
    kind.prepare(head, _Data(labels))
    assert head.d2t.any()  # draft ids are not target ids: the mapping is exercised
    return spread(head).eval()


@pytest.fixture(scope="module")
def export(tmp_path_factory, tokenizer, head):
    """Our own export of `head` (its `speculators/` is the speculators layout)."""
    kind = Eagle3(draft_vocab_size=DRAFT_V, aux_layer_ids=list(AUX), ttt_steps=STEPS)
    return kind.export(head, tokenizer, tmp_path_factory.mktemp("ours") / "export")


def specforge_config(config: Eagle3Config, tokenizer, aux: bool = True) -> dict:
    """The config.json SpecForge saves with a head (a Llama config with EAGLE-3 fields, no target_hidden_size when the
    head is the target's width), written out here rather than by our exporter."""
    record = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "head_dim": config.head_dim, "hidden_act": "silu",
        "hidden_size": config.hidden_size, "initializer_range": 0.02, "intermediate_size": config.intermediate_size,
        "max_position_embeddings": 2048, "mlp_bias": False, "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": 1, "num_key_value_heads": config.num_key_value_heads, "pretraining_tp": 1,
        "rms_norm_eps": config.rms_norm_eps, "rope_scaling": None, "rope_theta": config.rope_theta,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.51.0", "use_cache": True,
        "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
    }  # fmt: skip
    if aux:
        record["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids)}
    return record


def write_foreign(
    out: Path,
    head: Eagle3Head,
    target,
    tokenizer,
    *,
    vllm_names: bool = False,
    with_t2d: bool = True,
    with_embeddings: bool = False,
    aux: bool = True,
    pickled: bool = False,
) -> Path:
    """`head` as SpecForge saves it (no record of ours): `midlayer.*` names, or vLLM's `layers.0.*` ones; `pickled`:
    in `pytorch_model.bin`, as SafeAILab/EAGLE's own releases are."""
    out.mkdir(parents=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name == "t2d" and not with_t2d:
            continue
        if vllm_names:
            name = name.replace("midlayer.", "layers.0.", 1)
        state[name] = tensor.detach().clone().contiguous()
    if with_embeddings:
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    if pickled:
        torch.save(state, out / "pytorch_model.bin")
    else:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(specforge_config(head.config, tokenizer, aux), indent=2))
    tokenizer.save_pretrained(out)
    return out


def logits_of(head: Eagle3Head, target, seed: int = 0) -> list[torch.Tensor]:
    """The head's unrolled logits (`STEPS` steps) over a random sequence, on `target`'s states at its layers."""
    ids = torch.randint(0, head.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in head.config.aux_layer_ids], dim=-1)
        return [out.logits for out in head.unroll(features, ids, torch.ones_like(ids), STEPS)]


def assert_same_head(loaded: Eagle3Head, head: Eagle3Head, target) -> None:
    assert isinstance(loaded, Eagle3Head) and not loaded.training
    assert loaded.config.aux_layer_ids == AUX
    # every field but max_position_embeddings (no layout need state it; the head computes RoPE at any position)
    fields = {**head.config.to_dict(), "max_position_embeddings": loaded.config.max_position_embeddings}
    assert loaded.config.to_dict() == fields
    saved, back = head.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    ours, theirs = logits_of(head, target), logits_of(loaded, target)
    assert ours[0].std() > 0.5  # logits of size: a wrong weight would show
    for step in range(STEPS):
        torch.testing.assert_close(theirs[step], ours[step], rtol=0, atol=0)


def one_line(error: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert re.search(part, message), (part, message)
    return message


@pytest.mark.parametrize(
    "layout",
    [
        {},  # SpecForge: midlayer.*, d2t and t2d, its aux layer ids in eagle_config
        {"vllm_names": True, "with_t2d": False},  # vLLM's names; t2d left out (vLLM reads d2t only)
        # the target's embeddings saved with it; no aux ids (vLLM's default for the target)
        {"with_embeddings": True, "aux": False},
    ],
    ids=["specforge", "vllm_names_no_t2d", "embeddings_default_aux"],
)
def test_a_head_in_the_vllm_layout_loads_and_drafts_as_the_original(
    layout, tmp_path, tokenizer, target, head
):
    vocab = len(tokenizer)
    path = write_foreign(tmp_path / "head", head, target, tokenizer, **layout)
    kind = Eagle3.from_layout(path)
    assert isinstance(kind, Eagle3)
    assert kind.draft_vocab_size == DRAFT_V and kind.norm_before_residual is False
    assert kind.aux_layer_ids == (None if layout.get("aux") is False else AUX)
    loaded = kind.load(ModelSpec(pretrained_model_name_or_path=str(path)), vocab, target)
    assert_same_head(loaded, head, target)
    # loading does not change the kind; the loaded head's kind fuses what the stages fetch from the target for it
    assert kind.aux_layer_ids == (None if layout.get("aux") is False else AUX)
    assert kind.loaded_kind(loaded, target).target_layers == AUX
    # drafting with it in the engine is lossless: greedy output is the target's, token for token
    prompt = [3, 7, 1, 9, 4]
    reference = autoregressive(target, prompt, 12, GREEDY, None, vocab).tokens
    proposer = kind.proposer(loaded, vocab)
    assert isinstance(proposer, Eagle3Proposer)
    assert SpeculativeDecoder(target, proposer, FixedLength(3), GREEDY, None, vocab).generate(prompt, 12).tokens \
        == reference  # fmt: skip


def test_the_speculators_layout_loads_and_drafts_as_the_original(tmp_path, tokenizer, target, head, export):
    vocab = len(tokenizer)
    speculators = export / "speculators"
    assert not (speculators / KIND_FILE).exists()
    kind = Eagle3.from_layout(speculators)
    assert isinstance(kind, Eagle3)
    assert (kind.draft_vocab_size, kind.aux_layer_ids, kind.norm_before_residual) == (DRAFT_V, AUX, False)
    loaded = kind.load(ModelSpec(pretrained_model_name_or_path=str(speculators)), vocab, target)
    assert_same_head(loaded, head, target)
    # vLLM reads a missing norm_before_residual there as true (its speculators config reader), and so do we
    copy = Path(shutil.copytree(speculators, tmp_path / "speculators"))
    record = json.loads((copy / "config.json").read_text())
    del record["norm_before_residual"], record["eagle_aux_hidden_state_layer_ids"]
    (copy / "config.json").write_text(json.dumps(record))
    kind = Eagle3.from_layout(copy)
    assert kind.norm_before_residual is True and kind.aux_layer_ids is None
    loaded = kind.load(ModelSpec(pretrained_model_name_or_path=str(copy)), vocab, target)
    assert loaded.config.norm_before_residual is True and loaded.config.aux_layer_ids == AUX
    # the kind of a head that a kind of default settings loads takes the head's settings
    fresh = Eagle3()
    loaded = fresh.load(ModelSpec(pretrained_model_name_or_path=str(copy)), vocab, target)
    assert fresh.loaded_kind(loaded, target).settings() == {"draft_vocab_size": DRAFT_V, "aux_layer_ids": list(AUX),
                                "ttt_steps": 7, "step_weight": 0.8, "norm_before_residual": True}  # fmt: skip
    assert fresh.settings() == Eagle3().settings()  # loading does not change the kind


def test_our_own_export_is_recognised_too_and_read_from_its_record(tokenizer, target, head, export):
    kind = Eagle3.from_layout(export)  # its config.json is the vLLM layout, plus specdistill_eagle3
    assert isinstance(kind, Eagle3) and kind.aux_layer_ids == AUX
    loaded = kind.load(ModelSpec(pretrained_model_name_or_path=str(export)), len(tokenizer), target)
    assert loaded.config == head.config  # from specdistill_eagle3, max_position_embeddings included


def test_a_plain_causal_lm_folder_or_no_folder_is_no_eagle3_head(tmp_path, tokenizer, target, export):
    target.save_pretrained(tmp_path / "causal_lm")
    tokenizer.save_pretrained(tmp_path / "causal_lm")
    assert Eagle3.from_layout(tmp_path / "causal_lm") is None
    assert isinstance(Eagle3.from_layout(export / "speculators"), Eagle3)  # while a head beside it is one
    assert Eagle3.from_layout(tmp_path / "missing") is None
    assert Eagle3.from_layout(Path("org/some-hub-model")) is None


def _drop(name):
    def change(path: Path) -> None:
        weights = load_file(str(path / "model.safetensors"))
        del weights[name]
        save_file(weights, str(path / "model.safetensors"))

    return change


def _add_tensor(path: Path) -> None:
    weights = load_file(str(path / "model.safetensors"))
    weights["midlayer.self_attn.q_proj.bias"] = torch.zeros(
        weights["midlayer.self_attn.q_proj.weight"].shape[0]
    )
    save_file(weights, str(path / "model.safetensors"))


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _config(**changes):
    def change(path: Path) -> None:
        record = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**record, **changes}))

    return change


UNREADABLE = {
    "missing_tensor": (_drop("lm_head.weight"), r"weights lack the tensors \['lm_head.weight'\]: the head is incomplete"),
    "missing_d2t": (_drop("d2t"), r"weights lack the tensors \['d2t'\]"),
    "truncated": (_truncate, r"its model.safetensors is not a readable safetensors file .*cut short"),
    "no_weights": (lambda path: (path / "model.safetensors").unlink(), r"it has no weights \(model.safetensors"),
    "shape": (_config(intermediate_size=128),
              r"its midlayer.mlp.\w+_proj.weight has shape \[\d+, \d+\], where its config.json gives \[.*different heads"),
    "unknown_tensor": (_add_tensor, r"weights hold tensors the head does not have: \['midlayer.self_attn.q_proj.bias'\]"),
    "rope_scaling": (_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                     r"has a rope_scaling of rope_type 'llama3': .*plain RoPE only"),
    "two_layers": (_config(num_hidden_layers=2), r"has num_hidden_layers=2: specdistill reads one-layer"),
    "eagle1": (_config(architectures=["EagleLlamaForCausalLM"]), r"EagleLlamaForCausalLM name an EAGLE-1/EAGLE-2"),
    "draft_vocabulary": (_config(draft_vocab_size=10**6),
                         r"gives no head's shape \(draft_vocab_size=1000000 must lie in \[1, vocab_size"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_eagle3_head_that_cannot_be_read_is_one_line(case, tmp_path, tokenizer, target, head):
    change, expected = UNREADABLE[case]
    path = write_foreign(tmp_path / "head", head, target, tokenizer)
    change(path)
    with pytest.raises(InputFileError) as error:
        Eagle3.from_layout(path)
    one_line(
        error,
        re.escape(str(path)),
        "holds (an EAGLE-3 head in the vLLM/SGLang layout|a speculative-decoding draft)",
        expected,
    )
    assert error.value.exit_code == 66


def test_a_speculators_variant_or_another_algorithm_is_one_line(tmp_path, export):
    for field, value, expected in [
        ("norm_before_fc", True, r"sets norm_before_fc: true \(a speculators variant"),
        ("speculators_model_type", "mtp", r"has speculators_model_type 'mtp': .*'eagle3' heads only"),
    ]:
        path = Path(shutil.copytree(export / "speculators", tmp_path / field))
        _config(**{field: value})(path)
        with pytest.raises(InputFileError) as error:
            Eagle3.from_layout(path)
        one_line(error, re.escape(str(path)), expected)


def test_a_draft_vocabulary_outside_the_target_is_one_line_at_load(tmp_path, tokenizer, target, head):
    path = write_foreign(tmp_path / "head", head, target, tokenizer)
    weights = load_file(str(path / "model.safetensors"))
    weights["d2t"] = weights["d2t"] + len(tokenizer)
    save_file(weights, str(path / "model.safetensors"))
    kind = Eagle3.from_layout(path)
    with pytest.raises(InputFileError) as error:
        kind.load(ModelSpec(pretrained_model_name_or_path=str(path)), len(tokenizer), target)
    one_line(error, re.escape(str(path)), r"its d2t maps draft ids to target ids outside \[0, \d+\)")


def test_a_target_the_head_does_not_fit_is_one_line_before_any_tensor(tmp_path, tokenizer, target, export):
    """Our export (through its record) and a foreign head: another hidden size, another vocabulary, too few layers
    for the fused states; refused before the weights are read (the export's weights are gone here)."""
    vocab = len(tokenizer)
    foreign = Path(shutil.copytree(export / "speculators", tmp_path / "foreign"))
    ours = Path(shutil.copytree(export, tmp_path / "ours"))
    (ours / "model.safetensors").unlink()
    wide = tiny_target("llama", vocab=vocab, num_hidden_layers=LAYERS, hidden_size=48)
    other_vocabulary = tiny_target("llama", vocab=vocab + 8, num_hidden_layers=LAYERS)
    shallow = tiny_target("llama", vocab=vocab, num_hidden_layers=4)
    hidden = target.config.hidden_size
    for path in (ours, foreign):
        spec = ModelSpec(pretrained_model_name_or_path=str(path))
        with pytest.raises(ConfigError) as error:
            Eagle3().load(spec, vocab, wide)
        one_line(error, re.escape(str(path)), rf"target of hidden size {hidden} \(its target_hidden_size\)",
                 r"this target \(LlamaForCausalLM\) has hidden size 48", "evaluate it with the target it was trained on")  # fmt: skip
        assert error.value.exit_code == 64
        with pytest.raises(ConfigError) as error:
            Eagle3().load(spec, vocab, other_vocabulary)
        one_line(
            error,
            re.escape(str(path)),
            rf"vocabulary of {vocab} tokens",
            rf"has {vocab + 8} input embeddings",
        )
        with pytest.raises(ConfigError) as error:
            Eagle3().load(spec, vocab, shallow)
        one_line(error, re.escape(str(path)), r"layers \[2, 4, 5\] \(its eagle_aux_hidden_state_layer_ids\)",
                 "has 4 layers")  # fmt: skip
    # a head that records no fused layers, on a target too shallow for vLLM's default ids
    _config(eagle_aux_hidden_state_layer_ids=None)(foreign)
    with pytest.raises(ConfigError) as error:
        Eagle3().load(
            ModelSpec(pretrained_model_name_or_path=str(foreign)),
            vocab,
            tiny_target("llama", vocab=vocab, num_hidden_layers=2),
        )
    one_line(error, re.escape(str(foreign)), r"records no eagle_aux_hidden_state_layer_ids")


def test_load_draft_reads_a_head_without_our_record(tmp_path, tokenizer, target, head):
    """Through the public loader: a SpecForge head loads as an EAGLE-3 draft (once `exported_kind` asks
    `Eagle3.from_layout` about a folder without a record)."""
    path = write_foreign(tmp_path / "head", head, target, tokenizer)
    loaded = load_draft(path, vocab_size=len(tokenizer), target=target)
    assert isinstance(loaded.kind, Eagle3) and loaded.kind.target_layers == AUX
    assert_same_head(loaded.model, head, target)
    assert isinstance(loaded.proposer(len(tokenizer)), Eagle3Proposer)


def test_a_pickled_head_is_refused_unread(tmp_path, tokenizer, target, head):
    """SafeAILab/EAGLE's `pytorch_model.bin` is a pickle: one line asks for safetensors, and nothing is unpickled
    (not even by torch's restricted unpickler)."""
    path = write_foreign(tmp_path / "head", head, target, tokenizer, pickled=True)
    torch.save({"fc.weight": Marker(str(tmp_path / "unpickled.txt"))}, path / "pytorch_model.bin")
    with pytest.raises(InputFileError) as error:
        Eagle3.from_layout(path)
    one_line(
        error, r"pytorch_model\.bin, a pickle, which specdistill never loads", "convert them to safetensors"
    )
    assert not (tmp_path / "unpickled.txt").exists()


def test_a_head_saved_without_a_tokenizer_is_checked_by_its_vocabulary_not_a_tokenizer(
    tmp_path, tokenizer, target, head
):
    """SpecForge saves no tokenizer with a head: evaluate and the rollouts then skip the tokenizer comparison for it
    (the head drafts the target's ids; `check_head_fits_target` compares the vocabulary sizes), while a causal LM
    without a tokenizer is still compared, and so fails as before."""
    from specdistill.stages.model_loading import TOKENIZER_FILES, brings_tokenizer

    path = write_foreign(tmp_path / "head", head, target, tokenizer)
    assert brings_tokenizer(ModelSpec(pretrained_model_name_or_path=str(path)))  # it has one: compared
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    assert not brings_tokenizer(ModelSpec(pretrained_model_name_or_path=str(path)))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    assert brings_tokenizer(ModelSpec(pretrained_model_name_or_path=str(plain)))
