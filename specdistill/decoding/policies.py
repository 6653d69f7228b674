"""Draft-length policies: small objects that decide, within a round, when the draft stops proposing.

Contract with the engine (`specdistill/decoding/engine.py`):

- `reset()` is called once per generated sequence, `begin_round()` at the start of every round.
- After each drafted candidate the engine builds a `DraftStep` and calls `should_stop(step)`; drafting ends when it
  returns True, when `step.index == max_draft_length`, or when the candidate is EOS. The engine never asks before
  `min_draft_length` candidates exist.
- After verification the engine calls `end_round(num_drafted, num_accepted)` (feedback for schedules).
- A policy that sets `needs_hidden_states` receives the draft's last hidden state (after the final norm). With
  `feed_newest = False` (the public SpecDec++ code) `step.hidden` is the state whose *input* was the previous
  candidate (the newest candidate is not yet fed back, so it cannot be scored); with `feed_newest = True` the engine
  feeds the newest candidate to the draft before asking, and `step.hidden` is the state whose input is
  `step.token`.
- A policy that sets `needs_oracle` gets `step.will_accept`: whether the target will accept this candidate, computed
  honestly from the target by the engine outside the timed and counted work.

Concrete policies live in this module (fixed, heuristic schedule, confidence, entropy, oracle) and in
`specdistill/decoding/head_policy.py` (SpecDec++ acceptance head); `conf/policy/*.yaml` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftStep:
    """What the engine tells a policy after drafting one candidate.

    Attributes:
        index: 1-based number of candidates drafted so far in this round (the newest is candidate `index`).
        token: id of the newest candidate.
        draft_probs: `(V,)` warped draft distribution the newest candidate was sampled from.
        hidden: `(H,)` draft last hidden state (see module docstring for which input it belongs to), or None.
        will_accept: for oracle policies only, whether the target accepts this candidate; else None.
    """

    index: int
    token: int
    draft_probs: torch.Tensor
    hidden: torch.Tensor | None = None
    will_accept: bool | None = None


class DraftPolicy:
    """Base class: subclasses override `should_stop` and, if they keep state, the round hooks."""

    max_draft_length: int = 20
    min_draft_length: int = 1
    needs_hidden_states: bool = False
    feed_newest: bool = False
    needs_oracle: bool = False

    def reset(self) -> None:
        """Start a new sequence."""

    def begin_round(self) -> None:
        """Start a new drafting round."""

    def should_stop(self, step: DraftStep) -> bool:
        raise NotImplementedError

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        """Feedback after the target verified the round's candidates."""
