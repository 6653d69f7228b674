"""A stage that only records that it ran and returns every output a pipeline step may wire (for pipeline tests)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specdistill.stages.outputs import write_result


def run(cfg: DictConfig, out_dir: Path) -> dict:
    with (out_dir.parent / "calls.log").open("a") as log:
        log.write(out_dir.name + "\n")
    export = out_dir / "export"
    export.mkdir(exist_ok=True)
    return write_result(
        out_dir,
        {"stage": out_dir.name, "export": str(export), "rollouts": {"d": str(out_dir)}, "heads": {"d": str(out_dir)},
         "target_cache": None, "value": 1.0},
    )  # fmt: skip
