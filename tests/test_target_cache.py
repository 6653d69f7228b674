"""Cached target distributions: the sparse top-m form of the divergences, the offline cache, training from it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from test_distill_module import tiny_lm

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.data.datamodule import TaskDataModule
from specdistill.data.target_cache import CachedTarget, build_target_cache, model_identity
from specdistill.losses import JSD, TVD, ForwardKL, ReverseKL
from specdistill.losses.rows import LogitRows
from specdistill.losses.sparse import SparseRows, top_m
from specdistill.modules import DistillModule
from specdistill.tasks.arith import Arith

DIVERGENCES = [ForwardKL(), ReverseKL(), JSD(beta=0.3), TVD()]


def _logits(seed: int, n: int = 9, vocab: int = 23, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=repr)
def test_sparse_target_with_m_equal_to_v_is_the_exact_divergence(divergence):
    target, draft = _logits(0), _logits(1).requires_grad_(True)
    exact = divergence(target, draft)
    (exact_grad,) = torch.autograd.grad(exact.sum(), draft)
    sparse = SparseRows(*top_m(target, m=23))
    assert torch.all(sparse.tail_mass == 0)
    values = divergence.rows(sparse, LogitRows(draft))
    (grad,) = torch.autograd.grad(values.sum(), draft)
    torch.testing.assert_close(values, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, exact_grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=repr)
def test_sparse_target_with_a_tail_bounds_the_divergence_from_below(divergence):
    """m < V: the divergence of the bucketed distributions (m tokens + tail); below the exact one, close when peaked."""
    target, draft = _logits(0, scale=4.0), _logits(1, scale=4.0)
    exact = divergence(target, draft)
    for m in (1, 5, 12):
        sparse = divergence.rows(SparseRows(*top_m(target, m)), LogitRows(draft))
        assert torch.all(sparse <= exact + 1e-5) and torch.all(sparse >= -1e-6)
    close = divergence.rows(SparseRows(*top_m(target, 20)), LogitRows(draft))
    assert (close - exact).abs().max() < 0.05 * exact.abs().max()


def test_top_m_keeps_the_largest_tokens_and_the_tail_mass():
    logits = _logits(2, n=4, vocab=11)
    log_probs, ids, tail = top_m(logits, 3)
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(log_probs, full.topk(3, -1).values)
    torch.testing.assert_close(tail, 1 - log_probs.exp().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log_probs, full.gather(-1, ids))
    with pytest.raises(ValueError, match="m >= 1"):
        top_m(logits, 0)


def _datamodule(train: int = 12) -> TaskDataModule:
    task = Arith(sizes={"train": train, "validation": 4, "test": 4})
    return TaskDataModule(task, arith_tokenizer(), max_length=96, batch_size=4, eval_batch_size=5)


def _module(datamodule, target) -> DistillModule:
    vocab = len(datamodule.tokenizer)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    return DistillModule(
        tiny_lm(1, hidden=16, vocab=vocab), target, vocab, ForwardKL(chunk_size=7), optimizer
    )


def test_training_from_a_full_cache_equals_online_training_without_the_target(tmp_path):
    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target = tiny_lm(2, vocab=vocab)
    cache = build_target_cache(tmp_path / "cache", target, datamodule.tokenizer, datamodule, vocab, m=vocab)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "specdistill_target_cache.json", "train", "validation",
    ]  # fmt: skip
    online, cached = _module(datamodule, target), _module(datamodule, cache)
    with pytest.raises(RuntimeError, match="no target model"):
        cached.target  # noqa: B018
    for split, loader in (
        ("train", datamodule.scoring_dataloader("train")),
        ("val", datamodule.val_dataloader()),
    ):
        batch = next(iter(loader))
        if split == "train":
            batch["window_answer_tokens"] = (batch["labels"][:, 1:] != -100).sum()
            losses = [m.training_step(batch, 0) for m in (online, cached)]
            for loss in losses:
                loss.backward()
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(online.draft.named_parameters(), cached.draft.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        else:
            logged = []
            for module in (online, cached):
                logged.append({})
                module.log = lambda name, value, _out=logged[-1], **_: _out.__setitem__(
                    name, value
                )  # what is logged
                module.validation_step(batch, 0)
            assert logged[0].keys() == {"val/loss", "val/kl", "val/expected_acceptance"}
            for name in logged[0]:
                torch.testing.assert_close(logged[1][name], logged[0][name], rtol=1e-5, atol=1e-6)


def test_a_cache_from_another_model_tokenizer_or_dataset_is_refused(tmp_path):
    datamodule = _datamodule()
    tokenizer = datamodule.tokenizer
    vocab = len(tokenizer)
    target = tiny_lm(2, vocab=vocab)
    build_target_cache(tmp_path, target, tokenizer, datamodule, vocab, m=8, splits=("train",))
    same = CachedTarget.load(
        tmp_path, model_identity(target), tokenizer, datamodule, vocab, m=8, splits=("train",)
    )
    assert same.m == 8 and same.key["model"] == model_identity(target)

    identity = model_identity(target)

    def load(model=identity, tok=tokenizer, data=datamodule, m=8):
        return CachedTarget.load(tmp_path, model, tok, data, vocab, m=m, splits=("train",))

    with pytest.raises(ValueError, match="another target model than this run uses"):
        load(model=model_identity(tiny_lm(3, vocab=vocab)))
    with pytest.raises(ValueError, match="another tokenizer than"):
        load(tok=arith_tokenizer(vocab_size=300, train_size=200))
    with pytest.raises(ValueError, match=r"another dataset \(tokenised splits\) than"):
        load(data=_datamodule(train=13))
    with pytest.raises(ValueError, match="another m than"):
        load(m=4)
    with pytest.raises(ValueError, match="missing"):
        CachedTarget.load(tmp_path / "nothing", model_identity(target), tokenizer, datamodule, vocab)
    with pytest.raises(ValueError, match="no 'validation' split"):
        same.rows(next(iter(datamodule.val_dataloader())), torch.zeros(4, 3, dtype=torch.bool), "validation")


@pytest.mark.slow
def test_distill_and_adaspec_stages_train_from_one_shared_cache(tmp_path):
    """`<stage>.target_cache=m` with one `target_cache_dir`: the distill stage caches the target once (train and
    validation) and trains from it; the adaspec stage then finds the same key there and reuses the cache (no target
    pass, nothing written), so the target runs once for both."""
    from tests.helpers import TINY, check_ok, run_train, stage_overrides

    shared = tmp_path / "shared_cache"
    runs = {stage: tmp_path / stage for stage in ("distill", "adaspec")}
    check_ok(run_train(
        ["stage=distill", *TINY, *stage_overrides("distill", 2), "distill.target_cache=8",
         f"distill.target_cache_dir={shared}", f"hydra.run.dir={runs['distill']}"]
    ))  # fmt: skip
    key_file = shared / "specdistill_target_cache.json"
    key = json.loads(key_file.read_text())
    assert key["m"] == 8 and sorted(key["data"]) == ["train", "validation"]
    assert not (runs["distill"] / "target_cache").exists()
    assert (runs["distill"] / "export" / "model.safetensors").is_file()
    written = {p: p.stat().st_mtime_ns for p in shared.rglob("*") if p.is_file()}

    check_ok(run_train(
        ["stage=adaspec", *TINY, *stage_overrides("adaspec", 2), f"adaspec.reference={runs['distill'] / 'export'}",
         "adaspec.target_cache=8", f"adaspec.target_cache_dir={shared}", f"hydra.run.dir={runs['adaspec']}"]
    ))  # fmt: skip
    assert "reusing the cache in" in (runs["adaspec"] / "train.log").read_text()
    assert {p: p.stat().st_mtime_ns for p in shared.rglob("*") if p.is_file()} == written
    assert not (runs["adaspec"] / "target_cache").exists()
    for run in runs.values():
        result = json.loads((run / "result.json").read_text())
        assert 0 < result["val/expected_acceptance"] <= 1


def _cache_contents(path) -> dict[str, dict[str, list]]:
    """Every split of the cache at `path`, column by column (float32 values as Python floats)."""
    import datasets

    key = json.loads((Path(path) / "specdistill_target_cache.json").read_text())
    return {split: datasets.load_from_disk(str(Path(path) / split)).to_dict() for split in key["data"]}


def test_the_cache_is_built_at_fit_start_where_the_trainer_placed_the_target_and_reused(tmp_path):
    """`CacheOnceTarget` (the adaspec stage's `target_cache=<m>`): the first fit builds the cache exactly as
    `build_target_cache` does and releases the target; a second run with the same inputs reuses it, with no target
    forward."""
    import lightning as L

    from specdistill.data.target_cache import CacheOnceTarget
    from tests.test_selection_reference import _count_calls

    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target = tiny_lm(2, vocab=vocab)
    build_target_cache(tmp_path / "direct", target, datamodule.tokenizer, datamodule, vocab, m=8)
    calls = _count_calls(target)
    for run, expected_calls in ((1, 4), (2, 4)):  # 3 train + 1 validation batch, once
        lazy = CacheOnceTarget(target, tmp_path / "cache", datamodule.tokenizer, datamodule, vocab, m=8)
        if run == 1:
            with pytest.raises(RuntimeError, match="built at fit start"):
                lazy.rows(
                    next(iter(datamodule.val_dataloader())), torch.zeros(4, 3, dtype=torch.bool), "train"
                )
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(_module(datamodule, lazy), datamodule=datamodule)
        assert calls[0] == expected_calls and lazy._frozen is None  # built (or reused) and released
    assert _cache_contents(tmp_path / "cache") == _cache_contents(tmp_path / "direct")
