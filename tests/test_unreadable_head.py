"""AcceptanceHead.load on a head folder whose files were cut short: a clear InputFileError, not a library error."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.errors import InputFileError
from specdistill.models.acceptance_head import AcceptanceHead


@pytest.mark.parametrize("name", ["model.safetensors", "head_config.json"])
@pytest.mark.parametrize("kept", [0.5, 0.02])  # data cut short, header cut short
def test_head_load_of_a_truncated_file_names_it_and_the_fix(tmp_path, name, kept):
    head = AcceptanceHead(16, 2)
    torch.nn.init.normal_(head.out.weight)
    head.save(tmp_path / "head")
    path = tmp_path / "head" / name
    data = path.read_bytes()
    path.write_bytes(data[: max(1, int(len(data) * kept))])
    with pytest.raises(InputFileError, match=rf"{name}.*cut short.*re-run the acceptance_head stage"):
        AcceptanceHead.load(tmp_path / "head")


def test_head_load_of_a_missing_folder_is_an_input_file_error(tmp_path):
    with pytest.raises(InputFileError, match="head_config.json is missing"):
        AcceptanceHead.load(tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_size", "16"),
        ("hidden_size", {"_target_": "subprocess.run", "args": ["true"]}),
        ("num_blocks", -1),
        ("num_blocks", True),
        ("input", "anything"),
        ("input", None),
    ],
)
def test_a_head_config_with_a_wrong_value_is_one_line_naming_it(tmp_path, key, value):
    """head_config.json is data: each constructor argument is checked to be a plain value in range before anything
    is built from it (a string width used to fail inside torch, a dict ran nothing but crashed)."""
    AcceptanceHead(16, 2).save(tmp_path / "head")
    path = tmp_path / "head" / "head_config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(
        InputFileError, match=rf"head_config.json: {key} holds .*, expected .*re-export the head"
    ):
        AcceptanceHead.load(tmp_path / "head")
