"""Per-run speculative-decoding statistics, with the metric names of docs/METHODS.md section 0.

Counters are summed over rounds, sequences and prompts (`DecodingStats.merge` / `+`) and the metrics are derived
from the sums only at the end, so aggregating many prompts weights every token equally.

Definitions (a *round* is one target verification call; the candidates of a round are tested left to right and
testing stops at the first rejection):

- `acceptance_rate` = accepted / (accepted + rejected); at most one rejection per round, candidates after it ignored.
- `accepted_per_draft` = accepted / drafted (wasted tail candidates count as drafted).
- `tokens_per_target_call` = generated / target forward passes.
- `mean_draft_length` = drafted / rounds.  `discard_rate` = (drafted - accepted) / generated.
- `tokens_per_second` = generated / wall time (oracle probing excluded).
- `acceptance_by_position[i]` = accepted / tested at 1-based candidate position i + 1 (list index i).

A metric whose denominator is zero (e.g. `acceptance_rate` of the autoregressive baseline) is None, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METRIC_NAMES: tuple[str, ...] = (
    "acceptance_rate",
    "accepted_per_draft",
    "tokens_per_target_call",
    "mean_draft_length",
    "discard_rate",
    "tokens_per_second",
)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    out = [0] * max(len(a), len(b))
    for i, v in enumerate(a):
        out[i] += v
    for i, v in enumerate(b):
        out[i] += v
    return out


@dataclass
class DecodingStats:
    """Summable counters of one or many generations.

    Attributes:
        sequences: generations merged into these counters.
        generated_tokens: tokens emitted (prompt excluded, nothing past EOS or max_new_tokens).
        rounds: target verification calls of the speculative engine (0 for the autoregressive baseline).
        drafted_tokens: candidates sent to the target.
        accepted_tokens: candidates accepted by the target.
        rejected_tokens: rounds that ended with a rejected candidate (at most one per round).
        target_forwards: target forward passes (prefill included; oracle probes excluded).
        draft_forwards: draft forward passes.
        target_time_s: wall time inside target forwards (and their verification maths).
        draft_time_s: wall time inside draft forwards (and their sampling).
        wall_time_s: wall time of the whole generation, oracle probing excluded.
        oracle_probe_time_s: wall time of the oracle's target probes (excluded from every other timing).
        tested_by_position: index i counts candidates at position i + 1 that were tested (all before accepted).
        accepted_by_position: index i counts candidates at position i + 1 that were accepted.
        draft_length_hist: index L counts rounds with L drafted candidates.
    """

    sequences: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    wall_time_s: float = 0.0
    oracle_probe_time_s: float = 0.0
    tested_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_length_hist: list[int] = field(default_factory=list)

    def record_round(self, num_drafted: int, num_accepted: int, rejected: bool) -> None:
        """Count one verification round.

        Args:
            num_drafted: candidates sent to the target this round.
            num_accepted: how many of them (a prefix) were accepted.
            rejected: whether a candidate was rejected (so `num_accepted + 1` candidates were tested).
        """
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafted ({num_drafted})")
        if rejected and num_accepted == num_drafted:
            raise ValueError("a round with a rejection must have fewer accepted than drafted candidates")
        self.rounds += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.rejected_tokens += int(rejected)
        tested = num_accepted + int(rejected)
        if len(self.tested_by_position) < tested:
            grow = tested - len(self.tested_by_position)
            self.tested_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(tested):
            self.tested_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1
        if len(self.draft_length_hist) <= num_drafted:
            self.draft_length_hist.extend([0] * (num_drafted + 1 - len(self.draft_length_hist)))
        self.draft_length_hist[num_drafted] += 1

    def merge(self, other: DecodingStats) -> DecodingStats:
        """A new `DecodingStats` holding the sums of both."""
        out = DecodingStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, _add_lists(a, b) if isinstance(a, list) else a + b)
        return out

    __add__ = merge

    @classmethod
    def sum(cls, items: list[DecodingStats]) -> DecodingStats:
        """Sum of many stats (an empty list gives zero counters)."""
        out = cls()
        for item in items:
            out = out.merge(item)
        return out

    @property
    def discarded_tokens(self) -> int:
        """Drafted candidates that were not accepted (rejected ones and the wasted tail after them)."""
        return self.drafted_tokens - self.accepted_tokens

    def metrics(self) -> dict[str, float | None]:
        """The docs/METHODS.md section 0 metrics (`speedup` needs a baseline: see `speedup`)."""
        return {
            "acceptance_rate": _ratio(self.accepted_tokens, self.accepted_tokens + self.rejected_tokens),
            "accepted_per_draft": _ratio(self.accepted_tokens, self.drafted_tokens),
            "tokens_per_target_call": _ratio(self.generated_tokens, self.target_forwards),
            "mean_draft_length": _ratio(self.drafted_tokens, self.rounds),
            "discard_rate": _ratio(self.discarded_tokens, self.generated_tokens),
            "tokens_per_second": _ratio(self.generated_tokens, self.wall_time_s),
        }

    def acceptance_by_position(self) -> list[float | None]:
        """Conditional acceptance at each candidate position: index i is position i + 1."""
        return [_ratio(a, t) for a, t in zip(self.accepted_by_position, self.tested_by_position, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        """Metrics, raw counters and per-position tables, JSON-serialisable."""
        out: dict[str, Any] = dict(self.metrics())
        for f in fields(self):
            out[f.name] = (
                list(getattr(self, f.name))
                if f.name.endswith(("position", "hist"))
                else getattr(self, f.name)
            )
        out["discarded_tokens"] = self.discarded_tokens
        out["acceptance_by_position"] = self.acceptance_by_position()
        return out


def speedup(stats: DecodingStats, baseline: DecodingStats) -> float | None:
    """`speedup` = tokens_per_second / autoregressive tokens_per_second (both measured in the same process)."""
    ours = stats.metrics()["tokens_per_second"]
    base = baseline.metrics()["tokens_per_second"]
    if ours is None or not base:
        return None
    return ours / base
