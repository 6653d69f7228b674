"""DeepSpeed ZeRO-2/3 end to end on one GPU in bf16: distill and adaspec steps, save, resume, export, convert.

Skipped without CUDA (conftest). Each case runs train.py in a subprocess, as a user would:

    python -m pytest tests/test_gpu_deepspeed.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

TINY = [
    "task.max_examples.train=32",
    "task.max_examples.validation=8",
    "task.max_examples.test=8",
    "models.target.config.hidden_size=64",
    "models.target.config.intermediate_size=128",
    "models.target.config.num_hidden_layers=2",
    "models.target.config.num_attention_heads=2",
    "models.draft.config.hidden_size=32",
    "models.draft.config.intermediate_size=64",
    "models.draft.config.num_attention_heads=2",
    "trainer.devices=1",
    "+trainer.enable_progress_bar=false",
    "checkpoint_every_n_steps=1",
]


def stage_settings(stage: str, max_steps: int) -> list[str]:
    return [
        f"stage={stage}",
        f"trainer.max_steps={max_steps}",
        "trainer.max_epochs=10",
        f"{stage}.batch_size=4",
        "trainer.accumulate_grad_batches=2",
        f"{stage}.max_length=64",
    ]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [sys.executable, "train.py", *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def draft_only(config_dir: Path):
    """A module whose state_dict keys match DistillModule's (`draft.*`; frozen models are not in checkpoints)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    module = torch.nn.Module()
    module.draft = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    return module


@pytest.mark.parametrize("zero", [2, 3], ids=lambda z: f"zero{z}")
def test_distill_then_adaspec_save_resume_export(tmp_path: Path, zero: int) -> None:
    from specdistill.utils.strategy import deepspeed_checkpoint_to_hf

    preset = f"trainer=deepspeed_zero{zero}"
    distill = tmp_path / "distill"
    train(distill, preset, *stage_settings("distill", 2))
    last = distill / "checkpoints" / "last.ckpt"
    assert last.is_dir(), "a DeepSpeed checkpoint is a directory"

    resumed = train(distill, preset, *stage_settings("distill", 3))  # resume from step 2, one more step
    assert "resuming from" in resumed.stdout + resumed.stderr
    export = load_file(distill / "export" / "model.safetensors")
    assert all(t.numel() > 0 and torch.isfinite(t.float()).all() for t in export.values())

    converted_dir = deepspeed_checkpoint_to_hf(
        last, lambda: draft_only(distill / "export"), tmp_path / "converted"
    )
    converted = load_file(converted_dir / "model.safetensors")
    assert converted.keys() == export.keys()
    for name, tensor in export.items():  # fp32 master weights of the last step vs the exported (bf16) draft
        torch.testing.assert_close(converted[name].to(tensor.dtype), tensor, rtol=1e-2, atol=1e-2)

    adaspec = tmp_path / "adaspec"
    train(adaspec, preset, *stage_settings("adaspec", 2), f"adaspec.reference={distill / 'export'}")
    assert (adaspec / "checkpoints" / "last.ckpt").is_dir()
    assert (adaspec / "export" / "model.safetensors").is_file()
