"""The `specdistill-train` console script (and `python train.py` in a checkout): Hydra composes the packaged
`conf/` (`specdistill/conf`), runs the selected stage, returns the metric a sweeper optimises, and always closes the
logger so that one failed job does not break a sweep.

    specdistill-train                                   # the embedded default pipeline on CPU, from any directory
    specdistill-train stage=sft task=gsm8k models=pythia_31m_to_1.4b trainer=gpu
    specdistill-train -m stage=adaspec adaspec.reference=<distill_run>/export adaspec.k=0.2,0.4,0.8

Runs write under `./outputs` of the working directory (or `$PROJECT_ROOT/outputs`); `conf/local/` of a checkout,
or `hydra.searchpath=[file:///my/conf]`, adds your own config groups.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.utils.extras import require

log = logging.getLogger(__name__)

# the packaged configs (a link to the repository's conf/ in a checkout)
CONF_DIR = Path(__file__).resolve().parent / "conf"


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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
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


def check_launcher_extras(argv: list[str]) -> None:
    """The submitit launchers need the `slurm` extra: say so before Hydra fails to find the plugin."""
    if any(arg.startswith("hydra/launcher=") for arg in argv):
        require(
            "hydra_plugins.hydra_submitit_launcher", "hydra/launcher=slurm or local (submitit)", extra="slurm"
        )


def train() -> None:
    """Console script entry point."""
    check_launcher_extras(sys.argv[1:])
    main()
