"""Optional dependencies: DeepSpeed, W&B and the SLURM launcher are extras (`pip install 'specdistill[wandb]'`)."""

from __future__ import annotations

import importlib


def require(module: str, feature: str, extra: str) -> None:
    """Import `module`, or raise ImportError naming the feature that needs it and the extra that installs it."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{feature} needs `{module.split('.')[0]}`, which is not installed: pip install 'specdistill[{extra}]' "
            "(or 'specdistill[all]')."
        ) from err
