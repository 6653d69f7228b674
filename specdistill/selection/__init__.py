"""Token selection for selective distillation (AdaSPEC and baselines)."""

from specdistill.selection.base import Selection, SelectionInput, SupportsSelect
from specdistill.selection.selectors import (
    AdaSpecSelector,
    DraftLossSelector,
    NoSelector,
    RandomSelector,
    TopFractionSelector,
)

__all__ = [
    "AdaSpecSelector",
    "DraftLossSelector",
    "NoSelector",
    "RandomSelector",
    "Selection",
    "SelectionInput",
    "SupportsSelect",
    "TopFractionSelector",
]
