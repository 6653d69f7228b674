"""Tasks on their fixture files: exact prompt/answer strings, extraction and scores, and the loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from specdistill.tasks.base import TaskDataError, kept_indices
from specdistill.tasks.code_execution import CodeExecutionDisabledError, run_python
from specdistill.tasks.gsm8k import GSM8K
from specdistill.tasks.metrics import normalise_number, rouge_l_f

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def fixture_files(task: str, ext: str = "parquet") -> dict[str, str]:
    return {p.stem: str(p) for p in sorted((FIXTURES / task).glob(f"*.{ext}"))}


def compose_task(name: str, *overrides: str):
    """One task config on its own; arith's seed, derived from the root `seed` in a full config, is pinned here."""
    pinned = ["seed=0"] if name == "arith" and not any(o.startswith("seed=") for o in overrides) else []
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "task"), version_base="1.3"):
        return instantiate(compose(config_name=name, overrides=[*pinned, *overrides]))


# ---------------------------------------------------------------- gsm8k
def test_gsm8k_formatting_on_fixture():
    files = fixture_files("gsm8k")
    task = compose_task(
        "gsm8k", f"data_files={{train:{files['train']},test:{files['test']}}}", "holdout.validation=2"
    )
    train, validation, test = (task.load_split(s) for s in ("train", "validation", "test"))
    assert (len(train), len(validation), len(test)) == (3, 2, 3)  # the last 2 train records became validation
    assert validation[0]["question"].startswith("A rope is 20 meters long")
    record = train[0]
    assert task.prompt(record) == (
        "Ann has 3 red pens and 4 blue pens. How many pens does she have?\n"
        "Answer the above question. First think step by step and then answer the final number.\n"
    )
    assert task.answer(record) == "Ann has 3 + 4 = <<3+4=7>>7 pens.\nThe final answer is:  7"
    assert task.name == "gsm8k" and task.metric_name == "accuracy" and task.train_available


def test_gsm8k_extract_and_score():
    task = GSM8K()
    record = {"question": "?", "answer": "It saves 600 * 2 = 1,200.\n#### 1,200"}
    assert task.extract_answer("so ... The final answer is:  $1,200.00 and more 7") == "1200"
    assert task.extract_answer("#### -3") == "-3"
    assert task.extract_answer("no marker, 3 then 1200.") == "1200"  # flexible: last number
    assert task.extract_answer("no number at all") is None
    assert task.extract_answer("The final answer is: unknown") is None
    assert task.score("The final answer is: 1200", record) == 1.0
    assert task.score("The final answer is: 1201", record) == 0.0
    assert task.score(task.answer(record), record) == 1.0
    with pytest.raises(ValueError, match="####"):
        task.score("1", {"question": "?", "answer": "no final line"})


def test_normalise_number():
    assert normalise_number("1,234.50") == "1234.5"
    assert (
        normalise_number("72.0") == "72" and normalise_number("-0") == "0" and normalise_number("3.") == "3"
    )
    assert normalise_number("abc") is None and normalise_number("nan") is None


# ---------------------------------------------------------------- loading errors
def test_local_file_formats_by_extension(tmp_path):
    records = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.csv").write_text(
        "question,answer\n" + "".join(f'"{r["question"]}","{r["answer"]}"\n' for r in records)
    )
    for ext in ("jsonl", "json", "csv"):
        task = GSM8K(data_files=str(tmp_path / f"a.{ext}"), holdout={"validation": 1})
        assert task.load_split("train").to_list() == records[:1]
        assert task.load_split("validation").to_list() == records[1:]
    assert GSM8K(data_files=str(tmp_path / "*.jsonl"), holdout={}).load_split("train").to_list() == records


def test_missing_file_empty_split_and_unknown_split(tmp_path):
    with pytest.raises(TaskDataError, match="Data file not found"):
        GSM8K(data_files={"train": str(tmp_path / "nope.jsonl")}).load_split("train")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TaskDataError, match="empty"):
        GSM8K(data_files={"test": str(tmp_path / "empty.jsonl")}).load_split("test")
    task = GSM8K(data_files={"test": fixture_files("gsm8k")["test"]})
    assert task.available_splits == ("test",) and not task.train_available
    with pytest.raises(TaskDataError, match="has no 'train' split"):
        task.load_split("train")
    with pytest.raises(TaskDataError, match="Unknown split"):
        task.load_split("dev")
    with pytest.raises(TaskDataError, match="cannot hold out"):
        GSM8K(data_files=fixture_files("gsm8k")["train"]).load_split("validation")  # 200 of 5
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(TaskDataError, match="Unsupported"):
        GSM8K(data_files={"test": str(tmp_path / "x.txt")}).load_split("test")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(TaskDataError, match="lacks columns"):
        GSM8K(data_files={"test": str(tmp_path / "wrong.jsonl")}).load_split("test")
    with pytest.raises(ValueError, match="unknown split names"):
        GSM8K(data_files={"dev": "x.jsonl"})


def test_hub_offline_error_says_to_pass_data_files():
    with pytest.raises(TaskDataError, match="task.data_files"):
        GSM8K(path="specdistill-tests/does-not-exist").load_split("test")


def test_max_examples_limits_each_split():
    files = fixture_files("gsm8k")
    task = GSM8K(data_files=files, holdout={}, max_examples={"train": 2})
    assert len(task.load_split("train")) == 2 and len(task.load_split("test")) == 3
    assert len(GSM8K(data_files=files, max_examples=1).load_split("test")) == 1
    with pytest.raises(ValueError, match="positive"):
        GSM8K(max_examples={"train": 0})


def test_subset_seed_draws_nested_random_records_in_split_order():
    """With `subset_seed`, `max_examples` keeps a seeded random draw, in split order, and a smaller N's records are
    among a larger N's (a data-size study grows one sample); another seed draws other records."""
    assert kept_indices(10, 3, None) == [0, 1, 2] and kept_indices(3, 10, 0) == [0, 1, 2]
    draws = {n: kept_indices(200, n, seed=0) for n in (5, 20, 80)}
    assert all(d == sorted(d) and len(set(d)) == len(d) for d in draws.values())
    assert set(draws[5]) <= set(draws[20]) <= set(draws[80])
    assert draws[20] != list(range(20)) and draws[20] != kept_indices(200, 20, seed=1)
    files = fixture_files("gsm8k")
    first = GSM8K(data_files=files, holdout={}, max_examples={"test": 2}).load_split("test")
    drawn = GSM8K(data_files=files, holdout={}, max_examples={"test": 2}, subset_seed=3).load_split("test")
    every = GSM8K(data_files=files, holdout={}).load_split("test")
    assert drawn["question"] == [every["question"][i] for i in kept_indices(len(every), 2, 3)]
    assert len(first) == len(drawn) == 2


# ---------------------------------------------------------------- metrics
def test_rouge_l_f():
    assert rouge_l_f("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l_f("", "anything") == 0.0 and rouge_l_f("dog", "cat") == 0.0
    # LCS "the cat the mat" = 4 of 6 prediction tokens and 4 of 5 reference tokens
    p, r = 4 / 6, 4 / 5
    assert rouge_l_f("The cat, sat on the mat!", "the cat ate the mat") == pytest.approx(2 * p * r / (p + r))


# ---------------------------------------------------------------- the other tasks on their fixtures
def data_files_override(task: str, ext: str = "parquet") -> str:
    files = fixture_files(task, ext)
    return "data_files={" + ",".join(f"{split}:{path}" for split, path in files.items()) + "}"


def test_alpaca_formatting_and_rouge():
    task = compose_task("alpaca", data_files_override("alpaca"), "holdout={validation:1,test:1}")
    train, test = task.load_split("train"), task.load_split("test")
    assert len(train) == 3 and test[0]["output"] == "Joyful."
    assert task.prompt(train[0]) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nGive three tips for staying healthy.\n\n### Response:\n"
    )
    assert task.prompt(train[1]) == (
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\nTranslate the sentence into French."
        "\n\n### Input:\nGood morning.\n\n### Response:\n"
    )
    assert task.prompt(train[1]) + task.answer(train[1]) == train[1]["text"]  # the dataset's own formatting
    assert task.answer(train[0]) == "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Sleep enough."
    assert task.metric_name == "rougeL"
    assert task.score("  Bonjour. ", train[1]) == 1.0 and task.score("Hello.", train[1]) == 0.0


def test_xsum_and_cnn_dailymail_formatting():
    xsum = compose_task("xsum", data_files_override("xsum"))
    record = xsum.load_split("validation")[0]
    assert xsum.prompt(record) == (
        "The council of Ely voted on Tuesday to open a new library next spring. Officials said the building would "
        "also host evening classes.\n\nSummarize the above article in one sentence.\n"
    )
    assert xsum.answer(record) == "Ely will get a new library next spring."
    assert xsum.score("Ely will get a new library next spring.", record) == 1.0
    cnn = compose_task("cnn_dailymail", data_files_override("cnn_dailymail"))
    record = cnn.load_split("test")[2]
    assert cnn.prompt(record).startswith("(Phoenix) -- Heavy rain flooded streets in Phoenix on Monday.")
    assert cnn.prompt(record).endswith("by Thursday.\n\nWrite the highlights of the above article.\n")
    assert (
        cnn.answer(record)
        == "Heavy rain floods streets in Phoenix .\nSchools close early and buses are delayed ."
    )
    assert 0.0 < cnn.score("Heavy rain floods Phoenix.", record) < 1.0
    assert cnn.metric_name == "rougeL" and cnn.available_splits == ("train", "validation", "test")


def test_mbpp_formatting_and_opt_in_execution():
    task = compose_task("mbpp", data_files_override("mbpp"))
    record = task.load_split("train")[0]
    assert task.prompt(record) == (
        "You are an expert Python programmer, and here is your task: Write a python function to find the first "
        'repeated character in a given string. Your code should pass these tests:\n\nassert first_repeated_char("abcabc")'
        ' == "a"\nassert first_repeated_char("abc") is None\n'
    )
    assert "\r" not in task.answer(record) and task.answer(record).startswith("def first_repeated_char(s):\n")
    assert (
        task.extract_answer("Here:\n```python\ndef f():\n    return 1\n```\nDone.")
        == "def f():\n    return 1"
    )
    assert task.metric_name == "pass@1" and not task.scoring_available
    with pytest.raises(CodeExecutionDisabledError, match="task.execute_code=true"):
        task.score(task.answer(record), record)
    runs = compose_task("mbpp", data_files_override("mbpp"), "execute_code=true", "timeout_s=5")
    test = runs.load_split("test")
    assert runs.scoring_available
    assert runs.score(runs.answer(test[1]), test[1]) == 1.0  # needs its test_setup_code ("import math")
    assert runs.score("def count_vowels(s):\n    return 0", test[0]) == 0.0


def test_humaneval_is_evaluation_only_and_scores_by_execution():
    task = compose_task("humaneval", data_files_override("humaneval"), "execute_code=true")
    assert not task.train_available and task.available_splits == ("test",)
    with pytest.raises(TaskDataError, match="has no 'train' split"):
        task.load_split("train")
    record = task.load_split("test")[1]
    assert task.prompt(record).startswith("def is_palindrome(text: str) -> bool:\n")
    assert task.answer(record) == "    return text == text[::-1]\n"
    completion = "    return text == text[::-1]\n\n\ndef unrelated():\n    raise SystemExit(1)\n"
    assert task.extract_answer(completion) == "    return text == text[::-1]"  # cut at the next top-level def
    assert task.score(completion, record) == 1.0
    assert task.score("    return True\n", record) == 0.0
    # a single file is the test split of an evaluation-only task
    single = compose_task("humaneval", f"data_files={fixture_files('humaneval')['test']}")
    assert len(single.load_split("test")) == 3


def test_sharegpt_chat_messages():
    task = compose_task(
        "sharegpt", f"data_files={FIXTURES / 'sharegpt' / 'train.jsonl'}", "holdout={validation:1,test:1}"
    )
    assert task.chat_template
    records = task.load_split("train").to_list() + task.load_split("test").to_list()
    assert [r["id"] for r in records] == ["a1", "a2", "a5"]  # a3 (no user turn) skipped; a4 is validation
    assert task.prompt(records[1]) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Now say bye."},
    ]
    assert task.answer(records[1]) == "Bye."  # the trailing unanswered "Thanks!" is dropped
    assert task.answer(records[0]) == "The capital of France is Paris."
    assert task.score("Paris is the capital of France.", records[0]) == pytest.approx(
        4 / 6
    )  # LCS "the capital of france"
    with pytest.raises(TaskDataError, match="no hub dataset"):
        compose_task("sharegpt").load_split("train")


def test_chat_task_reads_ultrachat_messages_too(tmp_path):
    """UltraChat's layout (`messages: [{role, content}]`) reads as ShareGPT's does; a record with neither list is
    an error naming the row and both schemas."""
    rows = [{"prompt_id": "u1", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Bye."}]}]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    task = compose_task("sharegpt", f"data_files={tmp_path / 'chat.jsonl'}", "holdout={validation:1,test:1}")
    record = task.load_split("train")[0]
    assert task.answer(record) == "Bye." and task.prompt(record)[-1] == {"role": "user", "content": "And?"}
    assert [m["content"] for m in task.conversation(record)] == ["Hi?", "Hello.", "And?", "Bye."]
    assert compose_task("sharegpt", "all_turns=false").conversation(record) is None
    (tmp_path / "bad.jsonl").write_text((json.dumps({"id": "x", "turns": []}) + "\n") * 3)
    with pytest.raises(TaskDataError, match="UltraChat"):
        compose_task(
            "sharegpt", f"data_files={tmp_path / 'bad.jsonl'}", "holdout={validation:1,test:1}"
        ).load_split("train")


def test_run_python_timeout_and_failure():
    assert run_python("assert sum([1, 2]) == 3").passed
    failed = run_python("raise ValueError('boom')")
    assert not failed.passed and not failed.timed_out and "boom" in failed.stderr_tail
    slow = run_python("while True:\n    pass", timeout_s=0.5)
    assert slow.timed_out and not slow.passed


def test_every_task_config_composes():
    local = [
        "data_files=" + str(ROOT / "tests" / "fixtures" / "local" / "qa_train.jsonl"),
        "fields.prompt=q",
        "fields.answer=a",
    ]
    for path in sorted((ROOT / "conf" / "task").glob("*.yaml")):
        given = {"local": local, "python_folder": [f"root={ROOT / 'tasks'}"]}  # their required settings
        task = compose_task(path.stem, *given.get(path.stem, []))
        assert task.name == path.stem
        assert task.metric_name in {"accuracy", "rougeL", "pass@1", "exact_match"}
