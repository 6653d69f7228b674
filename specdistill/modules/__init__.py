"""LightningModules: wiring of models and step logic only."""

from specdistill.modules.distill import DistillModule
from specdistill.modules.sft import SFTModule

__all__ = ["DistillModule", "SFTModule"]
