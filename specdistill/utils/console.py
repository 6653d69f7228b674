"""One console line per event. `quiet_console` (train.py calls it once Hydra has set up logging):

- Lightning's own handlers removed (Hydra's console and `train.log` handlers print every record once);
- dropped: Lightning's advertisement, its "Loading `train_dataloader` to estimate number of stepping batches" (an
  internal detail of every fit), a torch deprecation notice it triggers, and on a machine without CUDA DeepSpeed's
  "Setting accelerator to CPU" warning (transformers' `save_pretrained` imports DeepSpeed whenever it is installed;
  without CUDA, CPU is the only choice);
- Lightning's device lines ("GPU available: ...", "TPU available: ...") once per process, not once per Trainer (a
  pipeline builds five);
- progress bars off for transformers' per-model "Loading weights" and for `datasets` (a "Saving the dataset" bar per
  saved shard or cache); specdistill's own bars (training, scoring, rollouts, evaluation) stay.
"""

from __future__ import annotations

import logging
import warnings

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
LIGHTNING_RANK_ZERO = "lightning.pytorch.utilities.rank_zero"
DROPPED = ("litlogger", "LitLogger", "to estimate number of stepping batches")
ONCE_PER_PROCESS = ("GPU available:", "TPU available:")
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_FALLBACK = "Setting accelerator to CPU"


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of `words`; with `once`, lets the first of each through."""

    def __init__(self, words: tuple[str, ...], once: bool = False) -> None:
        super().__init__()
        self.words = words
        self.once = once
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(word in message for word in self.words):
            return True
        if self.once and message not in self._seen:
            self._seen.add(message)
            return True
        return False


def _add_filter_once(logger: logging.Logger, words: tuple[str, ...], once: bool = False) -> None:
    if not any(isinstance(f, _DropMessages) and f.words == words for f in logger.filters):
        logger.addFilter(_DropMessages(words, once))


def quiet_console() -> None:
    """Call once Hydra has configured logging (inside the Hydra main function)."""
    import lightning.pytorch  # noqa: F401  (its import adds the handlers removed here)
    import torch

    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True  # to Hydra's console and train.log handlers
    # Lightning 2.6 calls torch's deprecated pytree API once per fit: nothing a user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    rank_zero = logging.getLogger(LIGHTNING_RANK_ZERO)
    _add_filter_once(rank_zero, DROPPED)
    _add_filter_once(rank_zero, ONCE_PER_PROCESS, once=True)
    if not torch.cuda.is_available():  # DeepSpeed's logger, before DeepSpeed (if ever) imports and warns
        _add_filter_once(logging.getLogger(DEEPSPEED_LOGGER), (DEEPSPEED_CPU_FALLBACK,))
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        pass
    else:
        hf_logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:
        return
    datasets.disable_progress_bars()
