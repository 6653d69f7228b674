"""Proposers: what drafts the speculative-decoding engine's candidates (`base.py` states the contract)."""

from specdistill.decoding.proposers.base import DraftProposal, Proposer, TargetHidden
from specdistill.decoding.proposers.draft_lm import DraftLMProposer

__all__ = ["DraftLMProposer", "DraftProposal", "Proposer", "TargetHidden"]
