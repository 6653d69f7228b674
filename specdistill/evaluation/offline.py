"""Offline acceptance: tokens per target call at each fixed K from teacher-forced passes, without decoding.

Greedy speculative decoding with a fixed draft length K is a deterministic walk over the sequence it produces, which
is the target's own greedy output. Where the last emitted token is at position `t` (the round's anchor), the draft
proposes `c[t, 0..K-1]`; the target accepts the leading candidates that equal the sequence's next tokens
`x[t+1], x[t+2], ...` (its `run[t]`) and adds one token of its own. A draft's `j`-th candidate after `j` accepted
ones was drafted after exactly the sequence's own tokens, so every `c[t, j]` comes from one teacher-forced pass over
the sequence: a causal-LM draft's argmax at position `t + j`; an EAGLE-3 head's step `j` of its training-time-test
unroll anchored at `t` (`DraftKind.chain_candidates`); prompt lookup's continuation of `x[:t+1]`.

`fixed_length_calls` replays the walk (the engine's rules: a prefill-only first round for a proposer that drafts
from the target's states, K capped by the token budget, nothing emitted past the end), so for a causal-LM draft the
estimate equals the decoded `tokens_per_target_call` up to ties that a batched verification rounds differently; for
an EAGLE-3 head it also shows how far the unroll's steps are from the decoding proposer's. Sampled decoding has no
such walk: the estimate is for greedy decoding only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specdistill.decoding.cost import tokens_per_cost
from specdistill.drafts.base import NO_CANDIDATE
from specdistill.drafts.prompt_lookup.proposer import lookup_match
from specdistill.evaluation.report import Report


def accepted_runs(candidates: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`(T,)` how many leading candidates the target accepts at each anchor under greedy verification.

    Args:
        candidates: `(T, J)` the draft's candidates after anchor `t` (`NO_CANDIDATE` where it proposes none).
        tokens: `(T,)` the sequence (prompt and the target's greedy output).

    Returns:
        `run[t]`: the largest `r <= J` with `candidates[t, j] == tokens[t + 1 + j]` for every `j < r` (candidates past
        the end never match).
    """
    length, depth = candidates.shape
    if tokens.shape != (length,):
        raise ValueError(
            f"candidates {tuple(candidates.shape)} and tokens {tuple(tokens.shape)} disagree in length"
        )
    padded = torch.cat([tokens, tokens.new_full((depth + 1,), NO_CANDIDATE)])
    following = padded.unfold(0, depth, 1)[1 : length + 1]  # (T, J): tokens[t + 1 + j]
    match = (candidates == following) & (following != NO_CANDIDATE)
    # leading matches: the cumulative product stays 1 until the first miss
    return match.long().cumprod(dim=1).sum(dim=1)


def fixed_length_calls(
    runs: Sequence[int],
    prompt_length: int,
    max_new_tokens: int,
    draft_length: int,
    prefill_round: bool = False,
) -> int:
    """Target calls of greedy decoding at fixed `draft_length` that emits `len(runs) - prompt_length` tokens.

    Args:
        runs: `accepted_runs` over the sequence (prompt and output).
        prompt_length: tokens before the output; the first anchor is the prompt's last token.
        max_new_tokens: the engine's budget: a round drafts at most `budget left - 1` candidates.
        draft_length: K (>= 0).
        prefill_round: the first round drafts nothing (a proposer that drafts from the target's states).
    """
    if prompt_length < 1:
        raise ValueError(
            f"prompt_length must be >= 1 (the first anchor is the prompt's last token), got {prompt_length}"
        )
    end = len(runs)
    if end - prompt_length > max_new_tokens:
        # the walk could not go on past the budget (no round may draft): refuse rather than loop forever
        raise ValueError(
            f"the sequence holds {end - prompt_length} output tokens, more than max_new_tokens={max_new_tokens}: "
            "give the budget the outputs were generated under (and sequences generated under it)"
        )
    t, calls = prompt_length - 1, 0
    while t < end - 1:
        emitted = t + 1 - prompt_length
        cap = 0 if (prefill_round and calls == 0) else min(draft_length, max_new_tokens - emitted - 1)
        t += min(min(int(runs[t]), cap) + 1, end - 1 - t)
        calls += 1
    return calls


def tokens_per_target_call(
    runs: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    draft_length: int,
    prefill_round: bool = False,
) -> float | None:
    """Generated tokens over target calls, summed over sequences as the decoded figure is; None without output."""
    tokens = sum(len(r) - p for r, p in zip(runs, prompt_lengths, strict=True))
    calls = sum(
        fixed_length_calls(r.tolist(), p, max_new_tokens, draft_length, prefill_round)
        for r, p in zip(runs, prompt_lengths, strict=True)
    )
    return tokens / calls if calls else None


def lookup_blocks(
    tokens: torch.Tensor, min_ngram: int, max_ngram: int, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup after every anchor (`lookup_match` of `tokens[:t + 1]`): `(T, depth)` its block, and `(T,)` the
    length of the suffix it matched (0: none; the hybrid's fitted choice reads it)."""
    out = tokens.new_full((tokens.numel(), depth), NO_CANDIDATE)
    lengths = torch.zeros(tokens.numel(), dtype=torch.long)
    for t in range(tokens.numel()):
        lengths[t], block = lookup_match(tokens[: t + 1], min_ngram, max_ngram, depth)
        out[t, : block.numel()] = block
    return out, lengths


def hybrid_candidates(
    lookup: torch.Tensor,
    draft: torch.Tensor,
    draft_length: int | None = None,
    from_lookup: torch.Tensor | None = None,
) -> torch.Tensor:
    """The hybrid's candidates (`HybridProposer`): lookup's block where it drafts, else the draft's chain, cut after
    `draft_length` candidates (None: uncut). `from_lookup` `(T,)` bool marks the anchors where lookup drafts (its
    `lookup_lengths`, `specdistill.drafts.prompt_lookup.choice.lookup_rows`); None: wherever it found a match."""
    if draft_length is not None:
        draft = draft.clone()
        draft[:, draft_length:] = NO_CANDIDATE
    found = lookup[:, :1] != NO_CANDIDATE
    if from_lookup is not None:
        found = found & from_lookup[:, None]
    return torch.where(found, lookup, draft)


def offline_table(
    candidates: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    draft_lengths: Sequence[int],
    prefill_rounds: Mapping[str, bool],
) -> dict[str, dict[int, float | None]]:
    """name -> {K: offline tokens per target call} over `sequences`.

    Args:
        candidates: name -> `sequence (T,) -> (T, max(draft_lengths))` candidates.
        sequences / prompt_lengths: each prompt with the target's greedy output after it, and the prompt's length.
        max_new_tokens: the decoding budget the outputs were generated under.
        draft_lengths: the K grid.
        prefill_rounds: name -> whether its first round only prefills.
    """
    out: dict[str, dict[int, float | None]] = {}
    for name, propose in candidates.items():
        runs = [accepted_runs(propose(seq), seq) for seq in sequences]
        out[name] = {
            k: tokens_per_target_call(
                runs, prompt_lengths, max_new_tokens, k, prefill_rounds.get(name, False)
            )
            for k in draft_lengths
        }
    return out


def format_offline(
    table: Mapping[str, Mapping[int, float | None]], decoded: Mapping[str, tuple[int, float]]
) -> str:
    """Console lines: each draft's offline tokens per target call by K, and beside it the decoded figure at its K."""
    lines = ["offline tokens/target call (teacher-forced, greedy):"]
    for name, by_k in table.items():
        cells = "  ".join(f"K={k} {v:.3f}" if v is not None else f"K={k} -" for k, v in by_k.items())
        line = f"  {name:<28} {cells}"
        if name in decoded:
            k, value = decoded[name]
            line += f"  | decoded K={k} {value:.3f}"
        lines.append(line)
    return "\n".join(lines)


def decoded_sequences(
    report: Report, prompts: Sequence[Mapping[str, Any]]
) -> tuple[list[torch.Tensor], list[int]]:
    """Each test prompt followed by the autoregressive target's output in `report` (its first pass), and the
    prompts' lengths: the sequences greedy speculative decoding produces too."""
    baseline = report.baseline
    if baseline is None or len(baseline.outputs) != len(prompts):
        raise ValueError(
            "the offline estimate reads the autoregressive target's kept outputs: evaluate with the baseline and "
            "keep_outputs"
        )
    sequences = [
        torch.tensor([*prompt["prompt_ids"], *output["tokens"]], dtype=torch.long)
        for prompt, output in zip(prompts, baseline.outputs, strict=True)
    ]
    return sequences, [len(prompt["prompt_ids"]) for prompt in prompts]


def decoded_fixed_lengths(report: Report, names: Sequence[str]) -> dict[str, tuple[int, float]]:
    """name -> (K, decoded tokens per target call) of its first `<name>/fixed_k<K>` entry in `report`."""
    out: dict[str, tuple[int, float]] = {}
    for entry in report.entries:
        if entry.draft in names and entry.draft not in out and (entry.policy or "").startswith("fixed_k"):
            value = entry.stats.metrics()["tokens_per_target_call"]
            if value is not None:
                out[entry.draft] = (int(entry.policy.removeprefix("fixed_k")), value)
    return out


def format_cost(cost: Mapping[int, float], table: Mapping[str, Mapping[int, float | None]]) -> str:
    """Console lines: the target's verification cost by tokens verified, and each drafter's best offline tokens per
    unit of target cost (`tokens_per_cost`: a drafter that costs nothing reaches it as its speedup)."""
    curve = "  ".join(f"n={n} {c:.2f}" for n, c in cost.items())
    lines = [f"target verification cost (x one token, n tokens in one pass): {curve}"]
    for name, by_k in table.items():
        per_cost = tokens_per_cost(by_k, cost)
        if per_cost:
            k = max(per_cost, key=per_cost.__getitem__)
            lines.append(f"  {name:<28} tokens per unit of target cost, best K={k}: {per_cost[k]:.3f}")
    return "\n".join(lines)
