"""The configuration reference (docs/reference/configuration.md) is written from the code by
`python -m specdistill.config_reference`: the committed page must be what it writes, and what it writes must follow
the settings dataclasses and conf/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from specdistill import config_reference
from specdistill.stages.settings import check_choice, check_count, check_number

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference() -> str:
    return config_reference.build_reference()


def section(text: str, heading: str) -> str:
    """The body under the Markdown heading `heading`, up to the next heading of any level."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"^#{1,6} ", text[start:], re.MULTILINE)
    return text[start : start + following.start()] if following else text[start:]


def row(text: str, key: str) -> list[str]:
    """The cells of the table row whose first cell is the code span `key`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
    return [value.strip() for value in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_the_committed_reference_is_what_the_generator_writes(reference):
    committed = (ROOT / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference, (
        "docs/reference/configuration.md is out of date with the settings dataclasses or conf/: "
        "run `python -m specdistill.config_reference` and commit the result"
    )


def test_a_stage_field_shows_its_type_default_range_and_docstring(reference):
    adaspec = section(reference, "## adaspec: `AdaSpecSettings`")
    assert row(adaspec, "k")[1:3] == ["float", "`0.4`"]  # the default of conf/adaspec/default.yaml
    assert row(adaspec, "k")[4].startswith("Kept fraction of answer tokens, (0, 1]")
    # inherited from TrainingSettings, with the range its __post_init__ checks
    assert row(adaspec, "micro_batch_size")[1:4] == ["int \\| None", "`2`", "integer ≥ 1, or null"]
    # a defaults-list entry of the stage's yaml, then the values the yaml sets on top of it
    assert row(adaspec, "optimizer")[2] == "`optimizer/adamw`, then `{lr: 0.0003}`"
    head = section(reference, "## acceptance_head: `AcceptanceHeadSettings`")
    assert row(head, "val_fraction")[3] == "number in [0, 1)"
    assert row(head, "w_rej")[3] == "number in (0, inf)"  # one check in a loop over two keys
    assert (
        row(section(reference, "## rollout: `RolloutSettings`"), "backend")[3]
        == "one of `transformers`, `vllm`"
    )
    grid = section(reference, "### `evaluate.acceptance_head`: `HeadPolicyGrid`")
    assert row(grid, "thresholds")[2:4] == ["`[0.3, 0.5, 0.7]`", "each number in [0, 1]"]


def test_every_stage_and_every_yaml_option_of_conf_is_listed(reference):
    from specdistill.stages import settings

    for cls in config_reference.stage_classes(settings, settings.StageSettings):
        assert f"\n## {cls.group}: `{cls.__name__}`\n" in reference
    conf = ROOT / "conf"
    groups = sorted(path.name for path in conf.iterdir() if path.is_dir())
    for group in groups:
        body = section(reference, f"### {group}")
        for path in (conf / group).rglob("*.yaml"):
            if path.relative_to(conf).as_posix() not in config_reference.IGNORED:
                option = path.relative_to(conf / group).with_suffix("").as_posix()
                assert f"| `{option}` |" in body, f"conf/{group}: {option} is missing from the reference"
    assert row(section(reference, "### Groups"), "task")[1] == "`arith`"  # train.yaml's default
    assert row(section(reference, "### task"), "arith")[1] == "`specdistill.tasks.arith.Arith`"


def test_stage_tables_are_wrapped_for_the_phone_layout_and_its_labels_follow_the_columns(reference):
    """Each settings table sits in a `settings-table` div (md_in_html), which docs/stylesheets/extra.css stacks
    into one labelled block per field on a phone; the CSS labels cells by position, so they must name the columns
    the generator writes, in its order."""
    adaspec = section(reference, "## adaspec: `AdaSpecSettings`")
    header = "| " + " | ".join(config_reference.SETTINGS_COLUMNS) + " |"
    opening = f'<div class="{config_reference.SETTINGS_CLASS}" markdown>'
    assert f"{opening}\n\n{header}\n" in adaspec and adaspec.rstrip().endswith("</div>")
    assert reference.count(opening) == reference.count(header)  # every settings table, nested blocks included
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    labels = dict(
        re.findall(
            rf'\.{config_reference.SETTINGS_CLASS}[^{{}}]*td:nth-child\((\d+)\)::before\s*\{{\s*content:\s*"([^"]+)"',
            css,
        )
    )
    assert labels, "extra.css labels no cell of the settings tables"
    for position, label in labels.items():
        assert config_reference.SETTINGS_COLUMNS[int(position) - 1] == label


# A stage of its own, so the reader is checked on inputs this test controls.


@dataclass(frozen=True, kw_only=True)
class ToyBlock:
    """`toy.block`: a nested block."""

    depth: int
    """How deep."""

    def __post_init__(self) -> None:
        check_count("toy.block", "depth", self.depth, minimum=2)


@dataclass(frozen=True, kw_only=True)
class ToySettings:
    """A toy stage.

    Not part of the summary."""

    group: ClassVar[str] = "toy"
    rate: float
    """Learning | rate, <per> step."""
    mode: str = "fast"
    """How it runs."""
    lows: float
    highs: float
    count: int | None = None
    guarded: int = 0
    block: ToyBlock
    """Nested settings."""

    def __post_init__(self) -> None:
        check_number(self.group, "rate", self.rate, 0.0, 1.0, low_open=True)
        check_choice(self.group, "mode", self.mode, ("fast", "slow"))
        for key in ("lows", "highs"):
            check_number(self.group, key, getattr(self, key), -1.0, 1.0)
        check_count(self.group, "count", self.count, minimum=0, optional=True)
        if self.mode == "slow":  # a check that holds only sometimes is not a range of the field
            check_count(self.group, "guarded", self.guarded)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    conf = tmp_path / "conf"
    write(
        conf / "train.yaml",
        "defaults:\n  - colour: red\n  - optional toy: default\n  - _self_\n\n# the seed of everything\nseed: 3\n",
    )
    write(conf / "colour" / "red.yaml", "# @package _global_\n# Red things. More text.\n_target_: a.Red\n")
    write(conf / "colour" / "shades" / "dark.yaml", "x: 1\n")
    write(
        conf / "toy" / "default.yaml",
        "_target_: tests.ToySettings\nrate: 0.5\nlows: -1\nhighs: 1\nguarded: 1\nblock:\n  depth: 4\n",
    )
    write(conf / "local" / "default.yaml", "# a machine's own settings\n")  # git-ignored: never listed
    return conf


def test_the_reference_follows_the_classes_and_the_conf_folder_it_is_given(conf):
    text = config_reference.render_reference(conf, [ToySettings])
    toy = section(text, "## toy: `ToySettings`")
    assert toy.lstrip().startswith("A toy stage.") and "Not part of the summary" not in toy
    assert row(toy, "rate") == [
        "`rate`",
        "float",
        "`0.5`",
        "number in (0, 1]",
        "Learning \\| rate, &lt;per> step.",
    ]
    assert row(toy, "mode")[2:4] == [
        "`fast`",
        "one of `fast`, `slow`",
    ]  # the dataclass default: yaml has none
    assert row(toy, "lows")[3] == row(toy, "highs")[3] == "number in [-1, 1]"
    assert row(toy, "count")[3] == "integer ≥ 0, or null"
    assert row(toy, "guarded")[3] == ""
    assert row(section(text, "### `toy.block`: `ToyBlock`"), "depth")[2:] == [
        "`4`",
        "integer ≥ 2",
        "How deep.",
    ]
    colour = section(text, "### colour")
    assert row(colour, "red") == ["`red`", "`a.Red`", "Red things."]
    assert row(colour, "shades/dark") == ["`shades/dark`", "", ""]
    assert "No option is committed" in section(text, "### local")
    groups = section(text, "### Groups")
    assert row(groups, "colour")[1:] == ["`red`", "2"] and row(groups, "toy")[1] == "`default (optional)`"
    assert row(section(text, "### Root settings"), "seed") == ["`seed`", "`3`", "the seed of everything"]
    # a new option shows up
    write(conf / "colour" / "blue.yaml", "# Blue things.\n")
    assert row(section(config_reference.render_reference(conf, [ToySettings]), "### colour"), "blue")


def test_check_fails_on_a_stale_page_and_names_the_command(tmp_path, capsys, reference):
    page = tmp_path / "configuration.md"
    assert config_reference.main(["--check", "--output", str(page)]) == 1  # missing
    page.write_text(reference.replace("Kept fraction", "Kept share"), encoding="utf-8")
    assert config_reference.main(["--check", "--output", str(page)]) == 1
    assert "run `python -m specdistill.config_reference`" in capsys.readouterr().err
    assert config_reference.main(["--output", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == reference
    assert config_reference.main(["--check", "--output", str(page)]) == 0
