"""Greedy outputs against the autoregressive target's: how many are identical, and where one departs, by how much.

Greedy speculative decoding is lossless in exact arithmetic. In a low-precision dtype (bfloat16) the target's pass
that verifies several tokens sums in another order than its one-token steps, so where the target's two best logits
lie within rounding of each other the two runs may pick different tokens, and from there the outputs part. For every
speculative configuration `output_agreement` compares each output with the autoregressive target's; at the first
position where they part it runs the target once over the common prefix (in the target's own dtype) and measures
the gap between its two best logits in units in the last place (ulp) of the larger one in that dtype. A departure
whose gap is at most `NEAR_TIE_ULPS` is a near tie, what rounding explains; a wider one is a real loss of exactness
(a bug, or a nondeterministic kernel) and the report shows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

# a departure at a gap of at most this many ulps of the target's dtype is counted as a near tie
NEAR_TIE_ULPS = 4.0


@dataclass(frozen=True)
class Departure:
    """Where one output first parts from the target's and the target's margin there.

    Attributes:
        example_id: the prompt's example.
        position: index in the output of the first token that differs (or where one output ends early).
        gap: the target's best logit minus its second best after the common prefix, in the target's dtype.
        ulps: `gap` in units in the last place of the best logit in that dtype.
        near_tie: `ulps <= NEAR_TIE_ULPS`.
    """

    example_id: Any
    position: int
    gap: float
    ulps: float
    near_tie: bool


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (one ending early counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at `value` (its unit in the last place)."""
    info = torch.finfo(dtype)
    magnitude = abs(value)
    if magnitude < info.tiny:
        return info.tiny * info.eps
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


@torch.no_grad()
def top_two_gap(target: torch.nn.Module, ids: Sequence[int], vocab_size: int) -> tuple[float, float]:
    """`(gap, ulps)`: the target's best next-token logit after `ids` minus its second best, over the real vocabulary,
    computed in the target's dtype, and that gap in ulps of the best logit."""
    device = next(target.parameters()).device
    logits = target(input_ids=torch.tensor([list(ids)], device=device)).logits[0, -1, :vocab_size]
    best, second = torch.topk(logits, 2).values.tolist()
    gap = best - second
    return gap, gap / ulp(best, logits.dtype)


def output_agreement(
    target: torch.nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    reference: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    vocab_size: int,
) -> dict[str, Any]:
    """Compare `outputs` with the target's own `reference` outputs, prompt by prompt.

    Args:
        target: the target causal LM, in the dtype it decoded in.
        prompts: the prompt dicts decoded (`prompt_ids`, `example_id`), in the outputs' order.
        reference / outputs: per prompt `{"tokens": [...]}`: the autoregressive target's and a configuration's.
        vocab_size: the tokenizer's real vocabulary (padded logit rows are ignored).

    Returns:
        `{"outputs": n, "identical": m, "near_ties": k, "departures": [Departure as dict, ...]}`.
    """
    if not len(prompts) == len(reference) == len(outputs):
        raise ValueError(
            f"{len(prompts)} prompts, {len(reference)} reference outputs and {len(outputs)} outputs: compare the "
            "outputs of the same prompts"
        )
    departures = []
    for prompt, ours, theirs in zip(prompts, reference, outputs, strict=True):
        position = first_difference(ours["tokens"], theirs["tokens"])
        if position is None:
            continue
        gap, ulps = top_two_gap(target, [*prompt["prompt_ids"], *ours["tokens"][:position]], vocab_size)
        departures.append(Departure(prompt["example_id"], position, gap, ulps, ulps <= NEAR_TIE_ULPS))
    return {
        "outputs": len(outputs),
        "identical": len(outputs) - len(departures),
        "near_ties": sum(d.near_tie for d in departures),
        "departures": [asdict(d) for d in departures],
    }


def format_agreement(agreement: Mapping[str, Mapping[str, Any]], dtype: torch.dtype) -> str:
    """Console lines: how many configurations gave the target's greedy outputs on every prompt, then one line per
    configuration that did not (identical outputs, departures at near ties, the widest gap)."""
    whole = [name for name, a in agreement.items() if a["identical"] == a["outputs"]]
    prompts = max((a["outputs"] for a in agreement.values()), default=0)
    lines = [
        f"greedy outputs identical to the target's ({str(dtype).removeprefix('torch.')}): {len(whole)} of "
        f"{len(agreement)} configurations on all {prompts} prompts"
    ]
    for name, a in agreement.items():
        if name in whole:
            continue
        widest = max(d["ulps"] for d in a["departures"])
        lines.append(
            f"  {name}: {a['identical']}/{a['outputs']} identical; {a['near_ties']} of {len(a['departures'])} "
            f"departures at near ties (top-two gap <= {NEAR_TIE_ULPS:g} ulp), widest gap {widest:.1f} ulp"
        )
    return "\n".join(lines)
