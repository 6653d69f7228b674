"""README.md stays a first hour's read and stays true: at most 250 lines, every training command in it composes,
every repository path it names exists, and it cites no commit (commits are the results pages' provenance).

Which commands are checked: the lines of README's fenced code blocks (continued lines joined, `&&` chains split into
their steps) and its inline code spans, keeping those that start `python train.py` or `specdistill-train`. Every
other command (`pip`, `bash`, `mkdocs`, `python -m pytest`, `python -m venv`, `ruff`, ...) is skipped by that rule:
they install or test, and the Quickstart test in tests/test_packaging.py and CI run them.

A kept command is composed in-process with Hydra's compose API on conf/, as `train.py ... --cfg job` would compose
it, with these rules: `-m`/`--multirun` and `--cfg job` are dropped, a sweep (`adaspec.k=0.2,0.4`) takes its first
value, and a placeholder (`<run>`: the export of an earlier run) becomes a folder name. Then the checks of
specdistill/validation.py that `train.py` makes before it loads anything and that read only the config (settings,
`+` keys, drafts, reference, draft kind); the ones that open files (model folders, run folders, GGUF files) are left
out, since the placeholders name no real run. One subprocess runs the headline real-model command with `--cfg job`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from specdistill import validation
from tests.helpers import hydra_conf

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
TRAIN = ("python train.py", "specdistill-train")
REAL_MODEL_COMMAND = "python train.py experiment=smollm2_stdlib"
# a repository path: one of these top-level folders (or a file at the root) followed by a path
PATH = re.compile(
    r"^(?:conf|docs|benchmarks|tests|specdistill|tasks|\.ci)/[\w./-]*$|^[\w-]+\.(?:py|toml|md|yaml)$"
)


def readme() -> str:
    return README.read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[\w-]*\n(.*?)^```", text, re.S | re.M)


def inline_spans(text: str) -> list[str]:
    without_blocks = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", without_blocks)


def train_commands(text: str) -> list[str]:
    """Every `python train.py ...` / `specdistill-train ...` command README shows (the rule the docstring names)."""
    commands = []
    for block in code_blocks(text):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            commands += [step.split(" # ")[0].strip() for step in line.split("&&")]
    commands += [span.strip() for span in inline_spans(text)]
    return [
        c for c in commands if c == TRAIN[0] or c == TRAIN[1] or c.startswith(tuple(f"{t} " for t in TRAIN))
    ]


def overrides_of(command: str) -> list[str]:
    """The command's Hydra overrides, under the rules of the module docstring."""
    prog = next(t for t in TRAIN if command.startswith(t))
    words = command[len(prog) :].replace("--cfg job", " ").split()
    words = [w.strip("'\"") for w in words if w not in ("-m", "--multirun")]
    words = [re.sub(r"<[^<>]+>", "run", w) for w in words]
    parsed = OverridesParser.create().parse_overrides(words)
    return [
        f"{o.input_line.split('=', 1)[0]}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
        else o.input_line
        for o in parsed
    ]  # fmt: skip


def check_config(overrides: list[str]) -> None:
    """Compose as train.py does and run validation's config-only checks."""
    cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        validation.check_added_keys(cfg)
        for stage in validation.running_stages(cfg):
            validation.check_stage_settings(cfg, stage)
        validation.check_drafts_given(cfg)
        validation.check_reference_given(cfg)
        validation.check_reference_rows(cfg)
        validation.check_target_states(cfg)
        validation.check_zero3_kind(cfg)
    finally:
        HydraConfig.instance().cfg = None


def test_readme_is_at_most_250_lines():
    count = len(readme().splitlines())
    assert count <= MAX_LINES, f"README.md has {count} lines (at most {MAX_LINES}): move detail to docs/"


def test_readme_shows_training_commands_and_the_real_model_command():
    commands = train_commands(readme())
    assert "python train.py" in commands and REAL_MODEL_COMMAND in commands, commands


def test_every_training_command_in_readme_composes():
    failures = []
    with hydra_conf():
        for command in dict.fromkeys(train_commands(readme())):
            try:
                check_config(overrides_of(command))
            except Exception as error:  # every failure is reported, with its command
                failures.append(f"{command}\n    {type(error).__name__}: {str(error).splitlines()[0]}")
    assert not failures, "README commands that do not compose:\n" + "\n".join(failures)


def test_the_real_model_command_prints_its_job_config():
    """The literal path: train.py itself, as a user runs it, with `--cfg job` (prints the config, runs nothing)."""
    assert REAL_MODEL_COMMAND in train_commands(readme())
    args = REAL_MODEL_COMMAND.removeprefix("python train.py").split()
    result = subprocess.run(
        [sys.executable, "train.py", *args, "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "smollm2" in result.stdout.lower()


def named_paths(text: str) -> set[str]:
    """Repository paths README names: in code spans and as link targets (anchors and URLs aside)."""
    candidates = [s.split()[0] for s in inline_spans(text) if s.strip()]
    candidates += [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    return {c.rstrip(".,:;") for c in candidates if PATH.match(c.rstrip(".,:;")) and "<" not in c}


def test_every_path_readme_names_exists():
    paths = named_paths(readme())
    assert "docs/results/index.md" in paths and "conf/experiment/" in paths, sorted(paths)
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_readme_cites_no_commit():
    hashes = re.findall(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])", readme())
    commits = [h for h in hashes if re.search(r"[a-f]", h) and re.search(r"[0-9]", h)]
    assert not commits, f"README.md cites commits {commits}: they belong on the results pages (docs/results/)"
