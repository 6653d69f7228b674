"""Proposers: what drafts the speculative-decoding engine's candidates (`base.py` states the contract); the
adapters every kind shares are here, each kind's own proposer in its folder (`specdistill.drafts.<kind>`)."""

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

__all__ = [
    "BlockProposer",
    "BlockRequest",
    "ChainProposer",
    "DraftBlock",
    "DraftLMProposer",
    "Drafter",
    "DraftProposal",
    "Proposer",
    "TargetHidden",
    "WrappingProposer",
]
