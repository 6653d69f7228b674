"""Generated answers for a task's prompts: the files the `target_answers` step writes and `task.answers_from` reads.

A folder holds one `<split>.jsonl` per split; each line is `{"prompt": <key>, "answer": <text>}`, where the key is
`prompt_key(task.prompt(record))` (the prompt text itself, or the chat messages as canonical JSON). Keying by prompt,
not by row number, keeps the answers right when a split's records are reordered or filtered; a record whose prompt
has no line is skipped on load (and counted). Answers are the generated text without special tokens (no EOS):
tokenisation appends EOS as it does for the dataset's answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from specdistill.errors import DataError, InputFileError
from specdistill.utils.atomic import atomic_write_text


def prompt_key(prompt: str | list[dict[str, str]]) -> str:
    """The key of a rendered prompt: the text itself, or chat messages as sorted-key JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def answers_file(folder: str | Path, split: str) -> Path:
    return Path(folder) / f"{split}.jsonl"


def write_answers(folder: str | Path, split: str, pairs: Iterable[tuple[str, str]]) -> Path:
    """Write `(prompt key, answer)` pairs as `<folder>/<split>.jsonl`, whole or not at all."""
    path = answers_file(folder, split)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": key, "answer": answer}, ensure_ascii=False) for key, answer in pairs]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


def read_answers(folder: str | Path, split: str) -> Mapping[str, str]:
    """`{prompt key: answer}` of one split; errors name the file and the line.

    Raises:
        InputFileError: the folder has no file for `split`.
        DataError: a line is not `{"prompt": str, "answer": str}`, or a prompt has two answers.
    """
    path = answers_file(folder, split)
    if not path.is_file():
        present = sorted(p.stem for p in Path(folder).glob("*.jsonl")) if Path(folder).is_dir() else []
        raise InputFileError(
            f"No generated answers for split {split!r}: {path} does not exist (the folder has {present or 'none'}). "
            "Generate them with the target_answers step (target_answers.splits), or set task.answers_from=null."
        )
    answers: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}, line {number}: not JSON ({error.msg}).") from None
        if not (
            isinstance(row, dict)
            and isinstance(row.get("prompt"), str)
            and isinstance(row.get("answer"), str)
        ):
            raise DataError(
                f'{path}, line {number}: expected {{"prompt": str, "answer": str}}, got {line[:120]!r}.'
            )
        if row["prompt"] in answers:
            raise DataError(
                f"{path}, line {number}: a second answer for the same prompt; keep one line per prompt."
            )
        answers[row["prompt"]] = row["answer"]
    return answers
