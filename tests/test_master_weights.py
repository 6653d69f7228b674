"""fp32 master weights: every trained role holds float32 parameters under every trainer preset (frozen roles keep the
pair's bf16), a precision that would train 16-bit parameters is refused unless pure_bf16 names it, and one AdamW
step at lr 1e-5 moves every weight that receives a gradient (specdistill/models/precision.py)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose
from hydra.utils import instantiate
from omegaconf import open_dict

from specdistill.models import ModelSpec, load_model
from specdistill.models.precision import MasterWeightsCheck, check_training_precision, trainable_spec
from specdistill.modules import SFTModule
from specdistill.stages import adaspec, distill, sft
from specdistill.stages.model_loading import load_models, model_spec
from specdistill.stages.trainer import build_trainer, trainer_config
from tests.helpers import TINY, hydra_conf
from tests.test_distill_module import loader, make_batches, make_examples

CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = ["cpu", "gpu", "ddp", "deepspeed_zero2", "deepspeed_zero3"]
STAGES = {"sft": sft, "distill": distill, "adaspec": adaspec}
# the real pairs' dtype (conf/models/*.yaml) on the tiny pair's architecture
BF16_PAIR = [*TINY, "+models.target.dtype=bfloat16", "+models.draft.dtype=bfloat16"]


@pytest.fixture(autouse=True)
def hydra_ctx():
    with hydra_conf():
        yield


def test_every_real_pair_loads_bf16_which_only_frozen_roles_keep():
    for pair in [
        "pythia_31m_to_1.4b",
        "codegen_350m_to_phi2",
        "llama2_chat_7b_to_70b",
        "qwen2.5_0.5b_to_32b",
    ]:
        cfg = compose("train", overrides=[f"models={pair}"])
        assert cfg.models.target.dtype == cfg.models.draft.dtype == "bfloat16"
        assert trainable_spec(model_spec(cfg.models.draft)).dtype == "float32"


# ids avoid a bare "gpu", which the conftest would read as the gpu marker
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"trainer={p}")
@pytest.mark.parametrize("stage", list(STAGES))
def test_the_trained_role_holds_fp32_under_every_trainer_preset(stage, preset):
    cfg = compose("train", overrides=[f"stage={stage}", f"trainer={preset}", *BF16_PAIR])
    trainer_cfg = trainer_config(cfg, stage)
    # every preset trains under a precision that keeps fp32 weights (mixed: autocast; DeepSpeed: fp32 partitions)
    assert trainer_cfg.precision in ("32-true", "bf16-mixed")
    check_training_precision(trainer_cfg.precision, cfg.pure_bf16)
    specs = {"target": model_spec(cfg.models.target), "draft": model_spec(cfg.models.draft)}
    _, models, _ = load_models(cfg, specs, trainable=STAGES[stage].TRAINED_ROLES)
    for role, model in models.items():
        expected = torch.float32 if role in STAGES[stage].TRAINED_ROLES else torch.bfloat16
        assert {p.dtype for p in model.parameters()} == {expected}, (stage, preset, role)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"trainer={p}")
def test_the_acceptance_head_is_fp32_under_every_trainer_preset(preset):
    cfg = compose("train", overrides=["stage=acceptance_head", f"trainer={preset}", *BF16_PAIR])
    check_training_precision(trainer_config(cfg, "acceptance_head").precision, cfg.pure_bf16)
    head = instantiate(cfg.acceptance_head.model, hidden_size=16)
    assert {p.dtype for p in head.parameters()} == {torch.float32}


def test_pure_bf16_by_name_loads_the_trained_role_in_bf16():
    cfg = compose("train", overrides=["stage=distill", "pure_bf16=true", *BF16_PAIR])
    _, models, _ = load_models(cfg, {"draft": model_spec(cfg.models.draft)}, trainable=("draft",))
    assert {p.dtype for p in models["draft"].parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_a_precision_that_trains_16_bit_parameters_is_refused_unless_named(precision, tmp_path):
    with pytest.raises(ValueError, match="pure_bf16=true"):
        check_training_precision(precision, pure_bf16=False)
    check_training_precision(precision, pure_bf16=True)
    cfg = compose("train", overrides=["stage=distill", f"trainer.precision={precision}", *TINY])
    with open_dict(cfg):
        cfg.logger = None
    with pytest.raises(ValueError, match="16 bits"):
        build_trainer(cfg, "distill", tmp_path, trainer_config(cfg, "distill"))


def bf16_initialised_lm() -> torch.nn.Module:
    """A GPT-NeoX built in bf16 (as a real pair's checkpoint loads), then through `trainable_spec` as a stage does."""
    config = {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "vocab_size": 64}  # fmt: skip
    bf16 = load_model(ModelSpec(config=config, dtype="bfloat16", seed=3))
    fp32 = load_model(trainable_spec(ModelSpec(config=config, dtype="bfloat16", seed=3)))
    with torch.no_grad():  # the same (bf16-representable) starting weights, held in fp32
        for master, weight in zip(fp32.parameters(), bf16.parameters(), strict=True):
            master.copy_(weight.float())
    return fp32


def one_step(model: torch.nn.Module, precision: str, pure_bf16: bool = False) -> tuple[dict, dict, dict]:
    """One AdamW step at lr 1e-5 through a real Trainer; returns the weights before, after, and where grads are."""
    module = SFTModule(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-5, weight_decay=0.0))
    batches = make_batches(make_examples(4), batch_size=4, accumulate=1)
    probe = copy.deepcopy(module)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        probe.training_step(batches[0], 0).backward()
    gets_grad = {n: p.grad is not None and p.grad.ne(0) for n, p in probe.named_parameters()}
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[MasterWeightsCheck(pure_bf16)],
    )  # fmt: skip
    trainer.fit(module, loader(batches))
    after = {n: p.detach() for n, p in module.named_parameters()}
    return before, after, gets_grad


@pytest.mark.parametrize("preset", ["cpu", "gpu"], ids=lambda p: f"trainer={p}")
def test_one_adamw_step_at_lr_1e5_moves_every_weight_that_gets_a_gradient(preset):
    """The gpu preset's bf16-mixed runs on CPU here (bf16 autocast over the fp32 master weights)."""
    precision = compose("train", overrides=[f"trainer={preset}"]).trainer.precision
    before, after, gets_grad = one_step(bf16_initialised_lm(), precision)
    assert all(mask.any() for mask in gets_grad.values())
    for name, mask in gets_grad.items():
        moved = after[name] != before[name]
        assert moved[mask].all(), f"{name}: {int((~moved[mask]).sum())} weights with a gradient did not move"


def test_bf16_weights_lose_most_lr_1e5_updates_and_are_stopped_without_pure_bf16():
    """Why fp32 masters: the same step on bf16 parameters leaves most weights where they were."""
    model = bf16_initialised_lm().to(torch.bfloat16)
    with pytest.raises(ValueError, match="not float32"):
        one_step(copy.deepcopy(model), "32-true")
    before, after, gets_grad = one_step(model, "32-true", pure_bf16=True)
    moved = sum(int((after[n] != before[n])[m].sum()) for n, m in gets_grad.items())
    total = sum(int(m.sum()) for m in gets_grad.values())
    assert moved < 0.5 * total, f"{moved} of {total} bf16 weights moved"
