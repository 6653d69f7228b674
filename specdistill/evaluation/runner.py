"""Run the autoregressive target and every draft x policy on the same prompts, in one process, and report.

Fairness: every configuration decodes the same prompts with the same `max_new_tokens`, the same sampling warpers,
the same engine bound `max_draft_length` (the most candidates per round, for every policy) and, per prompt, a
generator seeded with `seed + prompt index`; each configuration first runs `warmup` untimed
generations so one-time start-up costs do not land on whichever runs first. `speedup` divides by the baseline's
tokens/s measured in the same call.

Timing: the configurations are interleaved prompt by prompt, not run one block each. For prompt i every
configuration decodes it once, in an order rotated by i (no configuration is always first), then prompt i + 1, and so
on over `repeats` passes; each generation times itself (`DecodingStats.wall_time_s`) and a configuration's tokens/s
is all its tokens / all its time. On a shared machine the speed drifts by tens of percent over minutes (other jobs,
clocks); with one block per configuration that drift lands on whichever configuration's block it coincides with
(docs/NOTES.md has a case), while interleaved it hits every configuration within seconds of the others. Interleaving changes no output: each generation has its own seeded generator, and a
policy object shared by several configurations is copied per configuration, so every configuration decodes exactly
what it would alone. The whole evaluation protocol (selection of K and h, then the test run) is
`specdistill/evaluation/protocol.py`, which the evaluate stage and `benchmarks/bench_pipeline_policies.py` call.

Honesty: choosing a draft length K or a threshold on the split you report is selection on the test set. The
selection helpers (`select_policy`, `best_fixed_length`) take the split their prompts come from and refuse "test":
select on validation, then report the chosen policy on test with `evaluate_policies`.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from specdistill.decoding.engine import GenerationResult, SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import DraftPolicy, FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import METRIC_NAMES, DecodingStats
from specdistill.evaluation.report import BASELINE_NAME, Report, ReportEntry

ScoreFn = Callable[[Any, Mapping[str, Any]], float | None]
PROMPT_KEYS = ("prompt_ids", "record", "example_id")


def _check_prompts(prompts: Sequence[Mapping[str, Any]]) -> None:
    if not prompts:
        raise ValueError(
            "no prompts to evaluate: the split is empty (check max_examples and the split name)."
        )
    for i, p in enumerate(prompts):
        missing = [k for k in PROMPT_KEYS if k not in p]
        if missing:
            raise ValueError(
                f"prompt {i} lacks {missing}: each prompt is a dict with keys {list(PROMPT_KEYS)}."
            )


def _resolve_vocab(tokenizer, vocab_size: int | None) -> int:
    if vocab_size is not None:
        return vocab_size
    if tokenizer is None:
        raise ValueError("pass vocab_size (the tokenizer's real vocabulary) when no tokenizer is given.")
    return len(tokenizer)


def _resolve_eos(tokenizer, eos_token_id: int | Sequence[int] | None) -> int | Sequence[int] | None:
    if eos_token_id is not None or tokenizer is None:
        return eos_token_id
    return tokenizer.eos_token_id


Generate = Callable[[list[int], torch.Generator], GenerationResult]


@dataclass
class _Config:
    """One configuration being evaluated and what its generations have accumulated so far."""

    name: str
    draft: str | None
    policy: str | None
    generate: Generate
    stats: list[DecodingStats] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def record(
        self,
        result: GenerationResult,
        prompt: Mapping[str, Any],
        tokenizer,
        score_fn: ScoreFn | None,
        keep_output: bool,
    ) -> None:
        """Add one generation's stats; with `keep_output` (first pass only) also score and keep its output."""
        self.stats.append(result.stats)
        if not keep_output:
            return
        text = tokenizer.decode(result.tokens, skip_special_tokens=True) if tokenizer is not None else None
        score = None
        if score_fn is not None:
            score = score_fn(text if tokenizer is not None else result.tokens, prompt["record"])
            if score is not None:
                self.scores.append(float(score))
        self.outputs.append(
            {"example_id": prompt["example_id"], "tokens": result.tokens, "text": text, "score": score}
        )

    def entry(self, keep_outputs: bool) -> ReportEntry:
        task_metric = sum(self.scores) / len(self.scores) if self.scores else None
        outputs = self.outputs if keep_outputs else []
        return ReportEntry(
            self.name,
            self.draft,
            self.policy,
            DecodingStats.sum(self.stats),
            task_metric,
            len(self.scores),
            outputs,
        )


def _rotated(items: Sequence[_Config], step: int) -> list[_Config]:
    """`items` rotated left by `step` (mod its length): no configuration always decodes first."""
    shift = step % len(items)
    return [*items[shift:], *items[:shift]]


def _interleave(
    configs: Sequence[_Config],
    prompts: Sequence[Mapping[str, Any]],
    seed: int,
    warmup: int,
    repeats: int,
    device: torch.device,
    tokenizer,
    score_fn: ScoreFn | None,
    split: str | None = None,
) -> None:
    """Warm every configuration up, then decode prompt by prompt, every configuration once per prompt and pass."""

    if not configs:
        return

    def generator(
        s: int,
    ) -> torch.Generator:  # on the models' device: the engine refuses a CPU one for CUDA models
        return torch.Generator(device).manual_seed(s)

    for config in configs:
        for i in range(warmup):
            config.generate(list(prompts[i % len(prompts)]["prompt_ids"]), generator(seed - 1 - i))
    steps = [(r, i) for r in range(repeats) for i in range(len(prompts))]
    # the bar ticks between generations; each generation times itself, so it costs no measured time
    label = f"{split} split" if split else "evaluate"  # the selection split's passes, then the test split's
    plural = "s" if len(configs) != 1 else ""
    bar = tqdm(steps, desc=f"{label}: {len(configs)} configuration{plural}", unit="prompt", leave=False)
    for step, (r, i) in enumerate(bar):
        prompt = prompts[i]
        # every configuration decodes this prompt within moments of the others, first in turn: machine drift (other
        # jobs, clocks, thermal) then lands on all of them alike instead of on whichever block of prompts it hits
        for config in _rotated(configs, step):
            result = config.generate(list(prompt["prompt_ids"]), generator(seed + i))
            config.record(result, prompt, tokenizer, score_fn, keep_output=r == 0)


def evaluate_policies(
    target: torch.nn.Module,
    drafts: Mapping[str, torch.nn.Module],
    policies: Mapping[str, DraftPolicy],
    prompts: Sequence[Mapping[str, Any]],
    score_fn: ScoreFn | None,
    tokenizer,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int = 0,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    vocab_size: int | None = None,
    combinations: Sequence[tuple[str, str]] | None = None,
    baseline: bool = True,
    warmup: int = 1,
    keep_outputs: bool = True,
    task_metric_name: str | None = None,
    split: str | None = None,
    repeats: int = 1,
    max_draft_length: int = 20,
) -> Report:
    """Decode `prompts` with the target alone and with every draft x policy; score and time each run.

    The configurations are timed interleaved, prompt by prompt in a rotating order (see the module docstring), so
    machine drift during the call hits all of them alike.

    Args:
        target: the target causal LM (eval mode, on its device).
        drafts: draft name -> what the engine drafts with (`DraftKind.proposer`; a causal-LM draft: the model).
        policies: policy name -> `DraftPolicy`; one object may serve several drafts (each configuration then gets
            its own copy, so state a policy keeps across sequences never mixes drafts).
        prompts: dicts with `prompt_ids` (list of ids), `record` (the dataset record given to `score_fn`) and
            `example_id`.
        score_fn: `score_fn(text, record)` (or `score_fn(token_ids, record)` when `tokenizer` is None) -> task
            score or None (not scorable); e.g. `task.score`. None skips the task metric.
        tokenizer: decodes outputs (skip_special_tokens) and gives `vocab_size` / `eos_token_id` defaults.
        sampling: shared warping; greedy for exact token-level comparison with the baseline.
        max_new_tokens: generation budget per prompt.
        seed: prompt i uses a generator seeded with `seed + i` in every configuration.
        eos_token_id: overrides `tokenizer.eos_token_id`.
        vocab_size: overrides `len(tokenizer)` (the real vocabulary: padded logit rows are ignored).
        combinations: (draft name, policy name) pairs to run, e.g. to pair an acceptance-head policy with the draft
            it was trained on; default every pair.
        baseline: also run the autoregressive target (needed for `speedup`); it is entry 0 of the report.
        warmup: untimed generations per configuration, all done before the first timed one.
        keep_outputs: keep per-prompt outputs (written to outputs.jsonl by `Report.save`).
        task_metric_name: label of the task metric in the table (e.g. the task's `metric_name`).
        split: the split the prompts come from, recorded in the report settings.
        repeats: timed passes over all prompts; stats (tokens, time, counters) are summed over every pass, while
            outputs, scores and the task metric come from the first pass only (with sampling, later passes reuse
            the same seeds and so decode the same tokens).
        max_draft_length: the engine's bound, most candidates per round, passed to every `SpeculativeDecoder`.
    """
    _check_prompts(prompts)
    vocab = _resolve_vocab(tokenizer, vocab_size)
    eos = _resolve_eos(tokenizer, eos_token_id)
    if combinations is None:
        combinations = [(d, p) for d in drafts for p in policies]
    for d, p in combinations:
        if d not in drafts or p not in policies:
            raise ValueError(f"combination ({d!r}, {p!r}) names an unknown draft or policy")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (timed passes over the prompts), got {repeats!r}")

    device = next(target.parameters()).device

    configs: list[_Config] = []
    if baseline:

        def ar(ids: list[int], gen: torch.Generator) -> GenerationResult:
            return autoregressive(target, ids, max_new_tokens, sampling, eos, vocab, gen)

        configs.append(_Config(BASELINE_NAME, None, None, ar))
    uses = Counter(id(policies[p]) for _, p in combinations)
    for draft_name, policy_name in combinations:
        policy = policies[policy_name]
        # interleaved runs would feed one shared policy object the sequences of several drafts in turn; a policy
        # that keeps state across sequences (HeuristicSchedule(persistent=True)) gets a copy per configuration so
        # each configuration behaves exactly as it would alone
        if uses[id(policy)] > 1:
            policy = copy.deepcopy(policy)
        decoder = SpeculativeDecoder(
            target, drafts[draft_name], policy, sampling, eos, vocab, max_draft_length=max_draft_length
        )

        def spec(ids: list[int], gen: torch.Generator, decoder=decoder) -> GenerationResult:
            return decoder.generate(ids, max_new_tokens, gen)

        configs.append(_Config(f"{draft_name}/{policy_name}", draft_name, policy_name, spec))
    _interleave(configs, prompts, seed, warmup, repeats, device, tokenizer, score_fn, split)
    entries = [config.entry(keep_outputs) for config in configs]
    settings = {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "warmup": warmup,
        "repeats": repeats,
        "max_draft_length": max_draft_length,
        "sampling": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "greedy": sampling.is_greedy,
        },
        "vocab_size": vocab,
        "task_metric_name": task_metric_name,
        "split": split,
        "device": str(device),
    }
    return Report(entries, settings)


def _check_selection_split(split: str) -> None:
    if not isinstance(split, str) or not split:
        raise ValueError("name the split the selection prompts come from (e.g. split='validation').")
    if split.lower() == "test":
        raise ValueError(
            "refusing to select a policy on the test split: that tunes on the numbers you report. Select on "
            "'validation' (or a held-out part of train), then evaluate the chosen policy on test."
        )


def select_policy(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    candidates: Mapping[str, DraftPolicy],
    prompts: Sequence[Mapping[str, Any]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    split: str,
    seed: int = 0,
    criterion: str = "tokens_per_second",
    *,
    tokenizer=None,
    eos_token_id: int | Sequence[int] | None = None,
    vocab_size: int | None = None,
    warmup: int = 1,
    repeats: int = 1,
    max_draft_length: int = 20,
) -> tuple[str, dict[str, float | None]]:
    """Pick the candidate policy with the highest `criterion` on a selection split (never "test").

    The candidates are timed interleaved like `evaluate_policies` (no autoregressive baseline); `repeats` passes;
    every engine gets the bound `max_draft_length` (use the one the chosen policy will be reported with).

    Returns:
        (best candidate name, criterion value per candidate).
    """
    _check_selection_split(split)
    if criterion not in METRIC_NAMES:
        raise ValueError(f"criterion must be one of {METRIC_NAMES}, got {criterion!r}")
    if not candidates:
        raise ValueError("no candidate policies to select from")
    report = evaluate_policies(
        target,
        {"draft": draft},
        candidates,
        prompts,
        None,
        tokenizer,
        sampling,
        max_new_tokens,
        seed,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        baseline=False,
        warmup=warmup,
        repeats=repeats,
        keep_outputs=False,
        split=split,
        max_draft_length=max_draft_length,
    )
    values = {e.policy: e.stats.metrics()[criterion] for e in report.entries}
    scored = {name: v for name, v in values.items() if v is not None}
    if not scored:
        raise ValueError(f"no candidate has a defined {criterion} (did every run generate nothing?)")
    return max(scored, key=scored.__getitem__), values


def best_fixed_length(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    ks: Sequence[int],
    prompts: Sequence[Mapping[str, Any]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    split: str,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[int, dict[int, float | None]]:
    """The best `FixedLength(K)` over `ks` by tokens_per_second on a selection split (never "test").

    `kwargs` go to `select_policy` (criterion, tokenizer, vocab_size, warmup, repeats, max_draft_length, ...); every
    K must be <= `max_draft_length` (default 20), which would otherwise silently cut it.

    Returns:
        (best K, tokens_per_second per K).
    """
    if not ks:
        raise ValueError("ks is empty: give the draft lengths to try, e.g. [1, 2, 3, 4, 5, 6, 8]")
    bound = kwargs.get("max_draft_length", 20)
    if max(ks) > bound:
        raise ValueError(f"fixed lengths {list(ks)} exceed the engine's max_draft_length={bound}")
    candidates = {str(k): FixedLength(k) for k in ks}
    best, values = select_policy(
        target, draft, candidates, prompts, sampling, max_new_tokens, split, seed, **kwargs
    )
    return int(best), {int(k): v for k, v in values.items()}
