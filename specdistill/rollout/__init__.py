"""SpecDec++ rollouts: target responses, draft tokens and soft acceptance labels, stored for head training."""

from specdistill.rollout.data import RolloutCollator, RolloutDataModule, mix_sequence
from specdistill.rollout.hidden_cache import build_hidden_cache, load_hidden_cache
from specdistill.rollout.labels import labelling_config, sample_draft_tokens, soft_labels
from specdistill.rollout.run import load_rollouts, run_rollouts

__all__ = [
    "RolloutCollator",
    "RolloutDataModule",
    "build_hidden_cache",
    "labelling_config",
    "load_hidden_cache",
    "load_rollouts",
    "mix_sequence",
    "run_rollouts",
    "sample_draft_tokens",
    "soft_labels",
]
