"""Draft-length policies: small objects that answer, after each drafted candidate, "stop drafting now?".

Contract with the engine (`specdistill/decoding/engine.py`):

- The engine owns every bound on the draft length. `SpeculativeDecoder(max_draft_length=...)` is the most candidates
  per round (further capped by the remaining token budget); a policy's only bound is its `min_draft_length`
  attribute (data, default 1), which the engine reads and enforces. No policy checks a bound itself.
- `reset(max_draft_length)` is called once per generated sequence with the engine's bound (information for
  schedules, see `HeuristicSchedule`; None when a policy is driven without an engine), `begin_round()` at the start
  of every round.
- After *every* drafted candidate the engine builds a `DraftStep` and calls `should_stop(step)`, so a policy observes
  all candidates (the acceptance head's product P_acc needs them). Drafting ends when
  `(step.index >= min_draft_length and should_stop(step))`, when `step.index` reaches the engine's cap, or when the
  candidate is EOS; an answer given before `min_draft_length` is ignored.
- After verification the engine calls `end_round(num_drafted, num_accepted)` (feedback for schedules).
- A policy that sets `needs_hidden_states` receives the draft's last hidden state (after the final norm). With
  `feed_newest = False` (the public SpecDec++ code) `step.hidden` is the state whose *input* was the previous
  candidate (the newest candidate is not yet fed back, so it cannot be scored); with `feed_newest = True` the engine
  feeds the newest candidate to the draft before asking, and `step.hidden` is the state whose input is
  `step.token`.
- A policy that sets `needs_oracle` gets `step.will_accept`: whether the target will accept this candidate, computed
  honestly from the target by the engine outside the timed and counted work.
- A policy that sets `withdraws_stop` (extension: `Oracle`, and `AcceptanceHeadPolicy(withdraw=True)`) has the
  candidate its stop lands on *withdrawn*: the target verifies the candidates before it (`k` of them, `k + 1`
  tokens), and the withdrawn one is tested on the last of those rows, the one the bonus token would come from. If
  the target accepts it, it is emitted and the round has no bonus token; if not, the round emits what a rejection
  emits (greedy: the target's argmax; sampling: a sample from norm(max(0, p - q)) with that candidate's q). It is
  the ordinary test of candidate `k + 1`, so output stays lossless whatever made the policy stop; it is counted as
  drafted only if accepted. The oracle stops only on candidates it knows will be rejected; a head withdraws the
  candidate it predicts rejected, saving the target one verified token.
- `step.draft_probs` is the warped distribution the candidate was sampled from; in greedy mode (where that is
  one-hot and carries no information) it is the softmax of the draft's raw logits, i.e. the draft's confidence.

Concrete policies live in this module (fixed, heuristic schedule, confidence, entropy, oracle) and in
`specdistill/decoding/head_policy.py` (SpecDec++ acceptance head); `CostPadded` moves another policy's stops to where
the target's verification costs no more (`specdistill/decoding/cost.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.decoding.cost import padded_length


@dataclass
class DraftStep:
    """What the engine tells a policy after drafting one candidate.

    Attributes:
        index: 1-based number of candidates drafted so far in this round (the newest is candidate `index`).
        token: id of the newest candidate.
        draft_probs: `(V,)` warped draft distribution the newest candidate was sampled from (greedy mode:
            softmax of the raw draft logits).
        hidden: `(H,)` draft last hidden state (see module docstring for which input it belongs to), or None.
        will_accept: for oracle policies only, whether the target accepts this candidate; else None.
    """

    index: int
    token: int
    draft_probs: torch.Tensor
    hidden: torch.Tensor | None = None
    will_accept: bool | None = None


class DraftPolicy:
    """Base class: subclasses override `should_stop` and, if they keep state, the sequence and round hooks.

    Attributes:
        min_draft_length: fewest candidates per round (>= 1); the engine ignores `should_stop` before it. The only
            bound a policy declares: the most candidates per round is the engine's `max_draft_length`.
        needs_hidden_states / feed_newest / needs_oracle / withdraws_stop: see the module docstring.
    """

    min_draft_length: int = 1
    needs_hidden_states: bool = False
    feed_newest: bool = False
    needs_oracle: bool = False
    withdraws_stop: bool = False

    def reset(self, max_draft_length: int | None = None) -> None:
        """Start a new sequence decoded under the engine's bound `max_draft_length` (None: no engine, no bound)."""

    def begin_round(self) -> None:
        """Start a new drafting round."""

    def should_stop(self, step: DraftStep) -> bool:
        """Whether drafting should end after candidate `step.index` (asked after every candidate)."""
        raise NotImplementedError

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        """Feedback after the target verified the round's candidates."""


def _check_int(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_probability(name: str, value: float, *, allow_zero: bool = False) -> float:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be a probability in {interval}, got {value!r}")
    return float(value)


class FixedLength(DraftPolicy):
    """Draft `k` candidates per round: vanilla speculative decoding. It answers `index >= k`.

    Fewer only at EOS, at the end of the token budget, or at the engine's `max_draft_length` when `k` exceeds it.

    Args:
        k: candidates per round, >= 1.
    """

    def __init__(self, k: int = 5) -> None:
        self.k = _check_int("k", k, 1)

    def should_stop(self, step: DraftStep) -> bool:
        return step.index >= self.k


class HeuristicSchedule(DraftPolicy):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: +2 after a fully accepted round, -1 otherwise.

    The schedule's length `current` never drops below 1. transformers lets it grow without bound; here it never
    grows past the engine's `max_draft_length`, which the engine passes to `reset` (the schedule does not enforce
    that bound, the engine does; the schedule only stops *counting* past it). Without that cap a long run of
    accepted rounds would push `current` far above what the engine drafts, and as many partial rounds would be
    needed before the drafted length moved again. Driven without an engine (`reset()` with no bound) it grows
    without bound, like transformers. With `persistent=False` (default, transformers' "heuristic_transient") every
    sequence starts again from `initial`; with `persistent=True` (transformers' "heuristic") the length carries over
    between sequences (capped at the bound of the engine that starts the next one).

    Args:
        initial: draft length of the first round, >= 1 (the engine caps it at its `max_draft_length`).
        persistent: keep the learnt length across `reset()`.
    """

    def __init__(self, initial: int = 5, persistent: bool = False) -> None:
        self.initial = _check_int("initial", initial, 1)
        self.persistent = bool(persistent)
        self.current = self.initial
        self._bound: int | None = None

    def reset(self, max_draft_length: int | None = None) -> None:
        self._bound = max_draft_length
        if not self.persistent:
            self.current = self.initial
        if self._bound is not None:
            self.current = min(self.current, self._bound)

    def should_stop(self, step: DraftStep) -> bool:
        return step.index >= self.current

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:  # nothing was proposed (token budget exhausted): no evidence either way
            return
        if num_accepted == num_drafted:
            grown = self.current + 2
            self.current = grown if self._bound is None else min(grown, self._bound)
        else:
            self.current = max(1, self.current - 1)


class ConfidenceThreshold(DraftPolicy):
    """Stop once the draft's probability of its own newest candidate is below `threshold`.

    transformers' `assistant_confidence_threshold` (static here: transformers also re-tunes it online from an ROC
    curve when scikit-learn is installed). The low-confidence candidate itself is still sent to the target.

    Args:
        threshold: in (0, 1]; 0.4 is transformers' default.
    """

    def __init__(self, threshold: float = 0.4) -> None:
        self.threshold = _check_probability("threshold", threshold)

    def should_stop(self, step: DraftStep) -> bool:
        return float(step.draft_probs[step.token]) < self.threshold


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of `(..., V)` probabilities (zeros contribute 0) -> `(...)`."""
    probs = probs.float()
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return -(probs * logs).sum(-1)


class EntropyThreshold(DraftPolicy):
    """Stop once the entropy (nats) of the draft distribution of the newest candidate exceeds `threshold`.

    The training-free entropy rule of SVIP / AdaEDL: a spread-out draft distribution predicts a rejection. The
    uncertain candidate itself is still sent to the target.

    Args:
        threshold: entropy in nats, > 0 (log V is the uniform distribution's).
    """

    def __init__(self, threshold: float = 1.0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold > 0:
            raise ValueError(f"threshold must be an entropy in nats > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def should_stop(self, step: DraftStep) -> bool:
        return float(entropy(step.draft_probs)) > self.threshold


class Oracle(DraftPolicy):
    """Drafts exactly the candidates the target will accept: an upper bound for every draft-length policy.

    The engine tells it `step.will_accept` from a target probe (excluded from timings and forward counts); it stops
    at the first candidate that will be rejected and withdraws it (see the module docstring), so every drafted
    candidate is accepted. Greedy mode: a candidate is accepted iff it equals the target's argmax, exactly. Sampling
    mode: the probe uses the same uniform draw u_i that the real verification uses for candidate i (the randomness
    is coupled per position), so the probe and the real round agree; the withdrawn candidate's token is replaced by
    a residual sample, exactly as after a rejection. Stopping at the first rejection or at the engine's
    `max_draft_length` is the termination rule of plain speculative sampling with K = that bound, so the output
    distribution is the target's. The draft forward that produced the withdrawn candidate is real work and is
    counted. It has no bound of its own: the engine's `max_draft_length` (20 by default, as in SpecDec++) applies.
    """

    needs_oracle = True
    withdraws_stop = True

    def should_stop(self, step: DraftStep) -> bool:
        if step.will_accept is None:
            raise ValueError(
                "Oracle needs step.will_accept: run it with the SpeculativeDecoder (needs_oracle)."
            )
        return not step.will_accept


class CostPadded(DraftPolicy):
    """`inner`'s stops, moved later for free: when `inner` stops at candidate k, drafting goes on to the most
    candidates m whose verification (`m + 1` tokens) costs the target no more than k's (`padded_length` on `cost`).

    For drafters whose extra candidates cost no drafting pass, only their scoring: a block drafter that drafts its
    whole block in one pass (DFlash; `BlockProposer.drafts_in_one_pass`), where the policy chooses how much of the
    block the target verifies.
    On a CPU whose cost curve is not monotone (float32 here: 4 tokens cheaper than 3) a head that stops after 2
    candidates then sends 3. `inner` is asked after every candidate until it stops, so a head's product covers
    them all; the engine's bounds apply to the padded length too.

    Args:
        inner: the policy whose stops are padded (not an oracle, nor one that withdraws the candidate it stops on:
            withdrawing takes a candidate out of verification, padding adds more).
        cost: relative verification cost of `n` tokens (`n = 1` costs 1), e.g. `cached_verification_cost`.
    """

    def __init__(self, inner: DraftPolicy, cost: dict[int, float]) -> None:
        if inner.needs_oracle or inner.withdraws_stop:
            raise ValueError(
                f"CostPadded pads a policy's stop with more candidates: {type(inner).__name__} withdraws the "
                "candidate it stops on (an oracle, or a head policy with withdraw=True) and cannot be padded"
            )
        if not cost or 1 not in cost:
            raise ValueError(f"cost must be a relative cost table with n = 1, got {dict(cost)!r}")
        self.inner = inner
        self.cost = dict(cost)
        self.min_draft_length = inner.min_draft_length
        self.needs_hidden_states = inner.needs_hidden_states
        self.feed_newest = inner.feed_newest
        self._bound: int | None = None
        self._stop_at: int | None = None

    def reset(self, max_draft_length: int | None = None) -> None:
        self._bound = max_draft_length
        self._stop_at = None
        self.inner.reset(max_draft_length)

    def begin_round(self) -> None:
        self._stop_at = None
        self.inner.begin_round()

    def should_stop(self, step: DraftStep) -> bool:
        if self._stop_at is None:
            # the engine ignores a stop before min_draft_length: so does the padding
            if not (self.inner.should_stop(step) and step.index >= self.min_draft_length):
                return False
            cap = max(self.cost) - 1 if self._bound is None else min(self._bound, max(self.cost) - 1)
            self._stop_at = padded_length(step.index, self.cost, cap)
        return step.index >= self._stop_at

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        self.inner.end_round(num_drafted, num_accepted)
