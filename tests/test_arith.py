"""The embedded arith task: generator correctness, determinism, disjoint splits, and its cached BPE tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from specdistill.data.arith import generate_split
from specdistill.data.arith_tokenizer import EOS_TOKEN, PAD_TOKEN, arith_tokenizer
from specdistill.tasks.arith import Arith

_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def test_generated_arithmetic_is_right_and_gsm8k_shaped():
    for record in generate_split("train", 300, seed=3):
        lines = record["answer"].split("\n")
        assert lines[-1].startswith("#### ")
        final = int(lines[-1][5:])
        equations = _EQUATION.findall(record["answer"])
        assert 2 <= len(equations) <= 4, record  # 2-3 operations; a "packs of" step writes two equations
        for a, op, b, c in equations:
            assert _OPS[op](int(a), int(b)) == int(c), record
            assert int(a) >= 0 and int(c) >= 0
        assert int(equations[-1][3]) == final
        assert record["question"].endswith("?")


def test_generator_is_deterministic_and_seeded():
    assert generate_split("validation", 50, seed=0) == generate_split("validation", 50, seed=0)
    assert generate_split("validation", 50, seed=0) != generate_split("validation", 50, seed=1)
    # a split's first records do not depend on how many are asked for
    assert generate_split("test", 10, seed=0) == generate_split("test", 200, seed=0)[:10]


def test_default_splits_share_no_question():
    splits = {s: {r["question"] for r in generate_split(s, n)} for s, n in Arith().sizes.items()}
    assert [len(q) for q in splits.values()] == [4000, 200, 200]  # no duplicate within a split either
    assert not splits["train"] & splits["validation"]
    assert not splits["train"] & splits["test"]
    assert not splits["validation"] & splits["test"]


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Unknown arith split"):
        generate_split("dev", 5)
    with pytest.raises(ValueError, match="positive size"):
        generate_split("train", 0)


def test_arith_task_sizes_limits_and_formatting():
    task = Arith(sizes={"test": 30}, max_examples={"train": 7})
    assert len(task.load_split("train")) == 7
    test = task.load_split("test")
    assert len(test) == 30
    # the test split is the same whatever the train size
    assert Arith(sizes={"train": 50, "test": 30}).load_split("test").to_list() == test.to_list()
    record = test[0]
    assert task.prompt(record).endswith(
        "\nAnswer the above question. First think step by step and then answer the final number.\n"
    )
    assert task.answer(record).endswith(f"The final answer is:  {record['answer'].rsplit('#### ', 1)[1]}")
    assert task.score(task.answer(record), record) == 1.0
    assert task.metric_name == "accuracy" and task.train_available
    with pytest.raises(ValueError, match="unknown split names"):
        Arith(sizes={"dev": 3})


def test_tokenizer_cache_round_trip(tmp_path):
    tok = arith_tokenizer(vocab_size=300, cache_dir=tmp_path)
    (cached,) = list(tmp_path.iterdir())
    assert cached.name.startswith("arith-") and (cached / "tokenizer.json").is_file()
    before = (cached / "tokenizer.json").read_text()
    again = arith_tokenizer(vocab_size=300, cache_dir=tmp_path)  # loaded, not retrained
    assert (cached / "tokenizer.json").read_text() == before
    assert list(tmp_path.iterdir()) == [cached]
    assert again.get_vocab() == tok.get_vocab()
    assert len(tok) == 300
    assert tok.eos_token == tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    text = "Mia has 23 apples. She buys 17 more.\nThe final answer is:  40"
    ids = tok(text)["input_ids"]
    assert again(text)["input_ids"] == ids and tok.decode(ids) == text
    assert "7" in tok.convert_ids_to_tokens(tok(" 17")["input_ids"])  # numbers are spelled digit by digit
    # other settings get their own directory
    arith_tokenizer(vocab_size=320, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_tokenizer_training_is_deterministic_and_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "root"))
    first = arith_tokenizer(vocab_size=300)
    second = arith_tokenizer(vocab_size=300, cache_dir=tmp_path / "elsewhere")
    (cached,) = list((tmp_path / "root" / "tokenizers").iterdir())
    (other,) = list((tmp_path / "elsewhere").iterdir())
    assert cached.name == other.name
    assert json.loads((cached / "tokenizer.json").read_text()) == json.loads(
        (other / "tokenizer.json").read_text()
    )
    assert first.get_vocab() == second.get_vocab()


def test_answers_are_short_with_the_default_tokenizer():
    tok = arith_tokenizer()
    task = Arith(sizes={"validation": 100})
    lengths = [len(tok(task.answer(r))["input_ids"]) for r in task.load_split("validation")]
    assert len(tok) == 512
    assert 25 <= sum(lengths) / len(lengths) <= 60 and max(lengths) <= 90


def test_tokenizer_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="256 bytes"):
        arith_tokenizer(vocab_size=100, cache_dir=tmp_path)
