"""Stage `pipeline`: run several stages in order, feeding each stage's outputs to the next through the config.

The chain and its wiring are data (`conf/stage/pipeline.yaml`): each step names its run function and, for each
output it returns (e.g. `export`), the config keys that the output fills for later steps. A step whose directory
already holds `result.json` is not run again, so re-launching a pipeline with the same output directory resumes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from specdistill.stages.summary import summary_table

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict[str, Any]:
    results: dict[str, Any] = {}
    root = Path(cfg.paths.output_dir)
    for step in cfg.stage.steps:
        done = root / step.name / "result.json"
        if done.is_file():
            log.info("step %s already done (%s): reusing its result", step.name, done)
            result = json.loads(done.read_text())
        else:
            log.info("pipeline step: %s", step.name)
            result = instantiate(step.run)(cfg)
        results[step.name] = result
        wire_outputs(cfg, step, result)
    table = summary_table(results)
    print(table)
    (root / "summary.txt").write_text(table + "\n")
    (root / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def wire_outputs(cfg: DictConfig, step: DictConfig, result: dict[str, Any]) -> None:
    """Copy `result[output]` into every config key listed under `step.outputs[output]`."""
    for output, keys in (step.get("outputs") or {}).items():
        if output not in result:
            raise KeyError(f"pipeline step {step.name} returned no {output!r}; it returned {sorted(result)}")
        for key in keys:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, result[output], force_add=True)
