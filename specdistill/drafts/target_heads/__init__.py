"""What every draft head that reads the target's hidden states shares, whatever its architecture.

- `head.py`: `TargetStateHead`, the protocol such a head implements (the target layers it reads, how a position
  consumes the target's states or its own previous output, its cache and its draft vocabulary);
- `states.py`: `VerifiedStates`, the target's states of the verified positions, kept from `observe_target`;
- `proposer.py`: `TargetHeadProposer`, the engine's proposer for any `TargetStateHead`;
- `export.py`: writing a head's weights and config, naming the target as its verifier (`verifier_of`) and the
  fields every vLLM `speculators` checkpoint carries.

EAGLE-3 (`specdistill.drafts.eagle3`) is one such head; a second one implements the protocol and reuses the rest.
"""

from specdistill.drafts.target_heads.head import HeadCache, HeadOutput, TargetStateHead
from specdistill.drafts.target_heads.proposer import TargetHeadProposer
from specdistill.drafts.target_heads.states import VerifiedStates

__all__ = ["HeadCache", "HeadOutput", "TargetHeadProposer", "TargetStateHead", "VerifiedStates"]
