"""Token selection for selective distillation (AdaSPEC and baselines; docs/METHODS.md section 3).

- `selectors`: pure functions of per-token scores (`AdaSpecSelector`, `RandomSelector`, `DraftLossSelector`,
  `NoSelector`), built on the exact top-fraction functions of `topk`.
- `reference`: where AdaSPEC's D(p, r) comes from (`OnlineReference`, `CachedReferenceScores`,
  `ScoreOnceReference`; `KindReference` for a draft kind's own rows) and the score cache.
- `self_reference`: `SelfReference`, the draft's own earlier weights (lagged or EMA) as its reference
  (`SelfReferenceSelector`).
- `scoring`: the scoring pass over a dataloader and the per-example storage format.
"""

from specdistill.selection.base import Selection, SelectionRecord, Selector
from specdistill.selection.reference import (
    CachedReferenceScores,
    KindReference,
    OnlineReference,
    ReferenceScores,
    ScoreOnceReference,
    cached_reference_scores,
)
from specdistill.selection.selectors import (
    AdaSpecSelector,
    DraftLossSelector,
    NoSelector,
    RandomSelector,
    SelfReferenceSelector,
    TopFractionSelector,
)
from specdistill.selection.self_reference import SelfReference

__all__ = [
    "AdaSpecSelector",
    "CachedReferenceScores",
    "DraftLossSelector",
    "KindReference",
    "NoSelector",
    "OnlineReference",
    "RandomSelector",
    "ReferenceScores",
    "ScoreOnceReference",
    "Selection",
    "SelectionRecord",
    "SelfReference",
    "SelfReferenceSelector",
    "Selector",
    "TopFractionSelector",
    "cached_reference_scores",
]
