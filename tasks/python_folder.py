"""`python_folder`: any folder of Python sources (a user's own code base) as a code task in HumanEval's shape.

A code draft serves the code its users write, so the most common corpus to train one on is their own repository.
The records are `stdlib_code`'s (tasks/stdlib_code.py): each module-level public function with a triple-double-quoted
docstring and a body, prompt = its signature and docstring, answer = its real body; read with `ast`, never imported
or run. Here:

* from `task.root`, which is required (`python train.py task=python_folder task.root=<folder>`);
* deduplicated: a function whose text, whitespace aside, an earlier one (by qualified name) has is dropped, so
  vendored copies and pasted helpers never sit in two splits;
* test suites (`test/`, `tests/`, `test_*.py`), build trees and virtual environments (`build/`, `dist/`, `venv/`,
  `env/`, `site-packages/`, hidden folders such as `.venv/` and `.git/`) and private modules are skipped;
* HumanEval's entry points are left out by default (conf/task/python_folder.yaml), so evaluating on HumanEval
  never meets a trained-on function.

Task ids are `python_folder/<module>.<function>`; splits by a hash of the qualified name, so a function keeps its
split as the code base grows. The answers are the folder's own bodies; `pipeline=pretrained` (or
`target_answers`) has the target write its own answers to these prompts, which is what a draft should learn.
"""

from __future__ import annotations

from specdistill.errors import ConfigError
from specdistill.tasks.stdlib_code import SKIPPED_DIRS, StdlibCode


class PythonFolder(StdlibCode):
    """The public documented functions of the Python files under `root` (see the module docstring).

    Args:
        root: the folder read (required).
        **kwargs: `StdlibCode`'s (`max_answer_chars`, `fractions`, `exclude_entry_points_of`, ...).
    """

    name = "python_folder"
    id_prefix = "python_folder"
    skipped_dirs = SKIPPED_DIRS | {"build", "dist", "venv", "env"}
    deduplicate = True

    def __init__(self, root: str | None = None, **kwargs) -> None:
        if root is None:
            raise ConfigError(
                "task=python_folder reads the Python sources of a folder: set task.root=<folder> (your "
                "repository's checkout, for instance)"
            )
        super().__init__(root=root, **kwargs)
