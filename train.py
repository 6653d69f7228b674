"""specdistill's Hydra entry point.

    python train.py                                   # the embedded default pipeline on CPU
    python train.py stage=sft task=gsm8k models=pythia_31m_to_1.4b trainer=gpu
    python train.py -m stage=adaspec adaspec.reference=<distill_run>/export adaspec.k=0.2,0.4,0.8

Compose `conf/train.yaml`, run the selected stage, return the metric a sweeper optimises, and always close the
logger so that one failed job does not break a sweep.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

import specdistill  # noqa: F401  (registers the config resolvers, e.g. ${derive_seed:...})

log = logging.getLogger(__name__)


def run_stage(cfg: DictConfig) -> dict:
    """Run the stage that `cfg.stage` names, in the Hydra run directory, and return its result dictionary."""
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return instantiate(cfg.stage.run)(cfg, out_dir=out_dir)
    finally:
        close_loggers()


def close_loggers() -> None:
    """Finish a W&B run if one is open (a crashed job must not leave a sweep's next job attached to it)."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_stage(cfg)
    metric = cfg.get("optimized_metric")
    if metric:
        value = result.get(metric) if isinstance(result, dict) else None
        if value is None:
            raise KeyError(f"optimized_metric={metric!r} is not in the stage result: {sorted(result)}")
        return float(value)
    return None


if __name__ == "__main__":
    main()
