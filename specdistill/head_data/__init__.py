"""SpecDec++ head-training data: batches, head inputs, hidden-state caches and the datamodule, read from rollouts."""

from specdistill.head_data.collate import RolloutCollator, example_generator, mix_sequence
from specdistill.head_data.datamodule import RolloutDataModule, split_indices
from specdistill.head_data.hidden_cache import HiddenCache, build_hidden_cache, load_hidden_cache
from specdistill.head_data.inputs import judged_head_inputs

__all__ = [
    "HiddenCache",
    "RolloutCollator",
    "RolloutDataModule",
    "build_hidden_cache",
    "example_generator",
    "judged_head_inputs",
    "load_hidden_cache",
    "mix_sequence",
    "split_indices",
]
