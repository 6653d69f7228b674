"""Model loading and the vocabulary checks between draft, reference and target."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.models import (
    Frozen,
    ModelSpec,
    VocabularyMismatchError,
    check_model_covers_vocab,
    check_same_tokenizer,
    load_model,
)
from specdistill.models.tokenizer import load_tokenizer

TINY = dict(
    model_type="gpt_neox", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
)


def test_build_from_config_takes_tokenizer_vocab_and_is_seeded():
    a = load_model(ModelSpec(config=TINY, seed=3), vocab_size=77)
    b = load_model(ModelSpec(config=TINY, seed=3), vocab_size=77)
    assert a.config.vocab_size == 77
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_local_export_round_trip(tmp_path):
    model = load_model(ModelSpec(config=TINY), vocab_size=50)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded = load_model(ModelSpec(pretrained_model_name_or_path=str(tmp_path / "m")))
    x = torch.randint(0, 50, (1, 6))
    assert torch.allclose(model(x).logits, loaded(x).logits)


def test_missing_local_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ModelSpec(pretrained_model_name_or_path=str(tmp_path / "nope")))


@pytest.mark.parametrize("bad", [dict(dtype="float8"), dict()])
def test_bad_spec_is_refused(bad):
    with pytest.raises(ValueError):
        ModelSpec(**bad)


def test_same_tokenizer_passes_and_returns_real_vocab(tmp_path):
    tok = arith_tokenizer()
    tok.save_pretrained(tmp_path / "t")
    assert check_same_tokenizer({"draft": tok, "target": load_tokenizer(str(tmp_path / "t"))}) == len(tok)


def test_different_tokenizers_are_refused_by_content_not_size(tmp_path):
    a = arith_tokenizer(vocab_size=300)
    b = arith_tokenizer(vocab_size=300, seed=1)  # same size, other corpus: other merges and ids
    assert len(a) == len(b)
    with pytest.raises(VocabularyMismatchError, match="does not match"):
        check_same_tokenizer({"target": a, "draft": b})


def test_padded_embedding_rows_are_fine_but_too_few_rows_are_refused():
    padded = AutoModelForCausalLM.from_config(
        GPTNeoXConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    check_model_covers_vocab("draft", padded, 60)  # 64 rows for 60 real tokens, like Qwen's padding
    with pytest.raises(VocabularyMismatchError, match="output rows"):
        check_model_covers_vocab("draft", padded, 70)


def test_frozen_holder_keeps_model_out_of_parameters():
    model = load_model(ModelSpec(config=TINY), vocab_size=20)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = Frozen(model)

    holder = Holder()
    assert not list(holder.parameters()) and not holder.state_dict()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
