"""Every preset architecture through every stage: sft -> distill -> adaspec -> rollout -> acceptance_head ->
evaluate -> analyse, as one in-process pipeline per architecture (tiny random target and a one-layer draft of the same
architecture, two optimizer steps per training stage, arith). A subprocess per architecture would pay the imports
eight times; the stage functions are what train.py calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose
from omegaconf import open_dict
from transformers import AutoConfig

from specdistill.stages import pipeline
from tests.architectures import ARCHITECTURES, SLIDING, WINDOW
from tests.helpers import hydra_conf
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.slow

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAINING_STAGES = ["sft", "distill", "adaspec", "acceptance_head"]
MAX_NEW_TOKENS = 3 * WINDOW

OVERRIDES = [
    "stage=pipeline",
    "models.target.seed=4",  # a target whose greedy output does not end at EOS at once, on every architecture
    "task.sizes.train=48",
    "task.sizes.validation=8",
    "task.sizes.test=8",
    "sft.eval_examples=2",
    "sft.eval_max_new_tokens=4",
    "adaspec.cached_scores=true",
    "rollout.num_prompts=8",
    "rollout.max_new_tokens=8",
    "rollout.batch_size=4",
    "rollout.shard_size=8",
    "evaluate.num_prompts=2",
    "evaluate.selection_prompts=1",
    f"evaluate.max_new_tokens={MAX_NEW_TOKENS}",
    "evaluate.fixed_lengths=[2]",
    "evaluate.acceptance_head.thresholds=[0.5]",
    "evaluate.acceptance_head.min_draft_length=1",
    "evaluate.warmup=0",
    "~evaluate.policies.heuristic",
    "~evaluate.policies.confidence",
    "~evaluate.policies.entropy",
    "analyse.baseline=null",  # the reference provides no draft here (below)
    *[f"{s}.batch_size=8" for s in TRAINING_STAGES],
    *[f"++{s}.trainer.max_steps=2" for s in TRAINING_STAGES],
    *[f"++{s}.trainer.limit_val_batches=1" for s in TRAINING_STAGES],
]


def _one_layer(config: dict) -> dict:
    return {**config, **{key: 1 for key in ("num_hidden_layers", "n_layer") if key in config}}


@pytest.fixture(scope="module")
def hydra_ctx():
    with hydra_conf():
        yield


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_stage_runs_on_the_architecture(hydra_ctx, arch, tmp_path):
    cfg = compose("train", overrides=OVERRIDES)
    with open_dict(cfg):
        cfg.models.target.config = ARCHITECTURES[arch]
        cfg.models.draft.config = _one_layer(ARCHITECTURES[arch])
        cfg.paths.output_dir = str(tmp_path)
        cfg.logger = None
        # one trained draft (AdaSPEC's) goes on to rollout, heads and evaluation; the reference only feeds AdaSPEC
        cfg.stage.steps.distill.provides = {}
    results = pipeline.run(cfg, tmp_path)

    assert list(results) == ["sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate", "analyse"]
    model_type = ARCHITECTURES[arch]["model_type"]
    for step in ("sft", "distill", "adaspec"):
        config = AutoConfig.from_pretrained(results[step]["export"])
        assert config.model_type == model_type and not config.tie_word_embeddings
        if arch in SLIDING:
            assert config.sliding_window == WINDOW
    assert (tmp_path / "adaspec" / "selection_tokens.json").is_file()
    # the diagnostics read the adaspec draft on the validation answers of this architecture
    assert results["analyse"]["adaspec/positions"] > 0 and (tmp_path / "analyse" / "margins.png").is_file()
    # the reference scores were computed at fit start and saved once
    assert (tmp_path / "adaspec" / "reference_scores" / "specdistill_scores.json").is_file()
    assert 0.0 <= results["rollout"]["adaspec/mean_acceptance_label"] <= 1.0
    assert (tmp_path / "acceptance_head" / "adaspec" / "export").is_dir()

    outputs: dict[str, dict[int, list[int]]] = {}
    for line in (tmp_path / "evaluate" / "outputs.jsonl").read_text().splitlines():
        row = json.loads(line)
        outputs.setdefault(row["name"], {})[row["example_id"]] = row["tokens"]
    reference = outputs.pop("autoregressive")
    # at least one output runs three windows past its prompt (a random target may also stop early at EOS)
    assert max(len(tokens) for tokens in reference.values()) == MAX_NEW_TOKENS
    assert {"adaspec/fixed_k2", "adaspec/oracle", "adaspec/adaspec_acceptance_head_h0.5"} <= set(outputs)
    for name, generated in outputs.items():
        assert generated == reference, f"{arch}: {name} differs from the target's greedy output"
    assert "adaspec/acceptance_head_over_best_fixed_k" in results["evaluate"]
