"""GGUF files as a model source: a tiny random Llama written here with the `gguf` package's writer (no download)
loads with the weights it was written from, exports as safetensors that load back identical, gives its tokenizer,
and a missing package, a missing file or a file that is not GGUF each say so."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from architectures import ARCHITECTURES
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specdistill.errors import InputFileError
from specdistill.export.hf import export_pretrained
from specdistill.models import ModelSpec, load_model
from specdistill.models.tokenizer import load_tokenizer

EOS = "<|endoftext|>"
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*sorted(ByteLevel.alphabet()), "Ġt", "he", "Ġthe", EOS]  # byte-level BPE: 256 bytes, 3 merges, EOS


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows (its convert_hf_to_gguf.py), which transformers undoes on load."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(path: Path, quantize_mlp: bool = False) -> PreTrainedModel:
    """Write a tiny random Llama (tests/architectures.py) and a byte-level BPE tokenizer as a GGUF file at `path`.

    Args:
        quantize_mlp: store the MLP projections as Q8_0 blocks (the rest float32), as llama.cpp quantises.

    Returns:
        the model whose weights the file holds (the MLP's de-quantised, when quantised).
    """
    kwargs = dict(ARCHITECTURES["llama"])
    config = AutoConfig.for_model(kwargs.pop("model_type"), vocab_size=len(TOKENS), **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 1) + [3])  # 1 normal, 3 control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(len(TOKENS) - 1)
    writer.add_eos_token_id(len(TOKENS) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            base, suffix = name.rsplit(".", 1)
            gguf_name = names.get_name(base)
            weight = tensor.numpy()
            if gguf_name.endswith("attn_q"):
                weight = _permute(weight, config.num_attention_heads)
            elif gguf_name.endswith("attn_k"):
                weight = _permute(weight, config.num_key_value_heads)
            if quantize_mlp and gguf_name.split(".")[-1] in ("ffn_gate", "ffn_up", "ffn_down"):
                kind = gguf.GGMLQuantizationType.Q8_0
                blocks = gguf.quants.quantize(np.ascontiguousarray(weight), kind)
                writer.add_tensor(f"{gguf_name}.{suffix}", blocks, raw_dtype=kind)
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(tensor.shape)))
            else:
                writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> tuple[Path, PreTrainedModel]:
    folder = tmp_path_factory.mktemp("gguf")
    return folder, write_tiny_gguf(folder / "tiny.gguf")


def test_gguf_loads_the_weights_it_was_written_from_and_computes_the_same_logits(gguf_dir):
    folder, written = gguf_dir
    model = load_model(ModelSpec(pretrained_model_name_or_path=str(folder), gguf_file="tiny.gguf"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    _same_weights(model, written)
    ids = torch.tensor([[5, 70, 257, 258, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, written(ids).logits, rtol=0, atol=0)
    assert getattr(model.config, "quantization_config", None) is None and not model.is_quantized


def test_a_quantised_gguf_is_dequantised_to_plain_tensors(tmp_path):
    written = write_tiny_gguf(tmp_path / "q8.gguf", quantize_mlp=True)
    model = load_model(ModelSpec(pretrained_model_name_or_path=str(tmp_path), gguf_file="q8.gguf"))
    _same_weights(model, written)  # the MLP's Q8_0 blocks, de-quantised as the gguf package does
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())


def test_a_gguf_model_exports_as_safetensors_that_load_back_identical(gguf_dir, tmp_path):
    folder, _ = gguf_dir
    spec = ModelSpec(pretrained_model_name_or_path=str(folder), gguf_file="tiny.gguf")
    model, tokenizer = load_model(spec), load_tokenizer(str(folder), gguf_file="tiny.gguf")
    out = export_pretrained(model, tokenizer, tmp_path / "export")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert "quantization_config" not in (out / "config.json").read_text()
    _same_weights(load_model(ModelSpec(pretrained_model_name_or_path=str(out))), model)
    assert load_tokenizer(str(out)).get_vocab() == tokenizer.get_vocab()


def test_the_tokenizer_comes_from_the_gguf(gguf_dir):
    folder, _ = gguf_dir
    tokenizer = load_tokenizer(str(folder), gguf_file="tiny.gguf")
    assert len(tokenizer) == len(TOKENS)
    assert tokenizer.eos_token == EOS and tokenizer.pad_token_id == tokenizer.eos_token_id == len(TOKENS) - 1
    assert tokenizer.convert_ids_to_tokens(tokenizer(" the he", add_special_tokens=False).input_ids) == [
        "Ġthe",
        "Ġ",
        "he",
    ]  # the merges apply in the file's order


def test_a_missing_or_foreign_gguf_file_is_refused_with_the_fix(tmp_path, gguf_dir):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not GGUF")
    with pytest.raises(InputFileError, match="is not a GGUF file"):
        load_model(ModelSpec(pretrained_model_name_or_path=str(tmp_path), gguf_file="model.gguf"))
    with pytest.raises(InputFileError, match="No GGUF file 'absent.gguf'"):
        load_model(ModelSpec(pretrained_model_name_or_path=str(tmp_path), gguf_file="absent.gguf"))
    with pytest.raises(InputFileError, match="is not a GGUF file"):
        load_tokenizer(str(tmp_path), gguf_file="model.gguf")
    with pytest.raises(ValueError, match="gguf_file names a file inside pretrained_model_name_or_path"):
        ModelSpec(gguf_file="model.gguf", config={"model_type": "llama"})


def test_loading_a_gguf_without_the_gguf_package_names_the_install(gguf_dir, monkeypatch):
    folder, _ = gguf_dir
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when gguf is not installed
    with pytest.raises(ImportError, match=r"gguf_file .*needs `gguf`.*pip install 'specdistill\[gguf\]'"):
        load_model(ModelSpec(pretrained_model_name_or_path=str(folder), gguf_file="tiny.gguf"))


def test_settings_checks_look_at_the_gguf_file_not_for_a_safetensors_folder(gguf_dir, tmp_path):
    from omegaconf import OmegaConf

    from specdistill.validation import check_gguf_files, model_paths

    folder, _ = gguf_dir
    node = {"pretrained_model_name_or_path": str(folder), "gguf_file": "tiny.gguf"}
    cfg = OmegaConf.create(
        {
            "stage": {"name": "evaluate"},
            "models": {"tokenizer": node, "target": node, "draft": {"pretrained_model_name_or_path": "x/y"}},
        }
    )
    assert list(model_paths(cfg)) == [("models.draft.pretrained_model_name_or_path", "x/y")]
    check_gguf_files(cfg)  # the file is there and is GGUF
    (tmp_path / "bad.gguf").write_bytes(b"not GGUF")
    cfg.models.target = {"pretrained_model_name_or_path": str(tmp_path), "gguf_file": "bad.gguf"}
    with pytest.raises(InputFileError, match="is not a GGUF file"):
        check_gguf_files(cfg)


def test_a_pair_from_gguf_files_passes_the_settings_checks_and_builds_its_tokenizer(gguf_dir):
    from hydra.utils import instantiate
    from test_user_errors import validated

    from tests.helpers import hydra_conf

    folder, _ = gguf_dir
    overrides = [
        "stage=distill", "models=local", f"models.target_path={folder}", f"models.draft_path={folder}",
        "+models.target.gguf_file=tiny.gguf", "+models.draft.gguf_file=tiny.gguf",
        "+models.tokenizer.gguf_file=tiny.gguf",
    ]  # fmt: skip
    validated(*overrides)
    with hydra_conf():
        from hydra import compose

        cfg = compose("train", overrides=overrides)
    assert len(instantiate(cfg.models.tokenizer)) == len(TOKENS)
    assert instantiate(cfg.models.target).gguf_file == "tiny.gguf"
    # a stage loads the pair: each pretrained role's own tokenizer comes from its GGUF file too
    from specdistill.stages.model_loading import load_models, model_spec

    specs = {"target": model_spec(cfg.models.target), "draft": model_spec(cfg.models.draft)}
    tokenizer, models, vocab_size = load_models(cfg, specs)
    assert vocab_size == len(TOKENS) and set(models) == {"target", "draft"}
