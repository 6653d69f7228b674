"""Test session settings: offline, quiet, small thread pools, and a private cache for generated tokenizers."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# Generated artefacts (the arith tokenizer, datasets' Arrow caches) go to a per-session folder, never the user's
# caches; set before any test module imports `datasets`, which reads the variable at import time.
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="specdistill_tests_"))
os.environ["SPECDISTILL_CACHE"] = str(_SESSION_CACHE / "specdistill")
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_CACHE / "hf_datasets")


@pytest.fixture(scope="session", autouse=True)
def _remove_session_cache():
    yield
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    # the files with end-to-end (`slow`) tests first: `-n 2 --dist loadfile` hands files out in this order, so the
    # long ones start at once and the short ones fill in at the end instead of one worker finishing a long file alone
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
