"""Reference-score providers (online frozen reference, cached column) and the score cache on disk."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_gloo_ranks
from test_distill_module import VOCAB, make_batches, make_examples, tiny_lm
from test_target_cache import _cache_contents
from test_target_cache import _datamodule as _cache_datamodule

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.data.datamodule import TaskDataModule
from specdistill.data.target_cache import build_target_cache
from specdistill.losses import ForwardKL, ReverseKL, forward_kl
from specdistill.selection.reference import CachedReferenceScores, OnlineReference, cached_reference_scores
from specdistill.selection.scoring import pad_scores, score_batch
from specdistill.tasks.arith import Arith
from tests.threads import one_torch_thread


def _rows(model, batch, mask) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[:, :-1, :VOCAB][mask]


def test_online_reference_scores_the_divergence_to_the_target_rows_without_grad():
    reference, target = tiny_lm(3, hidden=16), tiny_lm(2)
    batch = make_batches(make_examples(4), 4, 1)[0]
    mask = batch["labels"][:, 1:] != -100
    target_rows = _rows(target, batch, mask).detach()
    provider = OnlineReference(reference, ForwardKL(), VOCAB)
    scores = provider.score(batch, mask, target_rows)
    with torch.no_grad():
        expected = forward_kl(target_rows, _rows(reference, batch, mask))
    assert scores.shape == (int(mask.sum()),) and not scores.requires_grad
    torch.testing.assert_close(scores, expected)
    assert provider.model is reference and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


def test_cached_provider_reads_the_column_at_answer_positions():
    target, reference = tiny_lm(2), tiny_lm(3, hidden=16)
    batch = make_batches(make_examples(4), 4, 1)[0]
    mask = batch["labels"][:, 1:] != -100
    column = score_batch(target, reference, batch, ForwardKL(), VOCAB)
    assert column.shape == mask.shape and torch.all(column[~mask] == 0)
    target_rows = _rows(target, batch, mask).detach()
    cached = CachedReferenceScores().score({**batch, "ref_divergence": column}, mask, target_rows)
    online = OnlineReference(reference, ForwardKL(), VOCAB).score(batch, mask, target_rows)
    assert cached.dtype == torch.float32
    torch.testing.assert_close(cached, online)


def _datamodule() -> TaskDataModule:
    task = Arith(sizes={"train": 12, "validation": 4, "test": 4})
    return TaskDataModule(task, arith_tokenizer(), max_length=96, batch_size=4, eval_batch_size=5)


def _count_calls(model) -> list[int]:
    """Forward passes of the model's body (scoring runs the body and projects answer rows itself)."""
    calls = [0]
    model.base_model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_cached_reference_scores_are_computed_once_saved_and_reloaded(tmp_path):
    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target, reference = tiny_lm(2, vocab=vocab), tiny_lm(3, hidden=16, vocab=vocab)
    calls = _count_calls(reference)
    path = tmp_path / "reference_scores"
    rows = cached_reference_scores(path, target, reference, datamodule, ForwardKL(), vocab)
    train = datamodule.tokenized("train")
    assert len(rows) == len(train) and calls[0] == 3  # 12 examples in scoring batches of 5
    assert [len(r) for r in rows] == [len(ids) - 1 for ids in train["input_ids"]]
    assert json.loads((path / "specdistill_scores.json").read_text())["fingerprint"] == train._fingerprint
    # the rows are the per-position divergences of one scoring batch
    batch = next(iter(datamodule.scoring_dataloader("train")))
    column = score_batch(target, reference, batch, ForwardKL(), vocab)
    torch.testing.assert_close(pad_scores(rows[:5], column.shape[1]), column)

    calls[0] = 0
    again = cached_reference_scores(path, target, reference, datamodule, ForwardKL(), vocab)
    assert calls[0] == 0 and again == rows and isinstance(again, list) and isinstance(again[0], list)
    datamodule.attach_column("train", "ref_divergence", again)  # what the stage does with them
    assert "ref_divergence" in datamodule.tokenized("train").column_names

    # another divergence is another score: recomputed, not silently reused
    changed = cached_reference_scores(path, target, reference, datamodule, ReverseKL(), vocab)
    assert calls[0] == 3 and changed != rows


@pytest.mark.parametrize("column", [None, torch.zeros(4, 3)])
def test_cached_provider_refuses_a_missing_or_misshapen_column(column):
    batch = make_batches(make_examples(4), 4, 1)[0]
    mask = batch["labels"][:, 1:] != -100
    if column is not None:
        batch["ref_divergence"] = column
    with pytest.raises(ValueError, match="ref_divergence"):
        CachedReferenceScores().score(batch, mask, torch.zeros(int(mask.sum()), VOCAB))


_WORKER = """
import json
import torch, torch.distributed as dist
from helpers import join_gloo
from test_distill_module import tiny_lm
from test_selection_reference import _count_calls, _datamodule
from test_target_cache import _datamodule as _cache_datamodule
from specdistill.data.target_cache import build_target_cache
from specdistill.losses import ForwardKL
from specdistill.selection.reference import cached_reference_scores
rank, (scores_path, cache_path), out = join_gloo()
torch.set_num_threads(1)  # as the test process: the same reductions, so the same values to the bit
datamodule = _datamodule()
vocab = len(datamodule.tokenizer)
target, reference = tiny_lm(2, vocab=vocab), tiny_lm(3, hidden=16, vocab=vocab)
calls = _count_calls(reference)
rows = cached_reference_scores(scores_path, target, reference, datamodule, ForwardKL(), vocab)
target_calls = _count_calls(target)
build_target_cache(cache_path, target, datamodule.tokenizer, _cache_datamodule(), vocab, m=8)
dist.destroy_process_group()
json.dump({"rows": rows, "calls": calls[0], "target_calls": target_calls[0]}, open(out, "w"))
"""


@pytest.mark.slow  # two fresh Python processes importing torch: seconds, more on a loaded machine
def test_ranks_share_the_fit_start_passes_and_write_one_set_of_scores_and_one_target_cache(tmp_path):
    """Two gloo ranks split the batches of both offline passes and end with the single-process results, saved once:
    the reference scores (3 batches: 2 forwards each) and the cached target distributions (train 3 batches and
    validation 1: 2 + 1 forwards each, instead of 4; each rank writes its part, rank 0 merges)."""
    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target, reference = tiny_lm(2, vocab=vocab), tiny_lm(3, hidden=16, vocab=vocab)
    expected = cached_reference_scores(tmp_path / "single", target, reference, datamodule, ForwardKL(), vocab)
    with one_torch_thread():
        build_target_cache(
            tmp_path / "single_cache", target, datamodule.tokenizer, _cache_datamodule(), vocab, m=8
        )
    path, cache = tmp_path / "shared", tmp_path / "shared_cache"
    results = run_gloo_ranks(_WORKER, str(path), str(cache), out_dir=tmp_path)
    assert [r["calls"] for r in results] == [2, 2]  # batches 0, 2 and 1 (+ 1 repeated to keep step)
    for result in results:
        torch.testing.assert_close(result["rows"], expected)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("shared")) == [
        "shared",
        "shared_cache",
    ]  # fmt: skip  (score shards merged, removed)
    assert (path / "specdistill_scores.json").is_file()
    assert [r["target_calls"] for r in results] == [3, 3]
    assert _cache_contents(cache) == _cache_contents(tmp_path / "single_cache")
    assert sorted(p.name for p in cache.iterdir()) == [
        "specdistill_target_cache.json",
        "train",
        "validation",
    ]  # fmt: skip  (the parts were merged and removed)
