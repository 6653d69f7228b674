"""Stage `pipeline`: run several stages in order in one run directory, feeding each step's outputs to the next.

The chain and its wiring are data: each step is declared once in `conf/step/<name>.yaml` (composed as
`stage.steps.<name>`, see conf/step/README.md): its run function, the groups that shape it (`reads`), for each output
its result holds (e.g. `export`) the config keys that output fills for later steps (`outputs`), and what it provides
to every later step that takes that kind (`provides: {draft: export}` fills `<takes.draft>.<label>` of each later
step with `takes: {draft: <map>}`); the `pipeline` group's `steps` list says which run. Step `<name>` writes into
`<run_dir>/<name>` and records its fingerprint there (`run_fingerprint.json`): its settings chained with those of
every earlier step, so a change re-runs the step it affects and every step after it.

Re-launching with the same run directory resumes: a finished step with the same fingerprint (resumable keys such as
`max_steps` included) is reused, an unfinished one resumes. A finished step whose fingerprint changed is refused
with the differences (`pipeline.on_change=refuse`, the default), or moved aside to `<step>.replaced-<time>` and run
again (`pipeline.on_change=rerun`). `check` runs before anything is written (train.py calls it before `.hydra/`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from specdistill.errors import ConfigError, RunDirConflictError
from specdistill.utils.atomic import atomic_write_text
from specdistill.utils.fingerprint import BASE_FINGERPRINT_KEYS, run_fingerprint
from specdistill.utils.run_dir import (
    describe,
    differences,
    holds_results,
    is_rank_zero,
    read_record,
    write_record,
)

log = logging.getLogger(__name__)

ON_CHANGE = ("refuse", "rerun")


@dataclass
class StepPlan:
    """What a launch does with one step: `reuse` its result, `run` it (fresh or resumed) or `rerun` it (changed)."""

    name: str
    record: dict[str, Any]
    action: str
    changed: list[str]


def plan(cfg: DictConfig, out_dir: Path) -> list[StepPlan]:
    """Compare every step's fingerprint with its folder's record; pure (reads files, writes nothing)."""
    unknown = [name for name in cfg.pipeline.steps if name not in cfg.stage.steps]
    if unknown:
        raise ConfigError(
            f"pipeline.steps names unknown steps {unknown}; the steps are {list(cfg.stage.steps)}"
        )
    on_change = cfg.pipeline.get("on_change", "refuse")
    if on_change not in ON_CHANGE:
        raise ConfigError(f"pipeline.on_change={on_change!r}; use one of {list(ON_CHANGE)}")
    top = read_record(out_dir)
    if (
        top is not None
        and top.get("config", {}).get("stage") != "pipeline"
        and holds_results(out_dir, depth=0)
    ):
        raise RunDirConflictError(
            f"{out_dir} holds a {top.get('config', {}).get('stage')!r} run; refusing to write a pipeline over its "
            "results. Use a new folder (hydra.run.dir=<new dir>)."
        )
    steps: list[StepPlan] = []
    upstream: str | None = None
    rerun_from: str | None = None
    for name in cfg.pipeline.steps:
        step = cfg.stage.steps[name]
        record = run_fingerprint(cfg, name, groups=(*BASE_FINGERPRINT_KEYS, *(step.get("reads") or [])),
                                 upstream=upstream)  # fmt: skip
        step_dir = out_dir / name
        previous = read_record(step_dir)
        finished = (step_dir / "result.json").is_file()
        if rerun_from is None and finished and previous and previous.get("settings") == record["settings"]:
            action, changed = "reuse", []
        elif not holds_results(step_dir):
            action, changed = "run", []
        elif (
            rerun_from is None
            and not finished
            and previous
            and previous.get("fingerprint") == record["fingerprint"]
        ):
            action, changed = "run", []  # resume its checkpoint
        else:
            action = "rerun"
            changed = differences(previous, record, with_resumable=True) if previous else ["<no record>"]
            if rerun_from is not None:
                changed = [f"<step {rerun_from}, which runs again>"]
        if action != "reuse" and rerun_from is None:
            rerun_from = name
        steps.append(StepPlan(name, record, action, changed))
        upstream = record["settings"]
    return steps


def check(cfg: DictConfig, out_dir: Path) -> list[StepPlan]:
    """`plan`, refusing (before anything is written) changed finished steps unless `pipeline.on_change=rerun`."""
    steps = plan(cfg, out_dir)
    changed = [s for s in steps if s.action == "rerun"]
    if changed and cfg.pipeline.get("on_change", "refuse") == "refuse":
        lines = "; ".join(f"{s.name} ({describe(s.changed, 5)})" for s in changed)
        raise RunDirConflictError(
            f"{out_dir} holds finished pipeline steps that these settings change: {lines}. Nothing was written. "
            "Use a new folder (hydra.run.dir=<new dir>), relaunch with the folder's own settings, or add "
            "pipeline.on_change=rerun to move those steps aside (<step>.replaced-<time>) and run them again."
        )
    return steps


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    steps = check(cfg, out_dir)
    writer = is_rank_zero()  # every rank runs the pipeline; one of them moves folders and writes records
    if writer:
        write_record(out_dir, run_fingerprint(cfg, "pipeline", groups=BASE_FINGERPRINT_KEYS))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {}
    for index, planned in enumerate(steps):
        name = planned.name
        step = cfg.stage.steps[name]
        step_dir = out_dir / name
        if planned.action == "reuse":
            log.info("step %s already done with these settings: reusing %s", name, step_dir / "result.json")
            result = json.loads((step_dir / "result.json").read_text())
        else:
            if planned.action == "rerun" and step_dir.exists() and writer:
                aside = step_dir.with_name(f"{name}.replaced-{stamp}")
                log.warning("step %s: settings changed (%s); moving its folder to %s", name,
                            describe(planned.changed), aside)  # fmt: skip
                step_dir.rename(aside)
            log.info("pipeline step: %s", name)
            if writer:
                write_record(step_dir, planned.record)
            result = instantiate(step.run)(cfg, out_dir=step_dir)
        results[name] = result
        wire_outputs(cfg, name, step, result)
        wire_provided(cfg, name, step, result, later=[s.name for s in steps[index + 1 :]])
    table = summary_table(results)
    print(f"pipeline finished: {out_dir}\n{table}")
    atomic_write_text(out_dir / "summary.txt", table + "\n")
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=2, default=str))
    return results


def wire_outputs(cfg: DictConfig, name: str, step: DictConfig, result: dict[str, Any]) -> None:
    """Copy `result[output]` into every config key listed under `step.outputs[output]`; an output the step returned
    as None (one it did not make, e.g. no target cache) leaves those keys as they are."""
    for output, keys in (step.get("outputs") or {}).items():
        if output not in result:
            raise KeyError(f"pipeline step {name} returned no {output!r}; it returned {sorted(result)}")
        if result[output] is None:
            continue
        for key in keys:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, result[output], force_add=True)


def wire_provided(
    cfg: DictConfig, name: str, step: DictConfig, result: dict[str, Any], later: list[str]
) -> None:
    """Give every step in `later` that takes a kind this step provides (`provides: {draft: export}`) the result
    under this step's label: `<its takes.draft>.<label>` (the label defaults to the step's name)."""
    label = str(step.get("label") or name)
    for kind, output in (step.get("provides") or {}).items():
        if output not in result:
            raise KeyError(
                f"pipeline step {name} returned no {output!r} to provide as {kind}; it returned {sorted(result)}"
            )
        for consumer in later:
            key = (cfg.stage.steps[consumer].get("takes") or {}).get(kind)
            if key is not None:
                with open_dict(cfg):
                    OmegaConf.update(cfg, f"{key}.{label}", result[output], force_add=True)


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per (step, metric) with a numeric value; paths and nested reports are left out."""
    rows = [
        (step, name, f"{value:.4f}" if isinstance(value, float) else str(value))
        for step, result in results.items()
        for name, value in result.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]
    if not rows:
        return "(no metrics)"
    header = ("stage", "metric", "value")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(3)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
