"""Prompt lookup, the draft that trains nothing: n-gram matches against the prompt and the text so far
(`proposer.py`), the hybrid that drafts from a lookup match or else from a trained draft (`hybrid.py`), and the
settings of vLLM's `ngram` method (`export.py`)."""

from specdistill.drafts.prompt_lookup.hybrid import HybridProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer

__all__ = ["HybridProposer", "PromptLookupProposer"]
