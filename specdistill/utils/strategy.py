"""Distributed strategies: DeepSpeed ZeRO presets, device checks before a Trainer is built, ZeRO checkpoint export.

The trainer presets in `conf/trainer/` build their strategy through `deepspeed_strategy` (DeepSpeed) or Lightning's
`DDPStrategy`; `check_devices` runs before the Trainer is built so a preset that asks for more GPUs or nodes than
the job has fails with a message naming the fix instead of a hang or a CUDA error deep inside Lightning.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specdistill.utils.atomic import atomic_directory
from specdistill.utils.extras import require

log = logging.getLogger(__name__)


def require_deepspeed() -> None:
    """Raise ImportError naming the install command when DeepSpeed is not importable."""
    require(
        "deepspeed",
        "trainer=deepspeed_zero2/deepspeed_zero3 (or pick trainer=ddp / trainer=gpu)",
        "deepspeed",
    )


def deepspeed_strategy(
    stage: int,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    allgather_bucket_size: int = 200_000_000,
    reduce_bucket_size: int = 200_000_000,
    zero_extra: Mapping[str, Any] | None = None,
    **kwargs: Any,
):
    """Build `lightning.pytorch.strategies.DeepSpeedStrategy` for ZeRO stage 1, 2 or 3.

    Args:
        stage: ZeRO stage: 2 partitions optimizer states and gradients, 3 also the parameters.
        offload_optimizer: keep optimizer states (and the fp32 master weights) in CPU memory (ZeRO-Offload).
        offload_parameters: keep parameters in CPU memory between uses; ZeRO-3 only.
        allgather_bucket_size: elements all-gathered at once (memory vs. communication trade-off).
        reduce_bucket_size: elements reduced at once.
        zero_extra: further `zero_optimization` keys that Lightning has no argument for (e.g.
            `stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`, `stage3_max_live_parameters`).
        **kwargs: any other `DeepSpeedStrategy` argument (`pin_memory`, `overlap_comm`, `sub_group_size`, ...).
    """
    require_deepspeed()
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed ZeRO stage must be 1, 2 or 3, got {stage}")
    if offload_parameters and stage != 3:
        raise ValueError(
            f"offload_parameters needs ZeRO stage 3 (parameters are only partitioned there), got stage {stage}; "
            "use trainer=deepspeed_zero3 or set trainer.strategy.offload_parameters=false"
        )
    if "config" in kwargs:
        raise ValueError(
            "deepspeed_strategy builds the DeepSpeed config from its arguments; pass extra zero_optimization keys "
            "through zero_extra instead of a whole config"
        )
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_parameters=offload_parameters,
        allgather_bucket_size=int(allgather_bucket_size),
        reduce_bucket_size=int(reduce_bucket_size),
        **kwargs,
    )
    if zero_extra:
        # Lightning copies nothing from here; the dict is read when the engine is built in `setup`.
        strategy.config["zero_optimization"].update({k: v for k, v in zero_extra.items()})
    return strategy


def deepspeed_stage(strategy: Any) -> int | None:
    """The ZeRO stage of a (Lightning) strategy, or None when it is not a DeepSpeed strategy."""
    from lightning.pytorch.strategies import DeepSpeedStrategy  # importable without DeepSpeed itself

    config = getattr(strategy, "config", None)
    if not isinstance(strategy, DeepSpeedStrategy) or not isinstance(config, Mapping):
        return None
    if "zero_optimization" not in config:
        return None
    return int(config["zero_optimization"].get("stage", 0))


def _requested_devices(devices: Any) -> int | None:
    """Devices per node a Trainer `devices` value asks for; None for "auto"/-1 (all visible ones)."""
    if devices in (None, "auto", -1, "-1"):
        return None
    if isinstance(devices, str):
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        return int(devices)
    if isinstance(devices, int):
        return devices
    return len(list(devices))


def _cluster_nodes() -> int | None:
    """Nodes of the current job as the launcher tells them, or None outside a multi-node launcher."""
    for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if os.environ.get(name):
            return int(os.environ[name])
    if os.environ.get("WORLD_SIZE") and os.environ.get("NODE_RANK") is not None:
        return None  # torchrun / another launcher: Lightning checks world size against it itself
    return 1


def check_devices(trainer_cfg: Mapping[str, Any]) -> None:
    """Check a trainer config against the machine before the Trainer is built.

    Raises:
        ValueError: the preset asks for GPUs on a machine without CUDA, more GPUs per node than there are, or more
            nodes than the job was given.
    """
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    devices = trainer_cfg.get("devices", "auto")
    num_nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    if accelerator in ("gpu", "cuda"):
        available = torch.cuda.device_count()
        if available == 0:
            raise ValueError(
                f"trainer.accelerator={accelerator} but torch.cuda.device_count() is 0 (no CUDA GPU visible, or a "
                "CPU-only torch build); run with trainer=cpu, or on a GPU node"
            )
        wanted = _requested_devices(devices)
        if wanted is not None and wanted > available:
            raise ValueError(
                f"trainer.devices={devices} asks for {wanted} GPUs per node but only {available} are visible "
                f"(torch.cuda.device_count()); set trainer.devices={available} (or auto), or request more GPUs "
                "(hydra.launcher.gpus_per_node=... on SLURM)"
            )
    if num_nodes > 1:
        nodes = _cluster_nodes()
        if nodes is not None and nodes != num_nodes:
            raise ValueError(
                f"trainer.num_nodes={num_nodes} but this job runs on {nodes} node(s); launch it with "
                f"hydra/launcher=slurm hydra.launcher.nodes={num_nodes} (or set trainer.num_nodes={nodes})"
            )


def deepspeed_checkpoint_to_hf(
    ckpt_dir: str | Path,
    module_factory: Callable[[], torch.nn.Module],
    out_dir: str | Path,
    model_attr: str = "draft",
    tokenizer: Any = None,
    metadata: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
    trust_unsigned: bool = False,
) -> Path:
    """Turn a DeepSpeed (ZeRO-2/3) checkpoint directory into the Hugging Face export of the trained model.

    DeepSpeed's `zero_to_fp32` unpickles the checkpoint (`torch.load(weights_only=False)`), so only a checkpoint
    signed with the expected run fingerprint is read (`specdistill.utils.run_dir.check_checkpoint`).

    Args:
        ckpt_dir: the checkpoint directory Lightning wrote (e.g. `<run_dir>/checkpoints/last.ckpt/`).
        module_factory: builds the LightningModule the checkpoint came from, with models on CPU (frozen models may
            be absent: they are not in the checkpoint).
        out_dir: where the safetensors export goes.
        model_attr: attribute of the module holding the trained Hugging Face model (`draft` for DistillModule,
            `model` for SFTModule).
        tokenizer: saved beside the weights when given.
        metadata: written to `specdistill.json` beside the weights.
        fingerprint: the run fingerprint the checkpoint must carry; default: the one in the `run_fingerprint.json`
            of the run folder holding it (`<run_dir>/checkpoints/<ckpt>`).
        trust_unsigned: convert a directory without a signature (written by DeepSpeed directly, not by a
            specdistill run): only for checkpoints you wrote yourself.

    Returns:
        `out_dir`.
    """
    require_deepspeed()
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"{ckpt_dir} is not a DeepSpeed checkpoint directory (a Lightning DeepSpeed checkpoint is a folder "
            "holding 'checkpoint/' and 'latest'); for a single-file checkpoint load its state_dict directly"
        )
    if not trust_unsigned:
        from specdistill.utils.run_dir import check_checkpoint, read_record

        if fingerprint is None:
            fingerprint = (read_record(ckpt_dir.parent.parent) or {}).get("fingerprint")
        check_checkpoint(ckpt_dir, fingerprint)
    with tempfile.TemporaryDirectory() as tmp:
        # Lightning's converter gathers the fp32 partitions of every rank into one file (rank-independent).
        state = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(Path(tmp) / "fp32.ckpt"))
    module = module_factory()
    missing, unexpected = module.load_state_dict(state["state_dict"], strict=False)
    if unexpected or missing:
        raise ValueError(
            f"the checkpoint at {ckpt_dir} does not match the module built by module_factory "
            f"(missing keys: {sorted(missing)[:5]}, unexpected keys: {sorted(unexpected)[:5]}); build the module "
            "from the same model config as the run that wrote the checkpoint"
        )
    model = getattr(module, model_attr, None)
    if model is None or not hasattr(model, "save_pretrained"):
        raise ValueError(f"{type(module).__name__}.{model_attr} is not a Hugging Face model; set model_attr")
    out = Path(out_dir)
    with atomic_directory(out) as tmp:  # the previous export or this one, never part of one
        if tokenizer is not None:
            from specdistill.export.hf import export_pretrained

            export_pretrained(model, tokenizer, tmp, dict(metadata) if metadata is not None else None)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
    return out


@contextmanager
def full_weights(model: torch.nn.Module, trainer: Any) -> Iterator[torch.nn.Module]:
    """Make a trained model's full weights readable, e.g. for `export_pretrained` after `fit`.

    Under ZeRO-3 each rank holds only a shard of every parameter; this all-gathers them for the duration of the
    block (a collective: every rank must enter it; let rank 0 write). Elsewhere it does nothing.

        with full_weights(module.draft, trainer):
            if trainer.is_global_zero:
                export_pretrained(module.draft, tokenizer, out_dir / "export")
        trainer.strategy.barrier()
    """
    if deepspeed_stage(trainer.strategy) != 3:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield model
