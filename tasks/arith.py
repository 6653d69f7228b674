"""`arith`: the embedded GSM8K look-alike (no files, no network); the generator lives in `specdistill.data.arith`."""

from __future__ import annotations

from collections.abc import Mapping

import datasets

from specdistill.data.arith import DEFAULT_SIZES, generate_split
from specdistill.tasks.base import SPLITS
from specdistill.tasks.gsm8k import GSM8K


class Arith(GSM8K):
    """Generated grade-school word problems in GSM8K's schema, formatted and scored exactly like GSM8K.

    Args:
        seed: generator seed; each split is generated from `(seed, split)` and no question is in two splits.
        sizes: records per split (defaults: train 4000, validation 200, test 200).
        **kwargs: `Task` arguments (`max_examples`, `data_files` to read saved problems instead, ...).
    """

    name = "arith"
    default_path = None
    default_config_name = None
    default_splits = {"train": "train", "validation": "validation", "test": "test"}
    default_holdout = {}

    def __init__(self, seed: int = 0, sizes: Mapping[str, int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seed = int(seed)
        self.sizes = {**DEFAULT_SIZES, **dict(sizes or {})}
        unknown = sorted(set(self.sizes) - set(SPLITS))
        if unknown:
            raise ValueError(f"arith sizes has unknown split names {unknown}; use {SPLITS}.")

    def _load_source(self, split: str) -> datasets.Dataset:
        if self.local:
            return super()._load_source(split)
        return datasets.Dataset.from_list(generate_split(split, int(self.sizes[split]), self.seed))
