"""docs/PRESETS.md is the presets' data: every preset composes, for every pair and task it lists, to the table's
`ours` values, and a row without a deviation agrees with the authors' value (unless that was not found)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hydra import compose
from omegaconf import OmegaConf

import specdistill  # noqa: F401  (registers the config resolvers, as train.py does)
from tests.helpers import hydra_conf

ROOT = Path(__file__).resolve().parents[1]
NOT_FOUND = "not found"


def table() -> list[dict]:
    text = (ROOT / "docs" / "PRESETS.md").read_text()
    block = re.search(r"<!-- presets-table.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/PRESETS.md has no presets-table YAML block"
    return yaml.safe_load(block.group(1))["presets"]


def cases() -> list[tuple[dict, str, str | None]]:
    return [(p, m, t) for p in table() for m in p["models"] for t in p["tasks"]]


def pick(value, models: str, task: str | None):
    """A table value, keyed by pair and then by task where it differs between them."""
    if isinstance(value, dict) and models in value:
        value = value[models]
    if isinstance(value, dict) and task in value:
        value = value[task]
    return value


@pytest.fixture(scope="module")
def hydra_ctx():
    with hydra_conf():
        yield


def test_the_table_covers_every_experiment_preset():
    presets = {p["experiment"] for p in table()}
    assert presets == {path.stem for path in (ROOT / "conf" / "experiment").glob("*.yaml")}
    for preset in table():
        for row in preset["settings"]:
            assert set(row) == {"key", "ours", "authors", "source", "deviation"}, row
            assert row["source"], f"{preset['name']}: {row['key']} has no source"


@pytest.mark.parametrize(
    ("preset", "models", "task"), cases(), ids=lambda v: v["name"] if isinstance(v, dict) else str(v)
)
def test_every_preset_composes_to_its_table_values(hydra_ctx, preset, models, task):
    overrides = [
        f"experiment={preset['experiment']}",
        f"models={models}",
        *([f"task={task}"] if task else []),
    ]
    cfg = compose("train", overrides=overrides)
    cfg.paths.output_dir = "/tmp/unused"
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for row in preset["settings"]:
        ours, authors = pick(row["ours"], models, task), pick(row["authors"], models, task)
        deviation = pick(row["deviation"], models, task)
        assert OmegaConf.select(resolved, row["key"], default="<absent>") == ours, (row["key"], models, task)
        if deviation is None and authors != NOT_FOUND:
            assert ours == authors, (
                f"{row['key']} ({models}, {task}) differs from the authors without a reason"
            )
