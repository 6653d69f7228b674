"""One console line per event: Lightning's own handlers removed (Hydra's print and log every record once), its
advertisement and a torch deprecation notice dropped, and transformers' per-model "Loading weights" bars off."""

from __future__ import annotations

import logging
import warnings

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
ADVERTISEMENTS = ("litlogger", "LitLogger")


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(word in message for word in ADVERTISEMENTS)


def quiet_console() -> None:
    """Call once Hydra has configured logging (inside the Hydra main function)."""
    import lightning.pytorch  # noqa: F401  (its import adds the handlers removed here)

    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True  # to Hydra's console and train.log handlers
    # Lightning 2.6 calls torch's deprecated pytree API once per fit: nothing a user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvertisements) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdvertisements())
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
