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
# One OpenMP thread in this process and in every process a test starts (train.py, ranks, vLLM): the tests run tiny
# models beside another xdist worker on a 2-core machine, and a second thread per process only spins in libgomp's
# barriers waiting for a core the other worker holds (a train.py pipeline spent 3/4 of its samples there). Set
# before torch is imported; a test that wants more threads sets them itself (tests/test_output_rows.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


# the test files that take longest in CI, longest first (summed from a CI run's `--durations`, 2026-12-06)
LONGEST_FILES = (
    "test_real_pair.py",
    "test_train.py",
    "test_vllm_backend.py",
    "test_eagle3_heads.py",
    "test_dflash_stages.py",
    "test_resume.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    # the files with end-to-end (`slow`) tests first, the longest of them (by CI's `--durations`) at the head:
    # `-n 2 --dist loadfile` hands files out in this order, so the long ones start at once and the short ones fill in
    # at the end instead of one worker finishing a long file alone
    slow_files = {item.path for item in items if "slow" in item.keywords}

    def order(item: pytest.Item) -> tuple[bool, int]:
        name = item.path.name
        return item.path not in slow_files, LONGEST_FILES.index(name) if name in LONGEST_FILES else len(
            LONGEST_FILES
        )

    items.sort(key=order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
