"""The fit-start caches are keyed by digests of every weight they depend on: a model retrained into the same directory
(same path, new weights) or a target whose body changed misses the cache; unchanged models reuse it."""

from __future__ import annotations

import pytest
import torch
from test_acceptance_head import head_setup  # noqa: F401  (a module-scoped fixture: rollouts of a tiny pair)
from test_distill_module import tiny_lm
from test_selection_reference import _count_calls, _datamodule

from specdistill.data.target_cache import CachedTarget, build_target_cache, model_identity
from specdistill.losses import ForwardKL
from specdistill.selection.reference import cached_reference_scores

SAME_PATH = "/runs/distill/export"  # what `_name_or_path` says for every model retrained into one directory


def _at_same_path(model):
    model.config._name_or_path = SAME_PATH
    return model


def _retrained(model):
    """`model` after more training, saved to the same directory: every weight moved a little, same path."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    return model


def _models(vocab: int):
    return _at_same_path(tiny_lm(2, vocab=vocab)), _at_same_path(tiny_lm(3, hidden=16, vocab=vocab))


def test_a_reference_retrained_into_the_same_directory_does_not_reuse_stale_scores(tmp_path):
    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target, reference = _models(vocab)
    first = cached_reference_scores(tmp_path, target, reference, datamodule, ForwardKL(), vocab)
    retrained = _retrained(_at_same_path(tiny_lm(3, hidden=16, vocab=vocab)))
    calls = _count_calls(retrained)
    again = cached_reference_scores(tmp_path, target, retrained, datamodule, ForwardKL(), vocab)
    assert calls[0] == 3 and again != first  # rescored (3 scoring batches), new values


def test_a_target_retrained_into_the_same_directory_invalidates_the_reference_scores(tmp_path):
    datamodule = _datamodule()
    vocab = len(datamodule.tokenizer)
    target, reference = _models(vocab)
    first = cached_reference_scores(tmp_path, target, reference, datamodule, ForwardKL(), vocab)
    calls = _count_calls(reference)
    again = cached_reference_scores(tmp_path, _retrained(target), reference, datamodule, ForwardKL(), vocab)
    assert calls[0] == 3 and again != first


def test_a_target_whose_body_changed_misses_the_target_cache(tmp_path):
    """Same config and output layer, one body weight changed: another identity, so the cache is refused."""
    datamodule = _datamodule()
    tokenizer, vocab = datamodule.tokenizer, len(datamodule.tokenizer)
    target = _at_same_path(tiny_lm(2, vocab=vocab))
    build_target_cache(tmp_path, target, tokenizer, datamodule, vocab, m=8, splits=("train",))
    changed = _at_same_path(tiny_lm(2, vocab=vocab))
    with torch.no_grad():
        changed.gpt_neox.layers[0].mlp.dense_h_to_4h.weight[0, 0] += 1.0
    assert torch.equal(changed.get_output_embeddings().weight, target.get_output_embeddings().weight)
    with pytest.raises(ValueError, match="another target model than this run uses"):
        CachedTarget.load(
            tmp_path, model_identity(changed), tokenizer, datamodule, vocab, m=8, splits=("train",)
        )


def test_unchanged_models_reuse_both_caches_without_a_forward_pass(tmp_path):
    """The fit-start trigger with freshly loaded but identical models: both caches are read, nothing runs."""
    from specdistill.caches import FitStart, prepare_caches
    from specdistill.data.target_cache import CacheOnceTarget
    from specdistill.models.frozen import Frozen
    from specdistill.selection.reference import ScoreOnceReference

    counts, rows = [], []
    for _run in range(2):  # two runs: a fresh datamodule each (the scores become a column of its train split)
        datamodule = _datamodule()
        tokenizer, vocab = datamodule.tokenizer, len(datamodule.tokenizer)
        target, reference = _models(vocab)
        counts.append((_count_calls(target), _count_calls(reference)))
        frozen = Frozen(target)
        cached = CacheOnceTarget(frozen, tmp_path / "target_cache", tokenizer, datamodule, vocab, m=8)
        scores = ScoreOnceReference(
            reference, ForwardKL(), vocab, tmp_path / "scores", datamodule, target=frozen
        )
        prepare_caches(FitStart(trainer=None), [cached, None, scores])  # None: a module without a reference
        assert cached.ready and scores.ready
        rows.append(datamodule.tokenized("train")["ref_divergence"])
    (target_calls, reference_calls), (target_again, reference_again) = counts
    assert target_calls[0] == 4 + 3 and reference_calls[0] == 3  # target cache (3 + 1 batches) and scoring
    assert target_again[0] == 0 and reference_again[0] == 0 and rows[1] == rows[0]


def test_weights_digest_sees_every_weight_and_buffer_to_the_bit():
    from specdistill.caches import weights_digest

    model = tiny_lm(2)
    digest = weights_digest(model)
    assert digest == weights_digest(tiny_lm(2)) and len(digest) == 64
    for change in (
        lambda m: (
            m.gpt_neox.layers[1].attention.dense.weight.view(-1)[7].add_(2**-20)
        ),  # one low bit of the body
        lambda m: m.register_buffer("extra", torch.zeros(1)),  # a buffer counts
        lambda m: m.to(torch.bfloat16),  # the dtype counts
    ):
        other = tiny_lm(2)
        with torch.no_grad():
            change(other)
        assert weights_digest(other) != digest
    renamed = torch.nn.Sequential(torch.nn.Linear(2, 2))
    named = torch.nn.ModuleDict({"a": renamed[0]})
    assert weights_digest(renamed) != weights_digest(named)  # same bytes, another name


def test_weights_digest_refuses_zero3_partitioned_weights():
    from specdistill.caches import weights_digest

    model = torch.nn.Linear(3, 2)
    model.weight.ds_id = 0  # how DeepSpeed marks a ZeRO-3 parameter (each rank holds a slice)
    with pytest.raises(ValueError, match="before the model is placed"):
        weights_digest(model)


def test_a_hidden_cache_of_a_retrained_draft_is_rebuilt_and_an_unchanged_one_reused(
    head_setup,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    import copy

    from specdistill.head_data import build_hidden_cache

    draft, root = head_setup
    built = []
    for model in (copy.deepcopy(draft), copy.deepcopy(draft), _retrained(copy.deepcopy(draft))):
        calls = _count_calls(model)
        cache = build_hidden_cache(model, root / "rollouts", tmp_path / "cache", batch_size=6, shard_size=12,
                                   dtype="float32")  # fmt: skip
        built.append((calls[0], cache.with_format(None)["hidden"]))
    (first_calls, first), (same_calls, same), (retrained_calls, retrained) = built
    assert first_calls == 2 and same_calls == 0 and same == first  # 12 rollouts in batches of 6; then reused
    assert retrained_calls == 2 and retrained != first  # same path and config, new weights: rebuilt


def test_a_draft_retrained_into_the_same_path_recomputes_the_hidden_cache_at_fit_start(
    head_setup,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    """The stage's path: `HiddenCache` built by `AcceptanceHeadModule`'s `prepare_caches` at fit start, into the
    same directory for each run; the same draft reuses it, a draft retrained into the same path rebuilds it."""
    import copy
    from functools import partial

    import lightning as L

    from specdistill.head_data import HiddenCache, RolloutDataModule
    from specdistill.models.acceptance_head import AcceptanceHead
    from specdistill.modules.acceptance_head import AcceptanceHeadModule

    draft, root = head_setup
    built = []
    for model in (copy.deepcopy(draft), copy.deepcopy(draft), _retrained(copy.deepcopy(draft))):
        calls = _count_calls(_at_same_path(model))
        cache = HiddenCache(model, root / "rollouts", tmp_path / "cache", batch_size=6, shard_size=12,
                            dtype="float32")  # fmt: skip
        module = AcceptanceHeadModule(AcceptanceHead(16, 1), None, partial(torch.optim.SGD, lr=0.1),
                                      cache_hidden_states=True, hidden_cache=cache)  # fmt: skip
        data = RolloutDataModule(str(root / "rollouts"), batch_size=4, hidden_cache=cache)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(module, datamodule=data)
        built.append((calls[0], cache.dataset.with_format(None)["hidden"]))
    (first_calls, first), (same_calls, same), (retrained_calls, retrained) = built
    assert first_calls == 2 and same_calls == 0 and same == first
    assert retrained_calls == 2 and retrained != first


def test_an_interrupted_hidden_cache_resumes_at_its_first_unfinished_shard(
    head_setup,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    """12 rollouts in 3 shards of 4 (2 batches each): a build that dies in shard 2 keeps shards 0 and 1 (written
    atomically, its key recorded as under way), and the next build with the same key runs only shard 2's batches,
    ending with the cache of an uninterrupted build; a build with another key starts over."""
    import copy

    from specdistill.head_data import build_hidden_cache

    draft, root = head_setup

    def build(model, path):
        return build_hidden_cache(model, root / "rollouts", path, batch_size=2, shard_size=4, dtype="float32")

    expected = build(copy.deepcopy(draft), tmp_path / "whole").with_format(None).to_dict()
    dying = copy.deepcopy(draft)
    calls = _count_calls(dying)

    def die_in_shard_2(*_):
        if calls[0] == 5:  # the first batch of shard 2
            raise KeyboardInterrupt

    dying.base_model.register_forward_hook(die_in_shard_2)
    with pytest.raises(KeyboardInterrupt):
        build(dying, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir()) == ["shard_00000", "shard_00001"]
    resumed = copy.deepcopy(draft)
    calls = _count_calls(resumed)
    assert build(resumed, tmp_path / "cache").with_format(None).to_dict() == expected
    assert calls[0] == 2  # shard 2 only
    retrained = _retrained(copy.deepcopy(draft))
    calls = _count_calls(retrained)
    build(retrained, tmp_path / "cache")
    assert calls[0] == 6  # another key: every shard again
