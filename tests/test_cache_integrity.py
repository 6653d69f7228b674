"""Caches are verified on reuse (`specdistill.caches.store`): the key file, written last, records each table's sha256,
size and rows; a table changed or truncated on disk since is recomputed with a warning naming its folder (or refused
in one line, `InputFileError`, where the cache is opened by path only and cannot be recomputed), never reused silently
nor ended in a raw pyarrow error; an untouched cache is reused, each table hashed once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
from test_acceptance_head import head_setup  # noqa: F401  (a module-scoped fixture: rollouts of a tiny pair)
from test_distill_module import tiny_lm
from test_selection_reference import _count_calls

from specdistill.caches import store
from specdistill.caches.fit_start import FitStart
from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.data.datamodule import TaskDataModule
from specdistill.data.target_cache import (
    KEY_FILE,
    CachedTarget,
    CacheOnceTarget,
    build_target_cache,
    model_identity,
)
from specdistill.data.target_states import KEY_FILE as STATES_KEY_FILE
from specdistill.data.target_states import CacheOnceTargetStates
from specdistill.errors import EX_NOINPUT, InputFileError
from specdistill.tasks.arith import Arith
from tests.test_eagle3 import tiny_target
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

LAYERS = (1, 2, 3)
SPLITS = ("train", "validation")


@pytest.fixture
def store_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """`caplog` recording the cache store's info and warnings."""
    caplog.set_level(logging.INFO, logger=store.__name__)
    return caplog


def _datamodule() -> TaskDataModule:
    task = Arith(sizes={"train": 6, "validation": 3, "test": 2})
    data = TaskDataModule(task, arith_tokenizer(), max_length=96, batch_size=3, eval_batch_size=4)
    data.setup("fit")
    return data


def _states(target, data: TaskDataModule, path: Path) -> CacheOnceTargetStates:
    """The target-state cache at `path`, prepared (built or reused) as at fit start."""
    vocab = len(data.tokenizer)
    cache = CacheOnceTargetStates(target, path, data.tokenizer, data, vocab, LAYERS, dtype="bfloat16")
    cache.prepare(FitStart(trainer=None))
    return cache


def _top_m(target, data: TaskDataModule, path: Path) -> CacheOnceTarget:
    """The top-m target cache at `path`, prepared (built or reused) as at fit start."""
    vocab = len(data.tokenizer)
    cache = CacheOnceTarget(target, path, data.tokenizer, data, vocab, m=8)
    cache.prepare(FitStart(trainer=None))
    return cache


def _arrow_file(table: Path) -> Path:
    return max(table.glob("*.arrow"), key=lambda p: p.stat().st_size)


def _change_bytes(table: Path) -> None:
    """Flip 64 bytes in the middle of the table's largest arrow file: same size, other values (it still loads)."""
    file = _arrow_file(table)
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    file.write_bytes(bytes(data))


def _truncate(table: Path) -> None:
    """Cut the table's largest arrow file to half its size (a copy or a disk that failed half-way)."""
    file = _arrow_file(table)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _tables(splits: dict[str, datasets.Dataset]) -> dict[str, dict[str, list]]:
    return {name: table.with_format(None).to_dict() for name, table in splits.items()}


def _one_warning(store_log, folder: Path) -> str:
    """The one warning the store logged, checked to name `folder`."""
    warnings = [r.getMessage() for r in store_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(folder) in warnings[0]
    return warnings[0]


def test_a_state_table_changed_on_disk_is_recomputed_with_a_warning_naming_it(tmp_path, store_log):
    data = _datamodule()
    target = tiny_target("llama", vocab=len(data.tokenizer))
    _states(target, data, tmp_path / "states")
    fresh = _states(target, data, tmp_path / "fresh")
    _change_bytes(tmp_path / "states" / "train")
    calls = _count_calls(target)
    store_log.clear()
    again = _states(target, data, tmp_path / "states")
    assert "changed on disk" in _one_warning(store_log, tmp_path / "states" / "train")
    assert calls[0] == 2 + 1  # recomputed: 2 train batches of 3 and 1 validation batch
    assert _tables(again._splits) == _tables(fresh._splits)
    calls[0] = 0
    _states(target, data, tmp_path / "states")  # the rebuilt cache is intact again: reused
    assert calls[0] == 0


def test_a_truncated_table_is_recomputed_instead_of_a_raw_pyarrow_error(tmp_path, store_log):
    data = _datamodule()
    target = tiny_lm(2, vocab=len(data.tokenizer))
    _top_m(target, data, tmp_path / "cache")
    _truncate(tmp_path / "cache" / "validation")
    calls = _count_calls(target)
    store_log.clear()
    again = _top_m(target, data, tmp_path / "cache")
    assert "truncated" in _one_warning(store_log, tmp_path / "cache" / "validation") and calls[0] == 2 + 1
    fresh = build_target_cache(tmp_path / "fresh", target, data.tokenizer, data, len(data.tokenizer), m=8)
    assert _tables(again._splits) == _tables(fresh._splits)


@pytest.mark.parametrize(
    ("damage", "found"),
    [(_change_bytes, "changed on disk"), (_truncate, "truncated"), (None, "records no digest")],
    ids=["changed", "truncated", "no-digest"],
)
def test_a_damaged_cache_opened_by_path_only_is_refused_in_one_line(tmp_path, damage, found):
    """`CachedTarget.load` has no target to recompute the cache with: one line naming the folder, what was
    expected and found, and the fix, exit code 66 as every missing or unreadable input."""
    data = _datamodule()
    vocab = len(data.tokenizer)
    target = tiny_lm(2, vocab=vocab)
    build_target_cache(tmp_path, target, data.tokenizer, data, vocab, m=8)
    if damage is None:  # a cache written before the contents were recorded
        key = json.loads((tmp_path / KEY_FILE).read_text())
        del key["contents"]
        (tmp_path / KEY_FILE).write_text(json.dumps(key))
    else:
        damage(tmp_path / "train")
    with pytest.raises(InputFileError) as refused:
        CachedTarget.load(tmp_path, model_identity(target), data.tokenizer, data, vocab, m=8)
    message = str(refused.value)
    assert found in message and "build_target_cache" in message and "\n" not in message
    assert str(tmp_path / ("train" if damage else KEY_FILE)) in message
    assert refused.value.exit_code == EX_NOINPUT


def test_an_untouched_cache_is_reused_and_each_table_hashed_once(tmp_path, store_log, monkeypatch):
    data = _datamodule()
    target = tiny_target("llama", vocab=len(data.tokenizer))
    _states(target, data, tmp_path / "states")
    key_file = tmp_path / "states" / STATES_KEY_FILE
    contents = json.loads(key_file.read_text())["contents"]
    assert sorted(contents) == list(SPLITS) and all(
        len(c["sha256"]) == 64 and c["bytes"] > 0 for c in contents.values()
    )
    assert [contents[s]["rows"] for s in SPLITS] == [6, 3]
    hashed: list[Path] = []
    digest = store.table_digest
    monkeypatch.setattr(store, "table_digest", lambda folder: hashed.append(folder) or digest(folder))
    calls, stamp = _count_calls(target), key_file.stat().st_mtime_ns
    store_log.clear()
    reused = _states(target, data, tmp_path / "states")
    assert calls[0] == 0 and key_file.stat().st_mtime_ns == stamp  # reused, not recomputed
    assert sorted(hashed) == [tmp_path / "states" / s for s in SPLITS]
    assert "contents verified" in store_log.text and "WARNING" not in store_log.text
    assert reused.ready


@pytest.mark.parametrize("key_text", ["no-contents", "not-json"])
def test_a_cache_without_a_readable_digest_is_recomputed_with_a_warning(tmp_path, store_log, key_text):
    """A key file written before the contents were recorded (or damaged): the tables cannot be vouched for, so
    they are recomputed (the target is at hand) and the new key records them."""
    data = _datamodule()
    target = tiny_target("llama", vocab=len(data.tokenizer))
    _states(target, data, tmp_path / "states")
    key_file = tmp_path / "states" / STATES_KEY_FILE
    key = json.loads(key_file.read_text())
    del key["contents"]
    key_file.write_text(json.dumps(key) if key_text == "no-contents" else "{ not json")
    calls = _count_calls(target)
    store_log.clear()
    _states(target, data, tmp_path / "states")
    warnings = [r.getMessage() for r in store_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(key_file) in warnings[0] and calls[0] == 3
    assert "contents" in json.loads(key_file.read_text())


def test_the_hidden_cache_refuses_a_damaged_shard_by_path_and_recomputes_one_of_an_interrupted_build(
    head_setup,  # noqa: F811  (the imported fixture)
    tmp_path,
    store_log,
):
    """`load_hidden_cache` (a cache given by path, no draft): one line naming the shard; a resumed build (the key
    recorded as being built) recomputes a finished shard that no longer loads instead of failing on it."""
    import shutil

    from specdistill.caches.store import BUILDING_PREFIX
    from specdistill.head_data import build_hidden_cache, load_hidden_cache
    from specdistill.head_data.hidden_cache import KEY_FILE as HIDDEN_KEY_FILE

    draft, root = head_setup
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    expected = load_hidden_cache(cache).to_dict()
    shard = cache / "shards" / "shard_00000"
    _truncate(shard)
    with pytest.raises(
        InputFileError, match=r"shard_00000 holds \d+ bytes but \d+ were written \(truncated"
    ) as refused:
        load_hidden_cache(cache)
    assert "\n" not in str(refused.value) and "build_hidden_cache" in str(refused.value)
    # an interrupted build of the same key: the key is recorded as being built, not as finished
    (cache / HIDDEN_KEY_FILE).rename(cache / f"{BUILDING_PREFIX}{HIDDEN_KEY_FILE}")
    calls = _count_calls(draft)
    store_log.clear()
    rebuilt = build_hidden_cache(draft, root / "rollouts", cache, mixing_ratio=0.15, seed=0, batch_size=6,
                                 shard_size=12, dtype="float32")  # fmt: skip
    assert calls[0] == 2 and str(shard) in store_log.text  # the shard's 12 rollouts in batches of 6, warned
    assert rebuilt.to_dict() == expected and load_hidden_cache(cache).to_dict() == expected
