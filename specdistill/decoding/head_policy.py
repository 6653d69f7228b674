"""SpecDec++ draft-length policy: stop drafting once the acceptance head predicts a likely rejection.

Within a round the policy keeps `P_acc`, the product of the head's predicted acceptance over the candidates scored
so far, and answers "stop" as soon as `1 - P_acc > threshold` (docs/METHODS.md section 4). The engine asks after
every candidate (so `P_acc` covers all of them) and owns the bounds: it ignores a stop before the policy's
`min_draft_length` (default 2, as in the public SpecDec++ code), stops at its own `max_draft_length` (20 by
default, as in SpecDec++) and at EOS.

Which candidates are scored depends on `score_newest`:

- `False` (the public SpecDec++ code; engine `feed_newest = False`): a candidate is scored once it has been fed back
  to the draft, so at step `index` the hidden state belongs to candidate `index - 1` and the newest candidate is
  unscored. At index 1 the hidden state belongs to the last accepted token, which is no candidate and is not scored.
- `True` (engine `feed_newest = True`): the engine feeds the newest candidate first and the head scores it, so the
  decision at step `index` covers candidates `1..index`.

A proposer head (`AcceptanceHead.input == "proposer"`) scores candidate `index` from the state that proposed it, which
the engine already has at step `index` without feeding anything: its decisions cover candidates `1..index` at the
public rule's cost (`score_newest` must stay False; `scores_newest` is True).

With `withdraw=True` (this project's extension) the candidate a stop lands on is *withdrawn* (`DraftPolicy.
withdraws_stop`): the head predicted it rejected, so the target verifies only the candidates before it and tests it
on the row the bonus token would have come from. A round whose first candidate is withdrawn costs the target one
token's verification, as plain decoding does, and still emits that candidate if the target agrees. It needs the
decision to cover the withdrawn candidate, so a policy that scores the newest candidate (`scores_newest`).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdistill.decoding.policies import DraftPolicy, DraftStep
from specdistill.models.acceptance_head import AcceptanceHead


def _check_threshold(threshold: float) -> None:
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold={threshold} must be in [0, 1) (SpecDec++ uses 0.3, 0.5 or 0.7).")


def _check_min_length(min_draft_length: int) -> None:
    if isinstance(min_draft_length, bool) or not isinstance(min_draft_length, int) or min_draft_length < 1:
        raise ValueError(f"min_draft_length must be an int >= 1, got {min_draft_length!r}.")


def head_should_stop(acceptance_product: float, threshold: float) -> bool:
    """The SpecDec++ stopping rule: stop when the predicted probability of at least one rejection exceeds `h`.

    Args:
        acceptance_product: `P_acc`, product of predicted acceptance of the candidates scored so far (1 if none).
        threshold: `h`; the rule is `1 - P_acc > h` (strict). Bounds on the length are the engine's, not the rule's.
    """
    return 1.0 - acceptance_product > threshold


def simulate_draft_length(
    acceptance_probs: Sequence[float],
    threshold: float,
    min_draft_length: int = 2,
    max_draft_length: int = 20,
    score_newest: bool = False,
) -> int:
    """Number of candidates the engine drafts with this policy when candidate i would get predicted acceptance
    `acceptance_probs[i-1]`.

    Offline twin of `AcceptanceHeadPolicy` inside `SpeculativeDecoder` (same rule, same scoring offset, and the
    engine's bounds: a stop before `min_draft_length` is ignored, `max_draft_length` always stops), used to test and
    to reason about it. `acceptance_probs` must cover every candidate that may be scored (at least
    `max_draft_length` values, or fewer if the rule stops earlier).
    """
    _check_threshold(threshold)
    _check_min_length(min_draft_length)
    if max_draft_length < min_draft_length:
        raise ValueError(
            f"need min_draft_length <= max_draft_length, got {min_draft_length} and {max_draft_length}."
        )
    product = 1.0
    for index in range(1, max_draft_length + 1):
        scored = index if score_newest else index - 1
        if scored >= 1:
            if scored > len(acceptance_probs):
                raise ValueError(
                    f"acceptance_probs has {len(acceptance_probs)} values; candidate {scored} needs one."
                )
            product *= float(acceptance_probs[scored - 1])
        if index >= min_draft_length and head_should_stop(product, threshold):
            return index
    return max_draft_length


class AcceptanceHeadPolicy(DraftPolicy):
    """Stops drafting when the acceptance head predicts that at least one candidate of the round is rejected.

    Args:
        head: trained `AcceptanceHead` for this draft (moved to the draft's device and dtype by the caller, or lazily
            to the hidden state's device on first use).
        threshold: `h` in the stopping rule `1 - P_acc > h`.
        min_draft_length: fewest candidates per round (the public code drafts at least 2); stored as the
            `min_draft_length` attribute, which the engine enforces. The engine still asks after every candidate,
            so `P_acc` covers all of them; the policy's answer before the minimum is ignored.
        score_newest: score the newest candidate (engine feeds it first) instead of the public code's one-behind
            scoring; see the module docstring.
        withdraw: withdraw the candidate a stop lands on (see the module docstring); needs `scores_newest`.
    """

    needs_hidden_states = True

    def __init__(
        self,
        head: AcceptanceHead,
        threshold: float = 0.5,
        min_draft_length: int = 2,
        score_newest: bool = False,
        withdraw: bool = False,
    ) -> None:
        _check_threshold(threshold)
        _check_min_length(min_draft_length)
        self.head = head.eval().requires_grad_(False)
        self.threshold = float(threshold)
        self.min_draft_length = min_draft_length
        if head.uses_proposer and score_newest:
            raise ValueError(
                "score_newest=True feeds each candidate to the draft before scoring it, which only a candidate head "
                "needs: a proposer head scores the newest candidate from the state that proposed it. Use "
                "score_newest=False."
            )
        self.score_newest = bool(score_newest)
        self.feed_newest = self.score_newest
        self.scores_newest = self.score_newest or head.uses_proposer
        if withdraw and not self.scores_newest:
            raise ValueError(
                "withdraw=True takes out the candidate the head stops on, so the head must have scored it: the "
                "public rule (score_newest=False) leaves the newest candidate of a candidate head unscored. Use "
                "score_newest=True, or a proposer head."
            )
        self.withdraws_stop = bool(withdraw)
        self._head_device = head.out.weight.device
        self.acceptance_product = 1.0
        self.scored_probs: list[float] = []

    def reset(self, max_draft_length: int | None = None) -> None:
        self.begin_round()

    def begin_round(self) -> None:
        self.acceptance_product = 1.0
        self.scored_probs = []

    def should_stop(self, step: DraftStep) -> bool:
        # A candidate head without score_newest sees, at index 1, the state of the last accepted token: no candidate.
        scores_a_candidate = self.scores_newest or step.index >= 2
        if scores_a_candidate:
            if step.hidden is None:
                raise ValueError(
                    "AcceptanceHeadPolicy needs step.hidden (the draft's last hidden state): the engine must honour "
                    "needs_hidden_states."
                )
            if step.hidden.device != self._head_device:
                self.head.to(step.hidden.device)
                self._head_device = step.hidden.device
            prob = self.head.score(step.hidden, step.draft_probs, step.token)
            self.scored_probs.append(prob)
            self.acceptance_product *= prob
        return head_should_stop(self.acceptance_product, self.threshold)


def head_policy_grid(
    head: AcceptanceHead,
    thresholds: Sequence[float],
    score_newest: bool | Sequence[bool] = False,
    min_draft_length: int = 2,
    withdraw: bool | Sequence[bool] = False,
) -> dict[str, AcceptanceHeadPolicy]:
    """One policy per threshold h, scoring mode and withdrawal, named `acceptance_head_h{h}` (`_newest` for
    `score_newest=True`, `_withdrawn` for `withdraw=True`).

    The candidates a selection on validation chooses from. A proposer head always scores the newest candidate, so it
    gets one policy per h and withdrawal whatever `score_newest`. Withdrawing policies are built only for the scoring
    modes that score the newest candidate (see `AcceptanceHeadPolicy`).

    Raises:
        ValueError: `withdraw` asks for withdrawing policies, but no scoring mode scores the newest candidate.
    """
    modes = [bool(score_newest)] if isinstance(score_newest, bool) else [bool(m) for m in score_newest]
    if head.uses_proposer:
        modes = [False]
    withdrawals = [bool(withdraw)] if isinstance(withdraw, bool) else [bool(w) for w in withdraw]
    combos = [
        (newest, drop)
        for newest in dict.fromkeys(modes)
        for drop in dict.fromkeys(withdrawals)
        if not drop or newest or head.uses_proposer
    ]
    if True in withdrawals and not any(drop for _, drop in combos):
        raise ValueError(
            "withdrawn stops need a head policy that scores the newest candidate: this candidate head is scored by "
            "the public rule only (evaluate.acceptance_head.score_newest=false): add score_newest=true (or [false, "
            "true]), or leave withdrawn out of evaluate.acceptance_head.stops"
        )
    return {
        f"acceptance_head_h{h}{'_newest' if newest else ''}{'_withdrawn' if drop else ''}": AcceptanceHeadPolicy(
            head, h, min_draft_length, score_newest=newest, withdraw=drop
        )
        for h in thresholds
        for newest, drop in combos
    }
