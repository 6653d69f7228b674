"""Cached target states for EAGLE-3 training (`specdistill.data.target_states`): the cached target pass is the live
one, training from it runs no target body, refusals, and train.py's distill -> adaspec handing the cache on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdistill.caches.fit_start import FitStart
from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.data.datamodule import TaskDataModule
from specdistill.data.target_source import LiveTarget, StatesCache, TopMCache, source_from_setting
from specdistill.data.target_states import KEY_FILE, CacheOnceTargetStates, check_dtype, states_bytes
from specdistill.drafts import target_pass
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.standalone import Standalone
from specdistill.errors import ConfigError
from specdistill.losses.answers import answer_mask
from specdistill.tasks.arith import Arith
from tests.helpers import TINY, check_ok, run_train, stage_overrides
from tests.test_eagle3 import tiny_target
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

LAYERS = (1, 2, 3)


def _datamodule() -> TaskDataModule:
    task = Arith(sizes={"train": 6, "validation": 3, "test": 2})
    return TaskDataModule(task, arith_tokenizer(), max_length=96, batch_size=3, eval_batch_size=4)


def _cached(tmp_path: Path, dtype: str):
    data = _datamodule()
    data.setup("fit")
    vocab = len(data.tokenizer)
    target = tiny_target("llama", vocab=vocab)
    cache = CacheOnceTargetStates(
        target, tmp_path / "states", data.tokenizer, data, vocab, LAYERS, dtype=dtype
    )
    cache.prepare(FitStart(trainer=None))
    return data, target, vocab, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cached_target_pass_is_the_live_one(tmp_path, dtype):
    data, target, vocab, cache = _cached(tmp_path, dtype)
    tolerance = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bfloat16": {"rtol": 2e-2, "atol": 2e-2}}[dtype]
    batch = next(iter(data.train_dataloader()))
    keep = answer_mask(batch["labels"])
    with torch.no_grad():
        live = target_pass(target, batch, keep, vocab, LAYERS)
    cached = cache.target_pass(batch, keep, "train")
    torch.testing.assert_close(cached.rows.hidden, live.rows.hidden, **tolerance)
    real = batch["attention_mask"].bool()
    for layer in LAYERS:
        torch.testing.assert_close(
            cached.hidden_states[layer][real], live.hidden_states[layer][real], **tolerance
        )
        assert torch.all(cached.hidden_states[layer][~real] == 0)
    if dtype != "float32":
        return  # rounded states may move a near-tie target argmax in or out of the draft vocabulary
    # and the head's training rows from it (what distill and adaspec train on)
    kind = Eagle3(draft_vocab_size=16, aux_layer_ids=list(LAYERS), ttt_steps=2)
    head = kind.build(target, vocab)
    with torch.no_grad():
        a = kind.training_rows(head, batch, keep, cached, vocab)
        b = kind.training_rows(head, batch, keep, live, vocab)
    assert torch.equal(a.answer_index, b.answer_index)
    torch.testing.assert_close(a.draft.hidden, b.draft.hidden, **tolerance)
    torch.testing.assert_close(a.target.values, b.target.values, **tolerance)


def test_the_cache_is_keyed_sized_and_reused(tmp_path):
    data, target, vocab, cache = _cached(tmp_path, "bfloat16")
    key = json.loads((tmp_path / "states" / KEY_FILE).read_text())
    assert (
        key["layers"] == list(LAYERS)
        and key["dtype"] == "bfloat16"
        and set(key["data"]) == {"train", "validation"}
    )
    again = CacheOnceTargetStates(target, tmp_path / "states", data.tokenizer, data, vocab, LAYERS)
    stamp = (tmp_path / "states" / KEY_FILE).stat().st_mtime_ns
    again.prepare(FitStart(trainer=None))
    assert (tmp_path / "states" / KEY_FILE).stat().st_mtime_ns == stamp  # reused, not rebuilt
    hidden = target.config.hidden_size
    assert states_bytes(300, 64, 576, 3) == 2 * (300 * 3 * 576 + 64 * 576)
    batch = next(iter(data.val_dataloader()))
    keep = answer_mask(batch["labels"])
    assert again.target_pass(batch, keep, "validation").hidden_states[1].shape[-1] == hidden
    other = tiny_target("llama", vocab=vocab, seed=5)  # another target: a new key, rebuilt
    rebuilt = CacheOnceTargetStates(other, tmp_path / "states", data.tokenizer, data, vocab, LAYERS)
    rebuilt.prepare(FitStart(trainer=None))
    assert json.loads((tmp_path / "states" / KEY_FILE).read_text())["model"] != key["model"]


def test_a_target_cache_that_does_not_fit_the_kind_or_names_no_source_is_refused():
    """`<stage>.target_cache`: one key for the live target, a top-m cache or a states cache, held against the draft
    kind in one place (`TargetSource.check_kind`), which validation and `DistillModule` both call."""
    from tests.test_user_errors import validated

    assert source_from_setting("distill", None) == LiveTarget("distill")
    assert source_from_setting("distill", 0) == LiveTarget("distill")
    assert source_from_setting("distill", 8) == TopMCache("distill", m=8)
    assert source_from_setting("adaspec", "float16") == StatesCache("adaspec", dtype="float16")
    for value in ("float64", True, -1, 2.5, "64"):
        with pytest.raises(ConfigError, match=r"distill\.target_cache=.*positive integer m"):
            source_from_setting("distill", value)
    with pytest.raises(ConfigError, match="reads none: set distill.target_cache=<m>"):
        StatesCache("distill").check_kind(Standalone())
    with pytest.raises(ConfigError, match="reads the target's hidden states, which that cache does not hold"):
        TopMCache("adaspec", m=8).check_kind(Eagle3(draft_vocab_size=64))
    StatesCache("distill").check_kind(Eagle3(draft_vocab_size=64))  # what it is for
    TopMCache("distill", m=8).check_kind(Standalone())
    with pytest.raises(ValueError, match="target_cache='float64'"):
        check_dtype("float64")
    with pytest.raises(ConfigError, match="reads none: set distill.target_cache=<m>"):
        validated("stage=distill", "distill.target_cache=bfloat16")
    with pytest.raises(ConfigError, match="which that cache does not hold"):
        validated("stage=distill", "draft=eagle3", "draft.draft_vocab_size=64", "distill.target_cache=8")
    with pytest.raises(ConfigError, match="positive integer m"):
        validated("stage=distill", "distill.target_cache=float64")


@pytest.mark.slow
def test_train_py_trains_eagle3_heads_from_the_cached_states_and_hands_them_to_adaspec(tmp_path: Path):
    """distill builds the cache and trains from it; adaspec, given the folder, reuses it (no second target pass);
    without a kind that reads target states the setting is refused."""
    pair = [*TINY, "models.target.config.num_hidden_layers=4"]
    head = ["draft=eagle3", "draft.draft_vocab_size=128", "draft.ttt_steps=2", "draft.aux_layer_ids=[0,1,3]"]
    distill = tmp_path / "distill"
    proc = run_train(["stage=distill", *pair, *head, "distill.target_cache=bfloat16",
                      *stage_overrides("distill", 2), f"hydra.run.dir={distill}"])  # fmt: skip
    check_ok(proc)
    result = json.loads((distill / "result.json").read_text())
    states = Path(result["target_cache"])
    assert states == distill / "target_cache" and (states / KEY_FILE).is_file()
    assert 0 < result["val/expected_acceptance"] <= 1
    adaspec = tmp_path / "adaspec"
    proc = run_train(["stage=adaspec", *pair, *head, f"adaspec.reference={distill / 'export'}",
                      "adaspec.cached_scores=false", "adaspec.target_cache=bfloat16",
                      f"adaspec.target_cache_dir={states}", *stage_overrides("adaspec", 2),
                      f"hydra.run.dir={adaspec}"])  # fmt: skip
    check_ok(proc)
    assert "reusing the cache in" in proc.stdout + proc.stderr
    assert not (adaspec / "target_cache").exists()
    refused = run_train(["stage=distill", *pair, "distill.target_cache=bfloat16", *stage_overrides("distill", 1),
                         f"hydra.run.dir={tmp_path / 'refused'}"])  # fmt: skip
    assert (
        refused.returncode != 0
        and "reads none: set distill.target_cache=<m>" in refused.stderr + refused.stdout
    )
