"""The target's hidden states of a sequence's verified positions, as a proposer receives them (`observe_target`)."""

from __future__ import annotations

import torch

from specdistill.decoding.proposers.base import TargetHidden


class VerifiedStates:
    """The target's states of positions `0 .. F - 1` of one sequence, `F` its verified length, the layers a proposer
    reads concatenated: `rows` `(F, sum of their widths)` (None before the first verification).

    Every verification hands over the states of the positions it ran on (`observe`): rows from `start` on are
    replaced by the new rows of positions that stay in the sequence; stale rows (rejected candidates) are dropped.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.rows is None else self.rows.shape[0]

    def observe(self, verified: TargetHidden) -> None:
        """Keep the rows of `verified` below its `verified_length`, after this sequence's rows before its `start`."""
        kept = verified.verified_length - verified.start
        fresh = torch.cat([states[:kept] for states in verified.states], dim=-1)
        old = self.rows[: verified.start] if self.rows is not None else fresh[:0]
        self.rows = torch.cat([old, fresh], dim=0)
