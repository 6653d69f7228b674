"""Exports work outside specdistill: the tokenizer's special-token ids, HF assisted generation stopping at EOS, file
modes that follow the umask, and acceptance heads that record and check the draft they belong to."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.export.hf import export_pretrained
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.models.draft_identity import describe_draft, draft_fingerprint


@pytest.fixture(scope="module")
def tokenizer():
    return arith_tokenizer(vocab_size=300, train_size=200)


def tiny_lm(vocab: int, seed: int, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=2 * hidden,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def test_export_special_tokens_are_the_tokenizers(tokenizer, tmp_path: Path):
    model = tiny_lm(len(tokenizer), seed=0)
    assert (
        model.config.eos_token_id != tokenizer.eos_token_id
    )  # GPT-NeoX's default (2) is not the tokenizer's (0)
    export_pretrained(model, tokenizer, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[name] == getattr(tokenizer, name), name
        assert generation.get(name) == getattr(tokenizer, name), name
    assert GenerationConfig.from_pretrained(tmp_path / "export").eos_token_id == tokenizer.eos_token_id


def test_hf_assisted_generation_with_an_exported_draft_stops_at_eos(tokenizer, tmp_path: Path):
    """A target that puts all its mass on EOS after a few tokens: generate must stop there, assisted or not."""
    vocab = len(tokenizer)
    target, draft = tiny_lm(vocab, seed=1), tiny_lm(vocab, seed=2, hidden=16)
    with torch.no_grad():  # logits all equal: greedy argmax is token 0, the tokenizer's EOS
        target.get_output_embeddings().weight.zero_()
    assert tokenizer.eos_token_id == 0
    export_pretrained(target, tokenizer, tmp_path / "target")
    export_pretrained(draft, tokenizer, tmp_path / "draft")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    prompt = tokenizer("Tom has 3 apples.", return_tensors="pt")
    plain = target.generate(**prompt, do_sample=False, max_new_tokens=12)
    assisted = target.generate(**prompt, assistant_model=draft, do_sample=False, max_new_tokens=12)
    assert plain.shape[1] == prompt["input_ids"].shape[1] + 1  # one EOS, then stop (not 12 new tokens)
    assert torch.equal(plain, assisted)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_export_file_modes_follow_the_umask(tokenizer, tmp_path: Path, umask: int):
    previous = os.umask(umask)
    try:
        export_pretrained(
            tiny_lm(len(tokenizer), seed=0), tokenizer, tmp_path / "export", metadata={"stage": "t"}
        )
        head = AcceptanceHead(8, 1).save(tmp_path / "head")
    finally:
        os.umask(previous)
    for directory in (tmp_path / "export", head):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask
        for path in directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_head_export_records_its_draft_and_input_definition(tmp_path: Path):
    draft = tiny_lm(40, seed=3)
    head = AcceptanceHead(draft.config.hidden_size, 1, input="proposer")
    head.save(tmp_path / "head", draft=describe_draft(draft, "runs/distill/export"))
    saved = AcceptanceHead.read_config(tmp_path / "head")
    assert saved["draft"]["fingerprint"] == draft_fingerprint(draft)
    assert saved["draft"]["source"] == "runs/distill/export" and saved["draft"]["hidden_size"] == 32
    assert saved["inputs"]["width"] == 33 and len(saved["inputs"]["features"]) == 1
    loaded = AcceptanceHead.load(tmp_path / "head", draft=draft)
    x = torch.randn(4, 33)
    torch.testing.assert_close(loaded(x), head(x), rtol=0, atol=0)
    # the same draft loaded in bf16 (as presets load frozen drafts) is still the same draft
    AcceptanceHead.load(tmp_path / "head", draft=tiny_lm(40, seed=3).to(torch.bfloat16))


def test_a_head_paired_with_another_draft_is_refused(tmp_path: Path):
    draft = tiny_lm(40, seed=3)
    AcceptanceHead(32, 1).save(tmp_path / "head", draft=describe_draft(draft))
    other = tiny_lm(40, seed=3)
    with torch.no_grad():
        other.get_output_embeddings().weight[0, 0] += 0.1  # one trained weight differs
    with pytest.raises(ValueError, match="trained on the draft .* whose weights differ"):
        AcceptanceHead.load(tmp_path / "head", draft=other)
    AcceptanceHead(32, 1).save(tmp_path / "anonymous")
    with pytest.raises(ValueError, match="records no draft"):
        AcceptanceHead.load(tmp_path / "anonymous", draft=draft)
