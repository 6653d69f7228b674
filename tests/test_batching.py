"""Global batches split over simulated world sizes, step counts that match the sampler and Lightning, and AdaSPEC's
compute matching: exactly the baseline's optimizer steps on 1, 2 and 8 ranks (specdistill/utils/batching.py)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose
from torch.utils.data import DataLoader

from specdistill.data.sampler import WindowedDataset, WindowedSampler
from specdistill.stages.adaspec import compute_matched, matched_steps
from specdistill.stages.datamodules import stage_batch_plan
from specdistill.stages.settings import build_settings
from specdistill.stages.trainer import trainer_config
from specdistill.utils.batching import (
    BatchPlan,
    batch_plan,
    matched_max_steps,
    optimizer_steps_per_epoch,
    world_size,
)
from tests.helpers import hydra_conf

CONF = Path(__file__).resolve().parents[1] / "conf"
GSM8K_TRAIN = 7273  # GSM8K's 7473 training problems less the 200 held out for validation


@pytest.fixture
def hydra_ctx():
    with hydra_conf():
        yield


@pytest.mark.parametrize(("world", "accumulate"), [(1, 8), (2, 4), (8, 1)])
def test_the_authors_global_batch_keeps_their_micro_batch_on_any_world_size(world, accumulate):
    assert batch_plan(16, world, micro_batch_size=2) == BatchPlan(16, world, 2, accumulate)


def test_without_a_micro_batch_each_device_runs_its_share_at_once():
    assert batch_plan(16, 2) == BatchPlan(16, 2, 8, 1)
    assert batch_plan(16, 2, accumulate_grad_batches=4) == BatchPlan(16, 2, 2, 4)


def test_a_global_batch_the_world_size_cannot_divide_is_refused():
    with pytest.raises(ValueError, match="cannot be split over 3 devices.*multiple of 3"):
        batch_plan(16, 3, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro-batches of 4 do not divide"):
        batch_plan(16, 8, micro_batch_size=4)
    with pytest.raises(ValueError, match="accumulate_grad_batches=2 disagrees"):
        batch_plan(16, 1, micro_batch_size=2, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="does not divide"):
        batch_plan(16, 1, accumulate_grad_batches=3)


def test_world_size_is_devices_times_nodes():
    assert world_size({"accelerator": "gpu", "devices": 8, "num_nodes": 2}) == 16
    assert world_size({"accelerator": "gpu", "devices": "0,1,2", "num_nodes": 1}) == 3
    assert world_size({"accelerator": "cpu", "devices": "auto"}) == 1
    assert world_size({"accelerator": "gpu", "devices": [0, 1]}) == 2


def sampler_steps(num_examples: int, plan: BatchPlan) -> int:
    """Optimizer steps of one epoch as the real sampler shards it and Lightning steps (the last window steps too)."""
    counts = set()
    for rank in range(plan.world_size):
        sampler = WindowedSampler([1] * num_examples, plan.micro_batch_size, plan.accumulate_grad_batches,
                                  num_replicas=plan.world_size, rank=rank)  # fmt: skip
        micro_batches = math.ceil(len(list(sampler)) / plan.micro_batch_size)
        counts.add(math.ceil(micro_batches / plan.accumulate_grad_batches))
    assert len(counts) == 1, "every rank must step the same number of times"
    return counts.pop()


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("num_examples", [GSM8K_TRAIN, 1000, 37])
def test_steps_per_epoch_is_what_the_sampler_gives(num_examples, world):
    for plan in (batch_plan(16, world, 2), batch_plan(40, world, 5), batch_plan(8, world, 1)):
        assert optimizer_steps_per_epoch(num_examples, plan) == sampler_steps(num_examples, plan)


class Steps(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - batch["window_answer_tokens"].float().mean()).pow(2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_steps_per_epoch_is_what_lightning_steps():
    plan = batch_plan(12, 1, micro_batch_size=2)  # 6 micro-batches per step; 37 examples: 19 micro-batches
    sampler = WindowedSampler([1] * 37, plan.micro_batch_size, plan.accumulate_grad_batches, shuffle=False)
    data = DataLoader(WindowedDataset([{"x": 0}] * 37), batch_size=plan.micro_batch_size, sampler=sampler)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, accumulate_grad_batches=plan.accumulate_grad_batches, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Steps(), data)
    assert trainer.global_step == 2 * optimizer_steps_per_epoch(37, plan) == 8


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("models", ["pythia_31m_to_1.4b", "codegen_350m_to_phi2"])
@pytest.mark.parametrize("experiment", ["adaspec_3epoch", "adaspec_optimal"])
def test_adaspec_preset_trains_exactly_its_baselines_optimizer_steps(hydra_ctx, experiment, models, world):
    """The baseline is distillation at the distill stage's batch plan for the AdaSPEC draft's stated epochs (the
    distill run itself in the 3-epoch regime); k = 0.4 gives global batch 40 (5 per device) and 7.5 of its epochs."""
    overrides = [f"experiment={experiment}", f"models={models}", "task=gsm8k", f"trainer.devices={world}"]
    cfg = compose("train", overrides=overrides)
    distill_cfg = trainer_config(cfg, "distill")
    distill_plan = stage_batch_plan(cfg.distill, distill_cfg)
    epochs = trainer_config(cfg, "adaspec").max_epochs
    if experiment == "adaspec_3epoch":
        assert epochs == distill_cfg.max_epochs == 3
    baseline_steps = epochs * optimizer_steps_per_epoch(GSM8K_TRAIN, distill_plan)

    settings, adaspec_cfg, baseline = compute_matched(
        build_settings(cfg, "adaspec"), trainer_config(cfg, "adaspec")
    )
    plan = stage_batch_plan(settings, adaspec_cfg)
    matched_steps(baseline, GSM8K_TRAIN, adaspec_cfg)
    assert baseline.plan == distill_plan and baseline.epochs == epochs
    assert (plan.global_batch_size, plan.micro_batch_size, plan.world_size) == (40, 5, world)
    assert adaspec_cfg.max_steps == baseline_steps and adaspec_cfg.max_epochs == -1
    # whole epochs (ceil(epochs / k)) would overshoot: 8 epochs of batch 40 for 7.5 epochs of the baseline
    whole_epochs = math.ceil(epochs / 0.4) * sampler_steps(GSM8K_TRAIN, plan)
    assert whole_epochs >= baseline_steps
    if experiment == "adaspec_3epoch":
        assert whole_epochs / baseline_steps == pytest.approx(8 / 7.5, abs=0.01)


def test_matched_steps_keep_a_stated_step_cap():
    """The tiny pair's tuning states max_steps itself; compute matching leaves it (and scales the epochs as before)."""
    plan = batch_plan(16, 1)
    from omegaconf import OmegaConf

    from specdistill.stages.adaspec import Baseline

    trainer_cfg = OmegaConf.create({"max_steps": 300, "max_epochs": 3})
    matched_steps(Baseline(plan, 1), 4000, trainer_cfg)
    assert trainer_cfg.max_steps == 300 and trainer_cfg.max_epochs == 3
    assert matched_max_steps(4000, plan, 1) == 250
