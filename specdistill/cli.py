"""The `specdistill-train` console script (and `python train.py` in a checkout): Hydra composes the packaged
`conf/` (`specdistill/conf`), checks the settings and the run folder before anything is loaded or written, records
the run (`.hydra/`, `run_fingerprint.json`), runs the selected stage, returns the metric a sweeper optimises, and always closes the logger
so that one failed job does not break a sweep. A mistake the user can fix (`specdistill.errors`) ends in one or two
lines and the error's exit code; `HYDRA_FULL_ERROR=1` shows the traceback.

    specdistill-train                                   # the embedded default pipeline on CPU, from any directory
    specdistill-train stage=sft task=gsm8k models=pythia_31m_to_1.4b trainer=gpu
    specdistill-train -m stage=adaspec adaspec.reference=<distill_run>/export adaspec.k=0.2,0.4,0.8

Runs write under `./outputs` of the working directory (or `$PROJECT_ROOT/outputs`); `conf/local/` of a checkout,
or `hydra.searchpath=[file:///my/conf]`, adds your own config groups.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
)

from specdistill.errors import ConfigError, UserError
from specdistill.utils.console import quiet_console
from specdistill.utils.extras import require
from specdistill.utils.fingerprint import run_fingerprint
from specdistill.utils.run_dir import check_stage_dir, is_rank_zero, write_record
from specdistill.validation import validate_config

log = logging.getLogger(__name__)

# the packaged configs (a link to the repository's conf/ in a checkout)
CONF_DIR = Path(__file__).resolve().parent / "conf"


def run_stage(cfg: DictConfig) -> dict:
    """Run the stage that `cfg.stage` names, in the Hydra run directory, and return its result dictionary."""
    out_dir = Path(cfg.paths.output_dir)
    # nothing is written into the folder before it and the settings are checked (the pipeline checks each step)
    record = None
    if cfg.stage.get("check"):
        instantiate(cfg.stage.check)(cfg, out_dir)
    else:
        record = run_fingerprint(cfg)
        check_stage_dir(out_dir, record)
    validate_config(cfg)
    if is_rank_zero():
        out_dir.mkdir(parents=True, exist_ok=True)
        save_hydra_files(cfg, out_dir)
        if record is not None:
            write_record(out_dir, record)
    try:
        return instantiate(cfg.stage.run)(cfg, out_dir=out_dir)
    finally:
        close_loggers()


def save_hydra_files(cfg: DictConfig, out_dir: Path) -> None:
    """`.hydra/{config,hydra,overrides}.yaml`, as Hydra writes them (with `hydra.output_subdir` null it does not)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    folder = out_dir / ".hydra"
    folder.mkdir(exist_ok=True)
    # a resumed run keeps what each earlier launch recorded (e.g. another trainer preset or max_steps)
    earlier = [
        folder / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml") if (folder / name).is_file()
    ]
    if earlier:
        kept = folder / "earlier" / time.strftime("%Y%m%d-%H%M%S", time.localtime(earlier[0].stat().st_mtime))
        kept.mkdir(parents=True, exist_ok=True)
        for path in earlier:
            path.replace(kept / path.name)
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), folder / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, folder / "overrides.yaml")


def close_loggers() -> None:
    """Finish a W&B run if one is open (a crashed job must not leave a sweep's next job attached to it)."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def missing_key(error: MissingMandatoryValue | InterpolationToMissingValueError) -> str:
    """The `???` key a MissingMandatoryValue is about (the interpolated one, not the key that referred to it)."""
    found = re.search(r"Missing mandatory value: ([\w.]+)", str(error))
    return found.group(1) if found else str(error.full_key)


def user_error_behind(error: BaseException) -> UserError | None:
    """The UserError a resolver raised under OmegaConf's InterpolationResolutionError, or None.

    OmegaConf drops the `__cause__` of the errors it re-raises (unless OC_CAUSE=1), so the chain of the exceptions
    being handled when each was raised (`__context__`) is where the resolver's own error is.
    """
    seen = error.__context__
    while seen is not None and not isinstance(seen, UserError):
        seen = seen.__context__
    return seen


def report_user_error(error: UserError) -> None:
    """Print a user's mistake as its message only, then exit with its code (HYDRA_FULL_ERROR=1: the traceback)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)
    sys.exit(error.exit_code)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_console()
    try:
        result = run_stage(cfg)
    except UserError as error:
        report_user_error(error)
    except (
        MissingMandatoryValue,
        InterpolationToMissingValueError,
    ) as error:  # a `???` setting, e.g. models.target_path of models=local
        report_user_error(
            ConfigError(
                f"{missing_key(error)} is not set: give it on the command line ({missing_key(error)}=...)"
            )
        )
    except InstantiationException as error:  # a UserError raised while Hydra built an object (e.g. the task)
        if not isinstance(error.__cause__, UserError):
            raise
        report_user_error(error.__cause__)
    except InterpolationResolutionError as error:  # a resolver's UserError (a package file's missing package)
        cause = user_error_behind(error)
        if cause is None:
            raise
        report_user_error(cause)
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
