"""Proposers: what drafts the speculative-decoding engine's candidates (`base.py` states the contract)."""

from specdistill.decoding.proposers.base import DraftProposal, Proposer, TargetHidden
from specdistill.decoding.proposers.draft_lm import DraftLMProposer
from specdistill.decoding.proposers.eagle3 import Eagle3Proposer

__all__ = ["DraftLMProposer", "Eagle3Proposer", "DraftProposal", "Proposer", "TargetHidden"]
