"""SpecDec++ rollouts: target responses, draft tokens and soft acceptance labels, stored in resumable shards."""

from specdistill.rollout.labels import labelling_config, sample_draft_tokens, soft_labels
from specdistill.rollout.run import load_rollouts, run_rollouts

__all__ = [
    "labelling_config",
    "load_rollouts",
    "run_rollouts",
    "sample_draft_tokens",
    "soft_labels",
]
