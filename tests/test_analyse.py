"""The token-level diagnostics: per-position margins and KL on hand-made logits (a draft vocabulary included), the
paper's directions, and `stage=analyse` on real tiny models (a draft equal to the target, a random one, an EAGLE-3
head) writing its summary, plots and result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose
from hydra.utils import instantiate
from omegaconf import open_dict

from specdistill.diagnostics import paper_direction, position_diagnostics, summarise_positions
from specdistill.diagnostics.positions import concatenate
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.errors import ConfigError
from specdistill.export.hf import export_pretrained
from specdistill.losses.divergence import forward_kl
from specdistill.models import load_model
from specdistill.stages import analyse
from tests.helpers import TINY, hydra_conf
from tests.test_eagle3 import AUX, tiny_target
from tests.test_eagle3_kind import _Data
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

NEG = -math.inf


def test_a_draft_equal_to_the_target_agrees_everywhere_with_zero_kl():
    logits = torch.randn(7, 13, generator=torch.Generator().manual_seed(0))
    out = position_diagnostics(logits, logits.clone())
    assert out.agree.all() and (out.margin > 0).all() and out.outside_support == 0 and not out.restricted
    assert torch.allclose(out.kl, torch.zeros(7), atol=1e-6)
    summary = summarise_positions(out)
    assert summary["agreement"] == 1.0 and summary["margins"]["positive_fraction"] == 1.0
    assert summary["margin_disagree"] is None and summary["positions"] == 7


def test_a_draft_vocabulary_is_compared_on_its_own_tokens():
    # the draft cannot propose token 3; row 0's target argmax (0) is inside, row 1's (3) outside
    draft = torch.tensor([[2.0, 1.0, 0.0, NEG], [0.0, 3.0, 1.0, NEG]])
    target = torch.tensor([[4.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 5.0]])
    out = position_diagnostics(draft, target)
    assert out.restricted and out.outside_support == 1
    # a margin only where the target's token can be drafted: row 0, which agrees (2 - 1)
    assert out.agree.tolist() == [True] and out.margin.tolist() == [1.0]
    # KL over the three draftable tokens, the target renormalised there (finite, unlike over all four)
    assert torch.allclose(out.kl, forward_kl(target[:, :3], draft[:, :3]))
    assert torch.isfinite(out.kl).all()


def test_a_draft_with_fewer_than_two_tokens_or_nan_logits_is_refused():
    with pytest.raises(ValueError, match="can propose 1 of 3 tokens"):
        position_diagnostics(torch.tensor([[0.0, NEG, NEG]]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="NaN"):
        position_diagnostics(torch.tensor([[0.0, math.nan, 1.0]]), torch.zeros(1, 3))


def test_batches_concatenate_in_order():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(4, 5, generator=gen)
    ta, tb = torch.randn(3, 5, generator=gen), torch.randn(4, 5, generator=gen)
    joined = concatenate([position_diagnostics(a, ta), position_diagnostics(b, tb)])
    whole = position_diagnostics(torch.cat([a, b]), torch.cat([ta, tb]))
    assert torch.equal(joined.kl, whole.kl) and torch.equal(joined.margin, whole.margin)


def test_paper_direction_reads_each_number_the_way_the_paper_reports():
    def summary(positive, mean_pos, mean_neg, kl):
        return {"margins": {"positive_fraction": positive, "mean_positive_margin": mean_pos,
                            "mean_negative_margin": mean_neg}, "kl": {"median": kl, "mean": kl}}  # fmt: skip

    better = paper_direction(summary(0.7, 3.0, -0.5, 0.1), summary(0.6, 2.0, -1.0, 0.2))
    assert all(better.values())
    worse = paper_direction(summary(0.5, 1.0, -2.0, 0.3), summary(0.6, 2.0, -1.0, 0.2))
    assert not any(worse.values())
    assert paper_direction(summary(0.5, 1.0, None, 0.3), summary(0.6, 2.0, -1.0, 0.2))[
        "mean_negative_margin_smaller"
    ] is None  # fmt: skip


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny Llama target, a random standalone draft and an untrained EAGLE-3 head on the target, all exported with
    the tiny pair's tokenizer; plus the composed `stage=analyse` config."""
    root = tmp_path_factory.mktemp("analyse")
    with hydra_conf():
        cfg = compose(
            "train", overrides=["stage=analyse", *TINY, "analyse.max_examples=6", "analyse.batch_size=4"]
        )
    tokenizer = instantiate(cfg.models.tokenizer)
    vocab = len(tokenizer)
    target = tiny_target("llama", vocab=vocab)
    target_dir = export_pretrained(target, tokenizer, root / "target")
    draft_dir = export_pretrained(
        load_model(instantiate(cfg.models.draft), vocab), tokenizer, root / "random"
    )
    kind = Eagle3(draft_vocab_size=vocab // 2, aux_layer_ids=list(AUX), ttt_steps=2)
    head = kind.build(target, vocab_size=vocab)
    labels = [[-100, *torch.randint(0, vocab, (200,), generator=torch.Generator().manual_seed(3)).tolist()]]
    kind.prepare(head, _Data(labels))
    head_dir = kind.export(head, tokenizer, root / "eagle3")
    with open_dict(cfg):
        cfg.models.target.pretrained_model_name_or_path = str(target_dir)
        cfg.models.target.config = None
    return cfg, {"same": str(target_dir), "random": str(draft_dir), "eagle3": str(head_dir)}


@pytest.mark.slow
def test_the_stage_writes_every_drafts_diagnostics_plots_and_result(exports, tmp_path: Path):
    cfg, drafts = exports
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.analyse.drafts = drafts
        cfg.analyse.baseline = "same"
    result = analyse.run(cfg, tmp_path)
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    same, random, eagle3 = (report["drafts"][name] for name in ("same", "random", "eagle3"))
    # every draft on the same answer positions of the first 6 validation examples
    assert same["positions"] == random["positions"] == eagle3["positions"] > 0
    # the target as its own draft: same positions, same logits (a shift between the two passes would break this)
    assert (
        same["agreement"] == 1.0 and same["kl"]["p90"] < 1e-5 and same["margins"]["positive_fraction"] == 1.0
    )
    assert random["kl"]["median"] > 1e-3 and random["agreement"] < 1.0
    assert eagle3["kl_over_draft_support"] and not random["kl_over_draft_support"]
    assert report["against_baseline"]["random"]["kl_median_lower"] is False
    assert set(report["against_baseline"]) == {"random", "eagle3"}
    for image in ("margins.png", "kl.png"):
        assert (tmp_path / image).stat().st_size > 10_000
    assert result["same/agreement"] == 1.0 and result["random/kl_median"] == random["kl"]["median"]
    assert json.loads((tmp_path / "result.json").read_text())["stage"] == "analyse"


def test_a_baseline_that_is_not_analysed_is_refused(exports, tmp_path: Path):
    cfg, drafts = exports
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.analyse.drafts = {"random": drafts["random"]}
        cfg.analyse.baseline = "distillspec"
    with pytest.raises(
        ConfigError, match=r"analyse.baseline='distillspec' is not among .*analyse.baseline=null"
    ):
        analyse.run(cfg, tmp_path)


def test_the_test_split_is_refused_by_the_settings(exports, tmp_path: Path):
    cfg, _ = exports
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.analyse.split = "test"
    with pytest.raises(ConfigError, match="analyse.split='test' is not one of validation, train"):
        analyse.run(cfg, tmp_path)
