"""LightningModules: wiring of models and step logic only."""

from specdistill.modules.distill import DistillModule

__all__ = ["DistillModule"]
