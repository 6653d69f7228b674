"""fp32 master weights: what a stage trains is held in float32, frozen models may stay in 16 bits.

An AdamW step moves a weight by about `lr`; bf16 keeps 8 significant bits, so on a weight of ~0.02 a step of 1e-5
(2^-11 of it) rounds away: measured, 10 AdamW steps at lr 1e-5 changed 15% of bf16 weights drawn from N(0, 0.02).
The papers' authors load every model in fp32 and train under bf16 autocast (HF Trainer `--bf16`, DeepSpeed bf16 with
its fp32 optimizer partitions), so the optimizer always updates fp32 weights. specdistill does the same:

- the trainable role of a stage (the target under `sft`, the draft under `distill`/`adaspec`, the acceptance head)
  is loaded in float32 whatever `models.<role>.dtype` says (that dtype is the frozen and inference dtype);
- a trainer precision that would cast the trained parameters to 16 bits (`bf16-true`, `16-true`) is refused;
- under DeepSpeed (`bf16-mixed`) the module runs in bf16 and the ZeRO optimizer keeps the fp32 master partitions.

`pure_bf16=true` (root key, conf/train.yaml) asks for pure-bf16 training by name: trainable roles load in bfloat16 and
any precision is accepted.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import lightning as L
import torch

from specdistill.models.loading import ModelSpec

log = logging.getLogger(__name__)

# Lightning precisions that convert the module's parameters to 16 bits (the `-mixed` ones autocast, keeping fp32)
HALF_PARAMETER_PRECISIONS = ("bf16-true", "16-true")
PURE_BF16_HINT = "or ask for pure-bf16 training by name with pure_bf16=true (no fp32 master copy: small updates round away)"


def trainable_spec(spec: ModelSpec, pure_bf16: bool = False) -> ModelSpec:
    """The spec a trained role loads from: float32 master weights, or bfloat16 under `pure_bf16`."""
    return dataclasses.replace(spec, dtype="bfloat16" if pure_bf16 else "float32")


def check_training_precision(precision: Any, pure_bf16: bool = False) -> None:
    """Refuse a trainer precision that would train 16-bit parameters, unless `pure_bf16` asks for it.

    Raises:
        ValueError: `precision` is `bf16-true` or `16-true` and `pure_bf16` is false.
    """
    if str(precision) in HALF_PARAMETER_PRECISIONS and not pure_bf16:
        raise ValueError(
            f"trainer.precision={precision} casts the trained parameters to 16 bits, so the optimizer would update "
            "them without an fp32 master copy; use trainer.precision=bf16-mixed (fp32 weights, bf16 autocast), "
            + PURE_BF16_HINT
        )


def half_trainable_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters of `module` that are not float32."""
    return [name for name, p in module.named_parameters() if p.requires_grad and p.dtype != torch.float32]


class MasterWeightsCheck(L.Callback):
    """Stops a fit whose trainable parameters are not float32 when training starts (unless `pure_bf16`).

    Under DeepSpeed the strategy has cast the module to bf16 by then and its ZeRO optimizer holds the fp32 master
    partitions, so the check is the optimizer's instead: it must have fp32 partitions.
    """

    def __init__(self, pure_bf16: bool = False) -> None:
        self.pure_bf16 = pure_bf16

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.pure_bf16:
            return
        if _is_deepspeed(trainer):
            _check_deepspeed_master_weights(trainer)
            log.info("fp32 master weights: held by the DeepSpeed ZeRO optimizer")
            return
        half = half_trainable_parameters(pl_module)
        if half:
            raise ValueError(
                f"{len(half)} trainable parameters are not float32 (e.g. {half[:3]}): the optimizer would update "
                "16-bit weights. Load the trained role in float32 (specdistill.models.precision.trainable_spec) "
                "and train under trainer.precision=bf16-mixed, " + PURE_BF16_HINT
            )
        log.info("fp32 master weights: every trainable parameter is float32")


def _is_deepspeed(trainer: L.Trainer) -> bool:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(trainer.strategy, DeepSpeedStrategy)


def _check_deepspeed_master_weights(trainer: L.Trainer) -> None:
    """DeepSpeed's ZeRO optimizers (stages 1-3) keep fp32 partitions of every trained parameter."""
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    groups = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO 1/2
    if groups is None:
        groups = getattr(optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO 3
    if groups is None:
        groups = [
            p for group in optimizer.param_groups for p in group["params"]
        ]  # no ZeRO wrapper: plain fp32
    wrong = [t.dtype for t in groups if t.dtype != torch.float32]
    if wrong:
        raise ValueError(
            f"the DeepSpeed optimizer holds {len(wrong)} non-fp32 master partitions ({wrong[0]}); "
            "keep a ZeRO stage (trainer=deepspeed_zero2/3) with bf16-mixed, " + PURE_BF16_HINT
        )
