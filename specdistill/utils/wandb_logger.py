"""Weights & Biases tracking that works without an account, names runs short (stage + what a sweep varies), groups
sweeps.

`conf/logger/wandb.yaml` builds the logger with `wandb_logger`. Without an API key (no `WANDB_API_KEY`, no netrc
entry) the run is written offline under `<run_dir>/wandb/` and the log says how to `wandb sync` it later. Helpers:
`log_export` (an export as a model artifact, when `log_model` is on: specdistill/export/ calls it), `log_report` (a
report as a table plus PNG images) and `log_summary`. Tests read offline runs back with tests/wandb_files.py.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from specdistill.utils.extras import require

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"


class SpecDistillWandbLogger(WandbLogger):
    """Lightning's `WandbLogger` plus whether stage exports go up as model artifacts (`log_export`), without its
    `anonymous` argument."""

    def __init__(self, *args: Any, log_exports: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log_exports = log_exports
        # Lightning passes `anonymous=None` to wandb.init, where any value prints a deprecation warning
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


def has_api_key() -> bool:
    """True when W&B can authenticate: `WANDB_API_KEY` is set or the netrc file has the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def _hydra() -> Any:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def sweep_group(save_dir: str | Path | None = None) -> str | None:
    """The default W&B group: a Hydra multirun's sweep directory name (one group per `-m` launch); for a single
    pipeline run, whose stages write into `<run_dir>/<stage>`, the run directory's name (one group per pipeline)."""
    hc = _hydra()
    if hc is None:
        return None
    if str(hc.mode) == "RunMode.MULTIRUN":
        return Path(hc.sweep.dir).name
    run_dir = Path(hc.runtime.output_dir)
    if save_dir is not None and Path(save_dir).resolve() != run_dir.resolve():
        return run_dir.name
    return None


RUN_NAME_LENGTH = 64


def run_name(save_dir: str | Path) -> str:
    """A short run name: the stage and the sub-folder the logger writes to, then the overrides that tell this job
    apart, paths left out.

    The first word is `<stage>` for a stage's own folder, else `<stage>/<sub-folder>` (`pipeline/distill`,
    `acceptance_head/adaspec`: a head per draft). In a multirun the overrides are the keys the sweep varies (read
    from `<sweep dir>/multirun.yaml`, which Hydra writes), otherwise every command-line override but `stage`; each key
    is cut to the shortest name that stays unique (`sft.optimizer.lr=1e-4` -> `lr=1e-4`), values that look like paths
    or hub ids are dropped, and the name is cut to `RUN_NAME_LENGTH` characters, e.g. `adaspec k=0.4 seed=1`.
    Outside Hydra: the run directory's name.
    """
    hc = _hydra()
    save_dir = Path(save_dir)
    if hc is None:
        return save_dir.name
    run_dir = Path(hc.runtime.output_dir)
    try:
        below = save_dir.resolve().relative_to(run_dir.resolve()).parts
    except ValueError:  # a logger writing outside the run folder
        below = (save_dir.name,)
    stage = "/".join([hc.runtime.choices.get("stage") or run_dir.name, *below])
    multirun = str(hc.mode) == "RunMode.MULTIRUN"
    overrides = _named_overrides(
        list(hc.overrides.task), _swept_keys(Path(hc.sweep.dir)) if multirun else None
    )
    name = " ".join([stage, *overrides])
    return name if len(name) <= RUN_NAME_LENGTH else name[: RUN_NAME_LENGTH - 1] + "…"


def _swept_keys(sweep_dir: Path) -> set[str] | None:
    """The keys a Hydra sweep varies (`key=a,b`, `range(...)`, `hydra.sweeper.params`), or None if unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    hydra_cfg = OmegaConf.load(path).hydra
    params = hydra_cfg.get("sweeper", {}).get("params") or {}
    lines = [*hydra_cfg.overrides.task, *(f"{key}={value}" for key, value in params.items())]
    swept = {
        _override_key(o) for o in OverridesParser.create().parse_overrides(lines) if o.is_sweep_override()
    }
    return swept or None


def _override_key(override: Any) -> str:
    """`sft.optimizer.lr` for `sft.optimizer.lr=...`; the package for `scheduler@sft.scheduler=cosine`."""
    return override.package or override.key_or_group


def _named_overrides(lines: list[str], keep: set[str] | None) -> list[str]:
    """`key=value` of each override in `lines` (all but `stage`, or only the keys in `keep`), keys shortened."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    pairs = []
    for override in OverridesParser.create().parse_overrides(lines):
        key = _override_key(override)
        value = override.input_line.partition("=")[2]
        if (
            override.is_delete()
            or key == "stage"
            or (keep is not None and key not in keep)
            or _is_path(value)
        ):
            continue
        pairs.append((key, value))
    keys = [key for key, _ in pairs]
    return [f"{_short_key(key, keys)}={value}" for key, value in pairs]


def _is_path(value: str) -> bool:
    return "/" in value or "\\" in value or value.startswith("~")


def _short_key(key: str, keys: list[str]) -> str:
    """The shortest name of `key` no other key in `keys` can take: its last part, else that part behind one earlier
    part (`models.target.config.hidden_size` beside `models.draft.config.hidden_size`: `target.hidden_size`)."""
    others = [_key_names(other) for other in keys if other != key]
    for name in _key_names(key):
        if not any(name in names for names in others):
            return name
    return key


def _key_names(key: str) -> list[str]:
    *parents, last = key.split(".")
    return [last, *(f"{parent}.{last}" for parent in reversed(parents)), key]


def job_config() -> dict[str, Any] | None:
    """The job's resolved config, read from `.hydra/config.yaml` of this run (None outside Hydra).

    train.py writes that file itself once the run folder is checked (`hydra.output_subdir` is null).
    """
    hc = _hydra()
    if hc is None:
        return None
    path = Path(hc.runtime.output_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    cfg = OmegaConf.load(path)
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception as error:  # an interpolation only the stage can resolve: keep the text, say so
        log.warning("W&B config logged unresolved (%s)", error)
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _run_id(save_dir: Path) -> str:
    """A run id kept in the run directory, so that a requeued or re-launched job continues the same W&B run."""
    path = save_dir / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    if rank_zero_only.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id)
    return run_id


def wandb_logger(
    save_dir: str | Path,
    project: str = "specdistill",
    entity: str | None = None,
    group: str | None = None,
    name: str | None = None,
    tags: Sequence[str] = (),
    log_model: bool = False,
    offline: bool | None = None,
    log_config: bool = True,
) -> SpecDistillWandbLogger:
    """A Lightning W&B logger for one stage run.

    Args:
        save_dir: the stage's output directory; W&B files go to `<save_dir>/wandb/`.
        project, entity: W&B project and team/user (None: the account's default entity).
        group: None groups a Hydra multirun under its sweep directory's name (a pipeline's stages under its run
            directory's name).
        name: None names the run after its stage and the overrides that tell it apart (`run_name`).
        tags: run tags.
        log_model: upload the stage's Hugging Face export as a model artifact (`log_export`); checkpoints never.
        offline: True/False forces the mode; None runs offline when there is no API key (or `WANDB_MODE=offline`).
        log_config: log the job's resolved Hydra config as the run config.
    """
    require("wandb", "logger=wandb", "wandb")
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    mode = os.environ.get("WANDB_MODE", "").lower()
    if offline is None:
        offline = mode in ("offline", "dryrun") or (mode != "disabled" and not has_api_key())
        if offline and mode not in ("offline", "dryrun"):
            log.warning(
                "W&B: no API key (WANDB_API_KEY unset and no netrc entry), logging offline to %s/wandb; "
                "upload later with: wandb sync %s/wandb/offline-run-*",
                save_dir,
                save_dir,
            )
    kwargs: dict[str, Any] = {}
    if log_config and (config := job_config()) is not None:
        kwargs["config"] = config
    return SpecDistillWandbLogger(
        save_dir=str(save_dir),
        project=project,
        entity=entity,
        group=group if group is not None else sweep_group(save_dir),
        name=name if name is not None else run_name(save_dir),
        tags=list(tags),
        id=_run_id(save_dir),
        resume="allow",
        offline=offline,
        log_model=False,
        log_exports=log_model,
        **kwargs,
    )


def _wandb_loggers(logger: Any) -> list[WandbLogger]:
    loggers = logger if isinstance(logger, list | tuple) else [logger]
    return [item for item in loggers if isinstance(item, WandbLogger)]


@rank_zero_only
def log_export(logger: Any, export_dir: str | Path, metadata: Mapping[str, Any] | None = None) -> bool:
    """Upload a Hugging Face export directory as a `model` artifact when the logger was built with `log_model`.

    Args:
        logger: `trainer.logger` (or `trainer.loggers`); anything that is not a W&B logger is ignored.
        export_dir: the directory `export_pretrained` wrote.

    Returns:
        True when an artifact was logged.
    """
    logged = False
    for item in _wandb_loggers(logger):
        if not getattr(item, "log_exports", False):
            continue
        import wandb  # only with a W&B logger: wandb is an extra (specdistill[wandb]), not a dependency

        run = item.experiment
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{run.name or run.id}-{Path(export_dir).name}")[:120]
        artifact = wandb.Artifact(name=name, type="model", metadata=dict(metadata or {}))
        artifact.add_dir(str(export_dir))
        run.log_artifact(artifact)
        logged = True
    return logged


@rank_zero_only
def log_report(
    logger: Any, report: Mapping[str, Any], images: Iterable[str | Path] = (), key: str = "report"
) -> bool:
    """Log an evaluation report to W&B: a `metric | value` table, one table per list of rows, and PNG images.

    Args:
        logger: `trainer.logger` or a W&B logger; other loggers are ignored.
        report: scalars (`{"acceptance_rate": 0.71, ...}`) and/or lists of row dicts (`{"per_task": [{...}, ...]}`);
            string values ending in `.png` are logged as images too.
        images: further PNG files (plots).
        key: prefix of the logged keys.

    Returns:
        True when something was logged to W&B.
    """
    targets = _wandb_loggers(logger)
    if not targets:
        return False
    import wandb  # only with a W&B logger: wandb is an extra (specdistill[wandb]), not a dependency

    scalars = {k: v for k, v in report.items() if isinstance(v, int | float | str | bool)}
    tables = {
        k: v
        for k, v in report.items()
        if isinstance(v, list) and v and all(isinstance(r, Mapping) for r in v)
    }
    pngs = [Path(p) for p in images] + [
        Path(v) for v in scalars.values() if isinstance(v, str) and v.endswith(".png")
    ]
    for path in pngs:
        if not path.is_file():
            raise FileNotFoundError(f"log_report: image {path} does not exist")
    for item in targets:
        run = item.experiment
        payload: dict[str, Any] = {}
        if scalars:  # W&B shows an empty table as a broken panel: none is logged
            payload[key] = wandb.Table(
                columns=["metric", "value"], data=[[k, str(v)] for k, v in scalars.items()]
            )
        for name, rows in tables.items():
            columns = list(dict.fromkeys(c for row in rows for c in row))
            payload[f"{key}/{name}"] = wandb.Table(
                columns=columns, data=[[row.get(c) for c in columns] for row in rows]
            )
        for path in pngs:
            payload[f"{key}/{path.stem}"] = wandb.Image(str(path))
        if payload:
            run.log(payload)
    log_summary(logger, {f"{key}/{k}": v for k, v in scalars.items() if not str(v).endswith(".png")})
    return True


@rank_zero_only
def log_summary(logger: Any, metrics: Mapping[str, Any]) -> bool:
    """Write numbers and strings (`{"best/speedup": 1.2, "best/name": "adaspec/fixed_k4"}`) into the W&B run's
    summary, the columns of a runs table; other values and other loggers are ignored. True when something was
    written."""
    values = {
        k: v for k, v in metrics.items() if isinstance(v, int | float | str) and not isinstance(v, bool)
    }
    targets = _wandb_loggers(logger)
    for item in targets:
        item.experiment.summary.update(values)
    return bool(targets and values)
