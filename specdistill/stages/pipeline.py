"""Stage `pipeline`: run several stages in order in one run directory, feeding each step's outputs to the next.

The chain and its wiring are data (`conf/stage/pipeline.yaml`): `stage.steps` gives every step's run function and,
for each output its result holds (e.g. `export`), the config keys that output fills for later steps; the `pipeline`
group's `steps` list says which run. Step `<name>` writes into `<run_dir>/<name>`. A step whose directory already
holds `result.json` is not run again, so re-launching a pipeline with the same run directory resumes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    unknown = [name for name in cfg.pipeline.steps if name not in cfg.stage.steps]
    if unknown:
        raise ValueError(
            f"pipeline.steps names unknown steps {unknown}; the steps are {list(cfg.stage.steps)}"
        )
    results: dict[str, Any] = {}
    for name in cfg.pipeline.steps:
        step = cfg.stage.steps[name]
        step_dir = out_dir / name
        done = step_dir / "result.json"
        if done.is_file():
            log.info("step %s already done (%s): reusing its result", name, done)
            result = json.loads(done.read_text())
        else:
            log.info("pipeline step: %s", name)
            step_dir.mkdir(parents=True, exist_ok=True)
            result = instantiate(step.run)(cfg, out_dir=step_dir)
        results[name] = result
        wire_outputs(cfg, name, step, result)
    table = summary_table(results)
    print(table)
    (out_dir / "summary.txt").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def wire_outputs(cfg: DictConfig, name: str, step: DictConfig, result: dict[str, Any]) -> None:
    """Copy `result[output]` into every config key listed under `step.outputs[output]`."""
    for output, keys in (step.get("outputs") or {}).items():
        if output not in result:
            raise KeyError(f"pipeline step {name} returned no {output!r}; it returned {sorted(result)}")
        for key in keys:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, result[output], force_add=True)


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
