"""`models=local`: one path gives tokenizer and target, another the draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.export.hf import export_pretrained
from tests.helpers import check_ok, run_train, stage_overrides

SMALL_TASK = ["task.sizes.train=32", "task.sizes.validation=8", "task.sizes.test=8"]


def save_pair(root: Path, hidden: tuple[int, int] = (32, 16)) -> tuple[Path, Path]:
    """Two models of different sizes (`hidden`: target's, draft's) sharing the embedded tokenizer, saved as Hugging Face
    directories."""
    tokenizer = arith_tokenizer()
    paths = []
    for name, width, seed in (("target", hidden[0], 0), ("draft", hidden[1], 1)):
        torch.manual_seed(seed)
        config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, intermediate_size=2 * width)  # fmt: skip
        paths.append(export_pretrained(AutoModelForCausalLM.from_config(config), tokenizer, root / name))
    return paths[0], paths[1]


@pytest.mark.slow
def test_a_local_pair_distils_with_only_two_paths(tmp_path: Path):
    target, draft = save_pair(tmp_path)
    run = tmp_path / "distill"
    check_ok(run_train(["stage=distill", "models=local", f"models.target_path={target}", f"models.draft_path={draft}",
                        *SMALL_TASK, *stage_overrides("distill", 2), f"hydra.run.dir={run}"]))  # fmt: skip
    exported = AutoModelForCausalLM.from_pretrained(run / "export")
    assert exported.config.model_type == "llama" and exported.config.hidden_size == 16


def test_a_local_pair_without_paths_names_the_missing_key(tmp_path: Path):
    done = run_train(["stage=distill", "models=local", *SMALL_TASK, f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 64, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: models.target_path is not set: give it on the command line (models.target_path=...)"
    ]
