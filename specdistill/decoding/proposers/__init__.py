"""Proposers: what drafts the speculative-decoding engine's candidates (`base.py` states the contract)."""

from specdistill.decoding.proposers.base import (
    BlockProposer,
    BlockRequest,
    DraftBlock,
    Drafter,
    DraftProposal,
    Proposer,
    TargetHidden,
    WrappingProposer,
)
from specdistill.decoding.proposers.chain import ChainProposer
from specdistill.decoding.proposers.draft_lm import DraftLMProposer
from specdistill.decoding.proposers.eagle3 import Eagle3Proposer
from specdistill.decoding.proposers.hybrid import HybridProposer
from specdistill.decoding.proposers.prompt_lookup import PromptLookupProposer

__all__ = [
    "BlockProposer",
    "BlockRequest",
    "ChainProposer",
    "DraftBlock",
    "DraftLMProposer",
    "Drafter",
    "DraftProposal",
    "Eagle3Proposer",
    "HybridProposer",
    "PromptLookupProposer",
    "Proposer",
    "TargetHidden",
    "WrappingProposer",
]
