"""Decoding speed: our engine vs transformers' assisted generation at equal K, in one process, greedy.

    python benchmarks/bench_decoding.py [--k 4] [--prompts 8] [--max-new-tokens 96] [--repeats 3] [--threads 1]
    python benchmarks/bench_decoding.py --target PATH --draft PATH   # trained exports (HF directories)
    python benchmarks/bench_decoding.py --config models=smollm2_135m draft=cut_layers_3 task=humaneval_package
        [--draft PATH]   # a pair and prompts from the project's configs (the real pair: README), prompts from the
                         # task's test split; --draft replaces the config's (untrained) draft with a trained export

Without paths it builds the toy pair of the brief: a GPT-NeoX target (hidden 256, 4 layers, intermediate 1024,
vocab 512) and draft (hidden 96, 2 layers), and distils the draft on the target's sampled continuations for a few
hundred steps (forward KL on full distributions) so that the draft agrees with the target often enough for
speculation to matter. Prompts are random token ids.

Methods, each over the same prompts and `max_new_tokens`, round-robin over `--repeats` passes so machine drift hits
all of them alike; tokens/s = all tokens / all time of the timed passes (one warm-up pass first):

- `hf_autoregressive`: `target.generate(do_sample=False)`;  `autoregressive`: our baseline loop.
- `hf_assisted_k{K}`: `generate(assistant_model=draft)` with the draft's generation config set to
  `num_assistant_tokens=K`, `num_assistant_tokens_schedule="constant"`, `assistant_confidence_threshold=0` (which
  disables both the confidence stop and its online re-tuning).
- with `--lookup`, prompt lookup, no draft model: `hf_lookup_k{K}` is `generate(prompt_lookup_num_tokens=K,
  max_matching_ngram_size=--lookup-max)`, `ours_lookup_k{K}` our engine with `PromptLookupProposer(1, --lookup-max)`
  and `FixedLength(K)` (the same matching rule: the longest suffix n-gram, its earliest occurrence).
- `ours_fixed_k{K}`, `ours_heuristic`, `ours_confidence`, `ours_entropy`, `ours_oracle`: `SpeculativeDecoder` with
  its default bound of 20 candidates per round (the oracle's target probes, `oracle_probe_time_s`, are subtracted
  from its time); `--policies oracle` times only that one besides fixed K, `--policies` alone none.

On CPU with models this small every forward costs about the same fixed Python overhead, so a draft step is nearly as
expensive as a target step and speculation itself loses to plain decoding; what this benchmark measures is the
engine's overhead against transformers' at equal K. One run on a shared 2-core machine (8 prompts x 96 tokens,
3 passes, 1 thread): ours_fixed_k4 174 tokens/s vs hf_assisted_k4 128 (1.36x), all greedy outputs identical.

`--dtype bfloat16` runs both models in bf16 (the dtype a CPU with bf16 units serves in). Multi-token verification
then rounds differently from one token at a time, so greedy outputs may part from the autoregressive ones where the
target's top two logits nearly tie: the table says which methods differ, and the check below is left to float32.

Checks (exit status 1 if one fails): every method's greedy output equals `hf_autoregressive`'s token for token, and
`ours_fixed_k{K}` is at least as fast as `hf_assisted_k{K}` (reported; `--no-speed-check` to only print).
`--lookup --no-draft` times the autoregressive target and prompt lookup alone (the speed check then has nothing
to compare).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import (
    ConfidenceThreshold,
    DraftPolicy,
    EntropyThreshold,
    FixedLength,
    HeuristicSchedule,
    Oracle,
)
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.decoding.toy import tiny_gpt_neox
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer

VOCAB = 512
GREEDY = SamplingConfig(greedy=True)
# our adaptive policies, each built from the fixed-K comparison's K
POLICIES: dict[str, Callable[[int], DraftPolicy]] = {
    "heuristic": lambda k: HeuristicSchedule(initial=k),
    "confidence": lambda k: ConfidenceThreshold(0.4),
    "entropy": lambda k: EntropyThreshold(1.0),
    "oracle": lambda k: Oracle(),
}


def gpt_neox(
    hidden: int, layers: int, heads: int, intermediate: int, seed: int, init: float
) -> GPTNeoXForCausalLM:
    """A trainable random GPT-NeoX (`tiny_gpt_neox` returns frozen ones)."""
    model = tiny_gpt_neox(
        VOCAB, hidden, layers, heads, intermediate, init, max_position_embeddings=1024, seed=seed
    )
    return model.train().requires_grad_(True)


def distil(target, draft, steps: int, batch: int, length: int, seed: int) -> float:
    """Train `draft` for `steps` on target-sampled sequences (forward KL on every position); return the final loss."""
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        prompts = torch.randint(0, VOCAB, (4 * batch, 8), generator=gen)
        torch.manual_seed(seed)
        data = target.generate(
            prompts, do_sample=True, max_new_tokens=length - 8, min_new_tokens=length - 8, pad_token_id=0
        )
        teacher = target(data).logits.log_softmax(-1)
    data, teacher = data.clone(), teacher.clone()
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        rows = torch.randint(0, data.shape[0], (batch,), generator=gen)
        logits = draft(data[rows]).logits.float()
        log_q = logits.log_softmax(-1)
        log_p = teacher[rows]
        loss = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:  # linear decay keeps the last steps from bouncing around
            group["lr"] = 3e-3 * (1 - (step + 1) / steps) + 1e-4
    draft.eval().requires_grad_(False)
    return float(loss)


def build_toy_pair(distill_steps: int) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    # initializer_range 0.1 makes the random target's predictions peaked: clear argmaxes (no near-ties that make
    # greedy outputs depend on floating-point summation order) and something learnable for the draft.
    target = gpt_neox(256, 4, 4, 1024, seed=0, init=0.1).eval().requires_grad_(False)
    draft = gpt_neox(96, 2, 4, 384, seed=1, init=0.1)
    start = time.perf_counter()
    loss = distil(target, draft, distill_steps, batch=16, length=96, seed=0)
    print(
        f"distilled the draft for {distill_steps} steps in {time.perf_counter() - start:.1f}s (final KL {loss:.3f})"
    )
    return target, draft, VOCAB


def load_pair(target_path: str, draft_path: str) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    target = AutoModelForCausalLM.from_pretrained(target_path).eval().requires_grad_(False)
    draft = AutoModelForCausalLM.from_pretrained(draft_path).eval().requires_grad_(False)
    vocab = min(target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0])
    try:
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(target_path))
    except (OSError, ValueError):
        print(f"no tokenizer in {target_path}: comparing logits on the first {vocab} rows")
    return target, draft, vocab


def config_pair(
    overrides: list[str], draft_path: str | None, count: int
) -> tuple[torch.nn.Module, torch.nn.Module, int, list[list[int]]]:
    """Target, draft, vocabulary and `count` test prompts (token ids) from the project's Hydra configs, as `train.py`
    composes them; `draft_path` (an export) replaces the draft the config builds (e.g. an untrained cut)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from specdistill.drafts import load_draft
    from specdistill.models import load_model
    from specdistill.models.loading import freeze

    with initialize_config_dir(
        config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"
    ):
        cfg = compose("train", overrides=overrides)
    tokenizer = instantiate(cfg.models.tokenizer)
    vocab = len(tokenizer)
    target = freeze(load_model(instantiate(cfg.models.target)))
    if draft_path is not None:
        draft = freeze(load_draft(draft_path, vocab_size=vocab, target=target).proposer(vocab))
    elif cfg.get("draft") is not None:
        draft = freeze(instantiate(cfg.draft).build(target, vocab))
    else:
        draft = freeze(load_model(instantiate(cfg.models.draft)))
    task = instantiate(cfg.task)
    records = task.load_split("test")
    prompts = [
        tokenizer(task.prompt(r))["input_ids"] for r in records.select(range(min(count, len(records))))
    ]
    return target, draft, vocab, prompts


def hf_generate(
    target, draft, k: int | None, lookup_max: int | None = None
) -> Callable[[list[int], int], list[int]]:
    if draft is not None:
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=target.device)
        kwargs = {"assistant_model": draft} if draft is not None else {}
        if lookup_max is not None:
            kwargs = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": lookup_max}
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
        return out[0, len(prompt) :].tolist()

    return run


def ours(target, draft, policy: DraftPolicy | None, vocab: int, stats: list[DecodingStats]):
    decoder = SpeculativeDecoder(target, draft, policy, GREEDY, None, vocab) if policy is not None else None

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        if decoder is None:
            result = autoregressive(target, prompt, max_new_tokens, GREEDY, None, vocab)
        else:
            result = decoder.generate(prompt, max_new_tokens)
        stats.append(result.stats)
        return result.tokens

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="trained target export (HF directory); default: toy pair")
    parser.add_argument("--draft", help="trained draft export (HF directory)")
    parser.add_argument(
        "--config", nargs="+", help="Hydra overrides composing the pair and the prompts' task from conf/"
    )
    parser.add_argument("--k", type=int, default=4, help="draft length for the fixed-K comparison")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--distill-steps", type=int, default=300)
    parser.add_argument(
        "--lookup", action="store_true", help="also time prompt lookup, ours and transformers'"
    )
    parser.add_argument(
        "--lookup-max", type=int, default=2, help="longest n-gram looked up (transformers: 2)"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="both models' dtype"
    )
    parser.add_argument(
        "--no-speed-check", action="store_true", help="report the speed ratio without failing"
    )
    parser.add_argument(
        "--no-draft", action="store_true",
        help="with --lookup: time the autoregressive target and prompt lookup only (no draft-model rows)",
    )  # fmt: skip
    parser.add_argument(
        "--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES),
        help="our adaptive policies to time besides fixed K (default: all; none: `--policies` alone)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.config is None and (args.target is None) != (args.draft is None):
        parser.error("give both --target and --draft, or neither (or --config)")
    if args.no_draft and not args.lookup:
        parser.error("--no-draft times prompt lookup alone: give --lookup too")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    if args.config is not None:
        target, draft, vocab, prompts = config_pair(args.config, args.draft, args.prompts)
    else:
        target, draft, vocab = (
            build_toy_pair(args.distill_steps) if args.target is None else load_pair(args.target, args.draft)
        )
        gen = torch.Generator().manual_seed(123)
        prompts = [
            torch.randint(0, vocab, (args.prompt_length,), generator=gen).tolist()
            for _ in range(args.prompts)
        ]
    k = args.k
    dtype = getattr(torch, args.dtype)
    target, draft = target.to(dtype), draft.to(dtype)
    stats: dict[str, list[DecodingStats]] = {}

    def our_method(name: str, policy: DraftPolicy | None, proposer=None):
        stats[name] = []
        return ours(target, draft if proposer is None else proposer, policy, vocab, stats[name])

    lookups = {}
    if args.lookup:
        proposer = PromptLookupProposer(vocab, target.device, 1, args.lookup_max)
        lookups = {
            f"hf_lookup_k{k}": hf_generate(target, None, k, args.lookup_max),
            f"ours_lookup_k{k}": our_method(f"ours_lookup_k{k}", FixedLength(k), proposer),
        }

    methods: dict[str, Callable[[list[int], int], list[int]]] = {
        "hf_autoregressive": hf_generate(target, None, None),
        "autoregressive": our_method("autoregressive", None),
        **lookups,
    }
    if not args.no_draft:
        methods |= {
            f"hf_assisted_k{k}": hf_generate(target, draft, k),
            f"ours_fixed_k{k}": our_method(f"ours_fixed_k{k}", FixedLength(k)),
            **{f"ours_{name}": our_method(f"ours_{name}", POLICIES[name](k)) for name in args.policies},
        }
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    outputs: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for name, run in methods.items():  # warm-up pass, untimed; keeps the outputs for the equality check
            outputs[name] = [run(p, args.max_new_tokens) for p in prompts]
        for s in stats.values():
            s.clear()
        for _ in range(args.repeats):
            for name, run in methods.items():
                start = time.perf_counter()
                for p in prompts:
                    tokens[name] += len(run(p, args.max_new_tokens))
                seconds[name] += time.perf_counter() - start
    for name, items in stats.items():  # the oracle's probes are not part of its cost
        seconds[name] -= sum(s.oracle_probe_time_s for s in items)

    rate = {name: tokens[name] / seconds[name] for name in methods}
    hf_k, our_k = f"hf_assisted_k{k}", f"ours_fixed_k{k}"
    versus = hf_k if hf_k in rate else "hf_autoregressive"  # the last column's reference
    print(
        f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.repeats} timed passes, "
        f"{torch.get_num_threads()} threads, greedy, {args.dtype}"
    )
    header = f"{'method':<20}{'tokens/s':>10}{'vs ar':>8}{'vs hf_k' if versus == hf_k else 'vs hf_ar':>9}{'alpha':>8}{'tau':>7}{'draft_len':>10}  same"
    print(header + "\n" + "-" * len(header))
    reference = outputs["hf_autoregressive"]
    all_identical = True
    for name in methods:
        identical = outputs[name] == reference
        all_identical &= identical
        metrics = DecodingStats.sum(stats[name]).metrics() if name in stats else {}

        def cell(key: str, width: int, metrics=metrics) -> str:
            value = metrics.get(key)
            return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"

        print(
            f"{name:<20}{rate[name]:>10.1f}{rate[name] / rate['autoregressive']:>8.2f}{rate[name] / rate[versus]:>9.2f}"
            f"{cell('acceptance_rate', 8)}{cell('tokens_per_target_call', 7)}{cell('mean_draft_length', 10)}"
            f"  {'yes' if identical else 'NO'}"
        )
    ratio = rate[our_k] / rate[hf_k] if our_k in rate else None
    compared = f"{our_k} / {hf_k} = {ratio:.2f}x; " if ratio is not None else ""
    print(f"\n{compared}greedy outputs identical to hf_autoregressive: {all_identical}")
    if args.lookup:
        ours_lookup, hf_lookup = rate[f"ours_lookup_k{k}"], rate[f"hf_lookup_k{k}"]
        print(
            f"ours_lookup_k{k} / autoregressive = {ours_lookup / rate['autoregressive']:.2f}x, "
            f"hf_lookup_k{k} / hf_autoregressive = {hf_lookup / rate['hf_autoregressive']:.2f}x, "
            f"ours_lookup_k{k} / hf_lookup_k{k} = {ours_lookup / hf_lookup:.2f}x"
        )
    exact_dtype = args.dtype == "float32"
    slower = ratio is not None and ratio < 1.0 and not args.no_speed_check
    failed = (exact_dtype and not all_identical) or slower
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
