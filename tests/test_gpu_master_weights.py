"""fp32 master weights on a GPU: every trainer preset trains a bf16-loaded pair with fp32 masters (plain bf16-mixed:
fp32 parameters; DeepSpeed: fp32 ZeRO partitions). Skipped without CUDA (conftest); benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_gpu_deepspeed import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["gpu", "deepspeed_zero2", "deepspeed_zero3"])
@pytest.mark.parametrize("stage", ["sft", "distill"])
def test_a_bf16_pair_trains_with_fp32_masters_under_each_gpu_preset(tmp_path: Path, preset: str, stage: str):
    done = train(
        tmp_path / "run", f"trainer={preset}", f"stage={stage}", "trainer.max_steps=2", f"{stage}.batch_size=4",
        f"{stage}.max_length=64", "+models.target.dtype=bfloat16", "+models.draft.dtype=bfloat16",
        f"++{stage}.trainer.limit_val_batches=1",
    )  # fmt: skip
    assert "fp32 master weights:" in done.stdout + done.stderr
