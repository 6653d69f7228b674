"""HumanEval as a training task (task=humaneval_splits): the problems evaluation decodes are its test split and never
reach train or validation; the others keep their split by a hash of the task id."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hydra import compose
from hydra.utils import instantiate

from specdistill.tasks.base import TaskDataError
from specdistill.tasks.humaneval import HumanEvalSplits
from tests.helpers import hydra_conf


def problems_file(path: Path, n: int) -> Path:
    """`n` problems in HumanEval's schema (openai/openai_humaneval), gzip-compressed as the wheel ships them."""
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
             "canonical_solution": f"    return x + {i}\n", "test": f"def check(c):\n    assert c(0) == {i}\n",
             "entry_point": f"f{i}"} for i in range(n)]  # fmt: skip
    with gzip.open(path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def ids(task: HumanEvalSplits, split: str) -> list[str]:
    return list(task.load_split(split)["task_id"])


def compose_task(name: str):
    with hydra_conf():
        return compose("train", overrides=[f"task={name}"]).task


def test_the_package_preset_holds_out_the_ten_evaluated_problems_and_splits_the_rest():
    task = instantiate(compose_task("humaneval_splits"))
    assert isinstance(task, HumanEvalSplits) and task.train_available
    splits = {split: ids(task, split) for split in ("train", "validation", "test")}
    # the test split is what an evaluation of the first 10 prompts of task=humaneval_package decodes
    evaluated = instantiate(compose_task("humaneval_package")).load_split("test")["task_id"][:10]
    assert splits["test"] == list(evaluated) == [f"HumanEval/{i}" for i in range(10)]
    assert not set(splits["test"]) & (set(splits["train"]) | set(splits["validation"]))
    assert not set(splits["train"]) & set(splits["validation"])
    assert sum(len(s) for s in splits.values()) == 164
    assert 0.1 < len(splits["validation"]) / 154 < 0.3  # validation_fraction 0.2 of the other 154


def test_a_problem_keeps_its_split_when_others_are_added(tmp_path):
    small = HumanEvalSplits(data_files=str(problems_file(tmp_path / "a.jsonl.gz", 40)), evaluated=5)
    large = HumanEvalSplits(data_files=str(problems_file(tmp_path / "b.jsonl.gz", 80)), evaluated=5)
    assert ids(small, "test") == ids(large, "test") == [f"HumanEval/{i}" for i in range(5)]
    for split in ("train", "validation"):
        assert ids(small, split) == [i for i in ids(large, split) if int(i.split("/")[1]) < 40]
    assert ids(small, "validation") and ids(small, "train")


def test_holding_out_every_problem_or_a_split_mapping_is_refused(tmp_path):
    data = str(problems_file(tmp_path / "p.jsonl.gz", 6))
    with pytest.raises(
        TaskDataError, match=r"evaluated=6 holds out every one of the 6 problems.*task.evaluated"
    ):
        HumanEvalSplits(data_files=data, evaluated=6).load_split("train")
    with pytest.raises(ValueError, match="not a mapping of splits"):
        HumanEvalSplits(data_files={"train": data}, evaluated=1)
    with pytest.raises(ValueError, match="validation_fraction=1.0"):
        HumanEvalSplits(data_files=data, validation_fraction=1.0)
    with pytest.raises(ValueError, match="evaluated=-1"):
        HumanEvalSplits(data_files=data, evaluated=-1)
