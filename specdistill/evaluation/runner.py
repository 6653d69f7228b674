"""Run the autoregressive target and every draft x policy on the same prompts, in one process, and report.

Fairness: every configuration decodes the same prompts with the same `max_new_tokens`, the same sampling warpers
and, per prompt, a generator seeded with `seed + prompt index`; each configuration first runs `warmup` untimed
generations so one-time start-up costs do not land on whichever runs first. `speedup` divides by the baseline's
tokens/s measured in the same call.

Honesty: choosing a draft length K or a threshold on the split you report is selection on the test set. The
selection helpers (`select_policy`, `best_fixed_length`) take the split their prompts come from and refuse "test":
select on validation, then report the chosen policy on test with `evaluate_policies`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


def _run(
    generate: Callable[[list[int], torch.Generator], GenerationResult],
    prompts: Sequence[Mapping[str, Any]],
    seed: int,
    warmup: int,
    tokenizer,
    score_fn: ScoreFn | None,
    keep_outputs: bool,
    desc: str = "decode",
) -> tuple[DecodingStats, list[dict[str, Any]], float | None, int]:
    for i in range(warmup):
        generate(list(prompts[i % len(prompts)]["prompt_ids"]), torch.Generator().manual_seed(seed - 1 - i))
    stats: list[DecodingStats] = []
    outputs: list[dict[str, Any]] = []
    scores: list[float] = []
    # the bar ticks between generations; each generation times itself, so it costs no measured time
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt", leave=False)):
        result = generate(list(prompt["prompt_ids"]), torch.Generator().manual_seed(seed + i))
        stats.append(result.stats)
        text = tokenizer.decode(result.tokens, skip_special_tokens=True) if tokenizer is not None else None
        score = None
        if score_fn is not None:
            score = score_fn(text if tokenizer is not None else result.tokens, prompt["record"])
            if score is not None:
                scores.append(float(score))
        if keep_outputs:
            outputs.append(
                {"example_id": prompt["example_id"], "tokens": result.tokens, "text": text, "score": score}
            )
    task_metric = sum(scores) / len(scores) if scores else None
    return DecodingStats.sum(stats), outputs, task_metric, len(scores)


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
) -> Report:
    """Decode `prompts` with the target alone and with every draft x policy; score and time each run.

    Args:
        target: the target causal LM (eval mode, on its device).
        drafts: draft name -> draft model.
        policies: policy name -> `DraftPolicy` (policies are reset per sequence, so one object serves all drafts).
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
        baseline: run the autoregressive target first (needed for `speedup`).
        warmup: untimed generations per configuration before the timed ones.
        keep_outputs: keep per-prompt outputs (written to outputs.jsonl by `Report.save`).
        task_metric_name: label of the task metric in the table (e.g. the task's `metric_name`).
        split: the split the prompts come from, recorded in the report settings.
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

    def entry(name: str, draft: str | None, policy: str | None, generate) -> ReportEntry:
        stats, outputs, task_metric, num_scored = _run(
            generate, prompts, seed, warmup, tokenizer, score_fn, keep_outputs, desc=name
        )
        return ReportEntry(name, draft, policy, stats, task_metric, num_scored, outputs)

    entries: list[ReportEntry] = []
    if baseline:

        def ar(ids: list[int], gen: torch.Generator) -> GenerationResult:
            return autoregressive(target, ids, max_new_tokens, sampling, eos, vocab, gen)

        entries.append(entry(BASELINE_NAME, None, None, ar))
    for draft_name, policy_name in combinations:
        decoder = SpeculativeDecoder(target, drafts[draft_name], policies[policy_name], sampling, eos, vocab)

        def spec(ids: list[int], gen: torch.Generator, decoder=decoder) -> GenerationResult:
            return decoder.generate(ids, max_new_tokens, gen)

        entries.append(entry(f"{draft_name}/{policy_name}", draft_name, policy_name, spec))
    settings = {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "warmup": warmup,
        "sampling": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "greedy": sampling.is_greedy,
        },
        "vocab_size": vocab,
        "task_metric_name": task_metric_name,
        "split": split,
        "device": str(next(target.parameters()).device),
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
) -> tuple[str, dict[str, float | None]]:
    """Pick the candidate policy with the highest `criterion` on a selection split (never "test").

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
        keep_outputs=False,
        split=split,
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

    Returns:
        (best K, tokens_per_second per K).
    """
    if not ks:
        raise ValueError("ks is empty: give the draft lengths to try, e.g. [1, 2, 3, 4, 5, 6, 8]")
    candidates = {str(k): FixedLength(k) for k in ks}
    best, values = select_policy(
        target, draft, candidates, prompts, sampling, max_new_tokens, split, seed, **kwargs
    )
    return int(best), {int(k): v for k, v in values.items()}
