"""One console line per event: Lightning's own handlers removed (Hydra's print and log every record once), its
advertisement and a torch deprecation notice dropped, transformers' per-model "Loading weights" bars off, and on a
machine without CUDA DeepSpeed's "Setting accelerator to CPU" warning dropped (transformers' `save_pretrained`
imports DeepSpeed whenever it is installed, and on such a machine CPU is the only choice)."""

from __future__ import annotations

import logging
import warnings

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
ADVERTISEMENTS = ("litlogger", "LitLogger")
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_FALLBACK = "Setting accelerator to CPU"


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of `words`."""

    def __init__(self, words: tuple[str, ...]) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(word in message for word in self.words)


def _add_filter_once(logger: logging.Logger, words: tuple[str, ...]) -> None:
    if not any(isinstance(f, _DropMessages) and f.words == words for f in logger.filters):
        logger.addFilter(_DropMessages(words))


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
    _add_filter_once(logging.getLogger("lightning.pytorch.utilities.rank_zero"), ADVERTISEMENTS)
    import torch

    if not torch.cuda.is_available():  # DeepSpeed's logger, before DeepSpeed (if ever) imports and warns
        _add_filter_once(logging.getLogger(DEEPSPEED_LOGGER), (DEEPSPEED_CPU_FALLBACK,))
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
