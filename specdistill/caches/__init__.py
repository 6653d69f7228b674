"""Caches computed once over a dataset at fit start: one mechanism (key, compute, merge, load) and one trigger.

- `digest`: `weights_digest(model)` (every weight, to the bit), what the keys are made of.
- `store`: `SharedPass` (a cache's key, tables and per-rank computation) and `build_or_reuse`, which verifies a
  cache's tables against the digests its key file recorded before reusing them (`check_contents`).
- `fit_start`: `FitStartCache` (a provider built at fit start), `FitStart` and `prepare_caches`, called by the
  modules at fit start.

The users: `specdistill.data.target_cache` (the target's top-m distributions), `specdistill.selection.reference`
(reference scores), both prepared by `DistillModule`, and `specdistill.head_data.hidden_cache` (the acceptance head's
inputs, keyed by the draft's digest; prepared by `AcceptanceHeadModule`, in resumable shards).
"""

from specdistill.caches.digest import weights_digest
from specdistill.caches.fit_start import FitStart, FitStartCache, prepare_caches
from specdistill.caches.store import SharedPass, build_or_reuse, read_key

__all__ = [
    "FitStart",
    "FitStartCache",
    "SharedPass",
    "build_or_reuse",
    "prepare_caches",
    "read_key",
    "weights_digest",
]
