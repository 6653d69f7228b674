"""The EAGLE-3 draft kind, whole: the head (`model.py`), the kind that trains, exports and loads it (`kind.py`),
heads in other trainers' layouts (`foreign.py`), its proposer (`proposer.py`) and the `speculators` export
(`export.py`)."""

from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head
from specdistill.drafts.eagle3.proposer import Eagle3Proposer

__all__ = ["Eagle3", "Eagle3Config", "Eagle3Head", "Eagle3Proposer"]
