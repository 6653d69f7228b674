"""DFlash: a block drafter on the target's hidden states (the model, the kind, its proposer; see `kind.py`)."""

from specdistill.drafts.dflash.kind import DFlash
from specdistill.drafts.dflash.model import DFlashConfig, DFlashDrafter
from specdistill.drafts.dflash.proposer import DFlashProposer

__all__ = ["DFlash", "DFlashConfig", "DFlashDrafter", "DFlashProposer"]
