"""`stdlib_code`: complete a function of the Python standard library from its signature and docstring, in HumanEval's
shape; training prompts for code drafts that ship with every Python and that nobody here wrote.

Records are read from the running interpreter's own standard library (`sysconfig.get_paths()["stdlib"]`) with `ast`;
no module is imported or executed. A record is one module-level function (`def`, not `async def`; methods are
excluded, as HumanEval has none) that has a triple-double-quoted docstring and a body after it:

* prompt: the function's source from its `def` line to the end of its docstring, plus a newline, so
  `def name(args):\\n    \"\"\"docstring\"\"\"\\n` as in HumanEval; decorators are dropped (HumanEval has none, and a
  decorator's names would need the module's imports);
* answer: the real body that follows, as written in the file (comments kept), ending with a newline; every record
  satisfies `ast.parse(prompt + answer)`.

The answers are the library's own bodies, not the target's generations: the distillation losses compare the draft
with the target at every answer position, so the target teaches its distribution whichever text is conditioned on,
and generating target answers for these prompts would cost about a CPU hour here.

Skipped: private names (a function or any module part with a leading underscore), the test suites and the
non-library trees (`test/`, `tests/`, `idlelib/`, `lib2to3/`, `turtledemo/`, `site-packages/`), bodies longer than
`max_answer_chars`, duplicate definitions in one module (the first is kept), and every function named like an entry
point of the benchmark in `exclude_entry_points_of` (HumanEval's file by default, conf/task/stdlib_code.yaml), so no
evaluation problem's function is trained on.

Splits are fixed by a hash of the qualified name (`module.function`), so a function stays in its split whatever else
is added or removed, and validation (where K and h are chosen) is held out from training; records are sorted by
qualified name. The corpus is the interpreter's: another Python version gives other records.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import tokenize
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

import datasets

from specdistill.tasks.base import SPLITS, Record, TaskDataError, hash_split
from specdistill.tasks.humaneval import HumanEval

SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
)
DOCSTRING_QUOTE = '"""'


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(path: Path, root: Path, skipped_dirs: frozenset[str] = SKIPPED_DIRS) -> str | None:
    """`a/b/c.py` under `root` -> "a.b.c" (`a/__init__.py` -> "a"); None for a module in one of `skipped_dirs`, a
    test module, or a private one (a hidden directory is not an identifier: skipped too)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if any(p in skipped_dirs for p in parts[:-1]) or parts[-1].startswith("test_"):
        return None
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or any(p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def function_records(source: str, module: str, max_answer_chars: int, prefix: str = "stdlib") -> list[Record]:
    """The usable module-level functions of one module's source (see the module docstring), in file order; their
    `task_id` is `<prefix>/<module>.<function>`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a file of another Python's grammar (none in a clean stdlib): nothing to read
        return []
    lines = source.splitlines(keepends=True)
    out: list[Record] = []
    seen: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in seen:
            continue
        seen.add(node.name)
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc = node.body[0]
        prompt_lines = lines[node.lineno - 1 : doc.end_lineno]
        if not prompt_lines or not prompt_lines[-1].rstrip().endswith(DOCSTRING_QUOTE):
            continue  # another quote style, or code after the docstring on its line
        if node.body[1].lineno <= doc.end_lineno:
            continue
        prompt = "".join(prompt_lines).rstrip() + "\n"
        answer = "".join(lines[doc.end_lineno : node.end_lineno]).lstrip("\n").rstrip() + "\n"
        if len(answer) > max_answer_chars:
            continue
        try:
            ast.parse(prompt + answer)
        except SyntaxError:  # e.g. a body indented unlike its docstring
            continue
        out.append(
            {
                "task_id": f"{prefix}/{module}.{node.name}",
                "prompt": prompt,
                "canonical_solution": answer,
                "entry_point": node.name,
            }
        )
    return out


def split_of(qualified_name: str, fractions: Mapping[str, float], task: str = "stdlib_code") -> str:
    """The split a function belongs to: a hash of the task's name and the function's qualified name placed in
    [0, 1) against `fractions` (validation first, then test; the rest is train)."""
    return hash_split(f"{task}/{qualified_name}", fractions)


def _normalised(record: Record) -> str:
    """A function's text with every run of whitespace made one space: copies that differ only in layout match."""
    return " ".join((record["prompt"] + record["canonical_solution"]).split())


def deduplicated(records: list[Record]) -> list[Record]:
    """`records` (in order) without the functions whose text, whitespace aside, an earlier one has: vendored copies
    and helpers pasted into several modules would otherwise sit in more than one split."""
    seen: set[str] = set()
    out = []
    for record in records:
        key = _normalised(record)
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out


def entry_points(path: str | Path) -> frozenset[str]:
    """The `entry_point` of every record of a JSON Lines file, gzip-compressed or not (HumanEval's layout)."""
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            return frozenset(json.loads(line)["entry_point"] for line in handle if line.strip())
    except (OSError, ValueError, KeyError) as err:
        raise TaskDataError(
            f"Cannot read the entry points to exclude from {path} ({type(err).__name__}: {err}); "
            "task.exclude_entry_points_of names a JSON Lines file whose records have `entry_point` (HumanEval's)."
        ) from err


class StdlibCode(HumanEval):
    """Standard-library functions as HumanEval-shaped prompts with their real bodies; train/validation/test.

    Args:
        max_answer_chars: longest body kept, in characters.
        fractions: share of the functions in `validation` and in `test` (by hash of the qualified name).
        exclude_entry_points_of: a JSON Lines file (HumanEval's) whose `entry_point` names are left out; None
            excludes nothing.
        root: the directory read (default: the interpreter's standard library; tests point it at a small tree).
        **kwargs: `HumanEval` / `Task` arguments (`max_examples`, ...).
    """

    name = "stdlib_code"
    # task ids are `<id_prefix>/<module>.<function>`
    id_prefix = "stdlib"
    skipped_dirs = SKIPPED_DIRS
    # drop functions whose text an earlier one has (off here: the standard library's corpus stays as README measured)
    deduplicate = False
    required_columns = ("task_id", "prompt", "canonical_solution", "entry_point")
    default_path = None
    default_splits = {"train": "train", "validation": "validation", "test": "test"}
    prompt_styles = ("default",)

    def __init__(
        self,
        max_answer_chars: int = 1500,
        fractions: Mapping[str, float] | None = None,
        exclude_entry_points_of: str | None = None,
        root: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if max_answer_chars < 1:
            raise ValueError(f"max_answer_chars={max_answer_chars} must be positive.")
        self.max_answer_chars = int(max_answer_chars)
        self.fractions = {"validation": 0.1, "test": 0.1, **dict(fractions or {})}
        unknown = sorted(set(self.fractions) - {"validation", "test"})
        if unknown or any(f < 0 for f in self.fractions.values()) or sum(self.fractions.values()) >= 1:
            raise ValueError(
                f"fractions={self.fractions}: give validation and test shares >= 0 that leave some for train."
            )
        self.exclude_entry_points_of = exclude_entry_points_of
        self.root = Path(root) if root is not None else stdlib_dir()

    @property
    def scoring_available(self) -> bool:
        return False  # the library's functions come without tests

    def program(self, completion: str, record: Record) -> str:
        raise TaskDataError(
            f"{self.name} has no tests to run; it is a training corpus (score on task=humaneval)."
        )

    @cached_property
    def excluded(self) -> frozenset[str]:
        """Function names never used: the entry points of `exclude_entry_points_of`."""
        if self.exclude_entry_points_of is None:
            return frozenset()
        return entry_points(self.exclude_entry_points_of)

    @cached_property
    def records_by_split(self) -> dict[str, list[Record]]:
        """Every usable function of `root`, sorted by qualified name and placed in its split."""
        if not self.root.is_dir():
            raise TaskDataError(f"No directory {self.root} to read Python functions from (task.root).")
        records: list[Record] = []
        for path in sorted(self.root.rglob("*.py")):
            module = module_name(path, self.root, self.skipped_dirs)
            if module is None:
                continue
            try:
                with tokenize.open(path) as handle:  # the file's own encoding declaration
                    source = handle.read()
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
            records.extend(
                r
                for r in function_records(source, module, self.max_answer_chars, self.id_prefix)
                if r["entry_point"] not in self.excluded
            )
        records.sort(key=lambda r: r["task_id"])
        if self.deduplicate:
            records = deduplicated(records)
        if not records:
            raise TaskDataError(
                f'{self.name} found no usable function under {self.root} (module-level, public, with a """ '
                f"docstring and a body of at most max_answer_chars={self.max_answer_chars} characters); check "
                "task.root and task.max_answer_chars."
            )
        out: dict[str, list[Record]] = {s: [] for s in SPLITS}
        for record in records:
            qualified = record["task_id"].removeprefix(f"{self.id_prefix}/")
            out[split_of(qualified, self.fractions, self.name)].append(record)
        return out

    def _describe_source(self, split: str) -> str:
        if self.local:
            return super()._describe_source(split)
        shares = ", ".join(f"{name} {share:g}" for name, share in self.fractions.items())
        return f"the {split} share of the functions under {self.root}, by hash of their names: {shares}"

    def _load_source(self, split: str) -> datasets.Dataset:
        if self.local:
            return super()._load_source(split)
        return datasets.Dataset.from_list(self.records_by_split[split])
