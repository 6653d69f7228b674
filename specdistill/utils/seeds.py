"""One seed drives a run: every part that draws at random gets its own seed derived from the root `seed`.

    task.seed: ${derive_seed:${seed},task}          # generated data (conf/task/arith.yaml)
    models.draft.seed: ${derive_seed:${seed},models.draft}   # initial weights of a model built from a config

A part's seed is a hash of (root seed, part name): different parts never share a random stream, a seed sweep
(`seed=0,1,2`) changes all of them at once, and a user pins one part by overriding its key
(`task.seed=7` keeps the data while the rest follows `seed`). Data order, dropout, head initialisation and sampling
draw from the root seed itself (`stages.seeding.seed_everything`).
"""

from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

RESOLVER = "derive_seed"


def derive_seed(seed: int, part: str) -> int:
    """A seed in [0, 2**31) for `part`, determined by the root `seed` and the part's name."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an integer, got {seed!r}; set e.g. seed=0")
    digest = hashlib.sha256(f"specdistill/{seed}/{part}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def register_resolvers() -> None:
    """Make `${derive_seed:<seed>,<part>}` available to every config (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda seed, part: derive_seed(int(seed), str(part)))
