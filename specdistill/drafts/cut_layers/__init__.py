"""The cut-layers draft kind: a draft made of the target's own first layers and output layer (`kind.py`)."""

from specdistill.drafts.cut_layers.kind import CutLayers

__all__ = ["CutLayers"]
