"""Token selection for selective distillation (AdaSPEC and baselines)."""

from specdistill.selection.base import Selection, SelectionInput, SupportsSelect

__all__ = ["Selection", "SelectionInput", "SupportsSelect"]
