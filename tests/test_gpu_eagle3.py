"""EAGLE-3 heads on one GPU: a bf16 target, the head trained under `trainer=gpu` (bf16-mixed, fp32 masters) and
DeepSpeed ZeRO-2, distill then AdaSPEC against the distilled head, and evaluation on CUDA whose greedy outputs equal
the target's. ZeRO-3 is refused for this kind before anything loads (tests/test_user_errors.py, on CPU).

Skipped without CUDA (conftest); benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import TINY, check_ok, evaluate_outputs, run_train, stage_overrides

pytestmark = pytest.mark.gpu

PAIR = [*TINY, "models.target.config.num_hidden_layers=4", "+models.target.dtype=bfloat16"]
HEAD = ["draft=eagle3", "draft.draft_vocab_size=128", "draft.ttt_steps=3", "draft.aux_layer_ids=[0,1,3]"]


@pytest.mark.parametrize("preset", ["gpu", "deepspeed_zero2"])
def test_an_eagle3_head_trains_on_a_bf16_target_and_decodes_losslessly_on_cuda(tmp_path: Path, preset: str):
    distill, adaspec, evaluate = tmp_path / "distill", tmp_path / "adaspec", tmp_path / "evaluate"
    done = run_train(["stage=distill", f"trainer={preset}", "trainer.devices=1", *PAIR, *HEAD,
                      *stage_overrides("distill", 3), f"hydra.run.dir={distill}"])  # fmt: skip
    check_ok(done)
    assert "fp32 master weights:" in done.stdout + done.stderr
    check_ok(run_train(["stage=adaspec", f"trainer={preset}", "trainer.devices=1", *PAIR, *HEAD,
                        f"adaspec.reference={distill / 'export'}", "adaspec.cached_scores=false", "adaspec.k=0.5",
                        *stage_overrides("adaspec", 2), f"hydra.run.dir={adaspec}"]))  # fmt: skip
    for run in (distill, adaspec):
        result = json.loads((run / "result.json").read_text())
        assert 0 < result["val/expected_acceptance"] <= 1, result
        assert json.loads((run / "export" / "config.json").read_text())["draft_vocab_size"] == 128
    check_ok(run_train(["stage=evaluate", *PAIR, "evaluate.device=cuda", f"+evaluate.drafts.eagle={distill / 'export'}",
                        f"+evaluate.drafts.eagle_adaspec={adaspec / 'export'}", "evaluate.num_prompts=2",
                        "evaluate.selection_prompts=2", "evaluate.max_new_tokens=8", "evaluate.fixed_lengths=[2]",
                        f"hydra.run.dir={evaluate}"]))  # fmt: skip
    baseline, by_name = evaluate_outputs(evaluate)
    assert baseline and {"eagle/fixed_k2", "eagle_adaspec/fixed_k2"} <= set(by_name)
    assert all(outputs == baseline for outputs in by_name.values())  # greedy: token for token the target's
