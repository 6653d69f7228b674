"""AcceptanceHead.load on a head folder whose files were cut short: a clear InputFileError, not a library error."""

from __future__ import annotations

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
