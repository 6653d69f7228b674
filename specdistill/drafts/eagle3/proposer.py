"""An EAGLE-3 head as the proposer: the proposer of every head on the target's hidden states
(`specdistill.drafts.target_heads.proposer`, whose module docstring gives the drafting rule), on an `Eagle3Head`.

EAGLE position `t` reads the target's fused states of sequence position `t` and the token `t + 1`, and scores
position `t + 2` (`specdistill.drafts.eagle3.model`); down a draft chain it reads its own pre-norm output, bypassing
`fc`. Draft id `i` is target id `i + d2t[i]`; every other target id gets draft probability 0.
"""

from __future__ import annotations

from specdistill.drafts.eagle3.model import Eagle3Head
from specdistill.drafts.target_heads.proposer import TargetHeadProposer


class Eagle3Proposer(TargetHeadProposer):
    """Drafts with an `Eagle3Head` on the target's states at its `aux_layer_ids`.

    Args:
        head: the EAGLE-3 head in eval mode, with the target's input embeddings attached.
        vocab_size: the tokenizer's real vocabulary; every draft-vocabulary id must lie below it.
    """

    head: Eagle3Head
