"""Placing frozen models (target, reference) on the training devices, sharded under DeepSpeed ZeRO-3.

Lightning only moves and shards the LightningModule's registered submodules; specdistill keeps frozen models out of
them (they must never reach the optimizer or a checkpoint), so the module places them itself, once the strategy has
set up the process group, from its `setup`/`on_fit_start` hooks:

    self._frozen.models["target"] = prepare_frozen(self._frozen.models["target"], self.trainer)

Under ZeRO-3 a frozen 70B target would not fit replicated on every GPU, so it is wrapped as its own DeepSpeed engine
with ZeRO-3 partitioning and no optimizer, as trl does for frozen reference/teacher models (`trl.models.utils.
prepare_deepspeed`): parameters are all-gathered layer by layer during the forward pass. Every rank must then call
the frozen model the same number of times per step (ZeRO-3 gathers are collective), which the distillation step does.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from specdistill.utils.strategy import deepspeed_stage, require_deepspeed

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_deepspeed_engine(model: Any) -> bool:
    """Whether `model` is a `deepspeed.DeepSpeedEngine` (what `prepare_frozen` returns under ZeRO-3).

    An isinstance check against DeepSpeed's engine class, looked up among the imported modules rather than
    imported: an engine exists only once DeepSpeed is imported, and a run without it never pays for the import.
    """
    engine_class = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
    return engine_class is not None and isinstance(model, engine_class)


def _hidden_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def frozen_zero3_config(
    model: torch.nn.Module, precision: str, offload_parameters: bool = False
) -> dict[str, Any]:
    """The DeepSpeed config of a frozen, ZeRO-3-partitioned model used for inference only.

    Bucket sizes follow trl's `prepare_deepspeed`: scaled to the hidden size so that small layer weights stay
    resident (`stage3_param_persistence_threshold`) and prefetches cover about one layer.
    """
    zero: dict[str, Any] = {"stage": 3}
    hidden = _hidden_size(model)
    if hidden is not None:
        zero.update(
            reduce_bucket_size=hidden * hidden,
            stage3_param_persistence_threshold=10 * hidden,
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
        )
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        # DeepSpeed requires a batch size even without an optimizer; it only affects its throughput logging.
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": precision.startswith("bf16")},
        "fp16": {"enabled": precision.startswith("16")},
        "steps_per_print": 2**31 - 1,
    }


def prepare_frozen(model: Any, trainer: Any, dtype: torch.dtype | str | None = None) -> Any:
    """Place a frozen model for the trainer's strategy and return what the module should call.

    Args:
        model: a frozen Hugging Face model (`eval()`, no grad), or an engine this function returned before.
        trainer: the Lightning Trainer, after its strategy set up the devices (call from `setup`/`on_fit_start`).
        dtype: cast the weights (e.g. `bfloat16` to halve a frozen target's memory); None keeps the model's dtype.
            Under ZeRO-3 the DeepSpeed config decides (bf16 when the trainer's precision is bf16).

    Returns:
        Under DeepSpeed ZeRO-3, a `DeepSpeedEngine` wrapping the model with partitioned parameters and no optimizer
        (called like the model); otherwise the model itself, moved to the strategy's root device.
    """
    if is_deepspeed_engine(model):
        return model
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"prepare_frozen got a {type(model).__name__} with trainable parameters; freeze it first "
            "(specdistill.models.loading.freeze) so it cannot reach the optimizer"
        )
    model.eval()
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    strategy = trainer.strategy
    if deepspeed_stage(strategy) == 3:
        require_deepspeed()
        import deepspeed

        zero = strategy.config["zero_optimization"]
        config = frozen_zero3_config(
            model,
            str(trainer.precision),
            offload_parameters="offload_param" in zero and bool(zero["offload_param"]),
        )
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        log.info("frozen %s sharded with ZeRO-3 (no optimizer)", type(model).__name__)
        return engine
    if dtype is None:
        return model.to(strategy.root_device)
    return model.to(device=strategy.root_device, dtype=dtype)
