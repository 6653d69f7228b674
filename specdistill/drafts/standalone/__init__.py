"""The standalone draft kind: a small causal LM of the target's tokenizer, loaded by hub id or path (`kind.py`)."""

from specdistill.drafts.standalone.kind import Standalone

__all__ = ["Standalone"]
