"""Target responses from vLLM (`rollout.backend=vllm`; `pip install 'specdistill[vllm]'`).

Generating responses to tens of thousands of prompts with a 27B-70B target is what vLLM's paged attention and
continuous batching are for. vLLM runs in a subprocess (`python -m specdistill.rollout.vllm_backend REQUEST OUT`), so
its GPU memory, worker processes and CUDA state are gone when it returns and the labelling passes get the devices.
The labels stay exact: the responses are then scored by our teacher-forced target pass and draft pass
(`label_responses`), as responses reused for another draft are. vLLM samples with its own kernels, so its responses
follow the warped target distribution only up to its numerics (bf16 logits, its top-p); the labels do not depend on
that, only on the responses.

Each prompt gets its own vLLM seed (`row_seeds`), and vLLM stops exactly at our tokenizer's EOS ids
(`ignore_eos` drops the model's own EOS and generation-config ids; `stop_token_ids` are ours), EOS kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdistill.decoding.sampling import SamplingConfig
from specdistill.utils.extras import require


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


def response_tokens(
    token_ids: Sequence[int], finish_reason: str | None, stop_reason: Any, eos_ids: Sequence[int]
) -> list[int]:
    """A vLLM completion as a rollout response: its tokens up to and including the first EOS; the EOS that stopped
    it is appended when the version at hand leaves it out of `token_ids`."""
    eos = {int(t) for t in eos_ids}
    response = []
    for token in token_ids:
        response.append(int(token))
        if token in eos:
            return response
    if finish_reason == "stop" and isinstance(stop_reason, int) and stop_reason in eos:
        response.append(stop_reason)
    return response


def generate_with_vllm(
    model: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seeds: Sequence[int],
    work_dir: str | Path,
    engine: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Target responses to `prompts` from vLLM, in a subprocess.

    Args:
        model: hub id or local directory of the target (vLLM loads it itself; a config-built model cannot be used).
        prompts: token ids of each prompt.
        sampling, max_new_tokens: as for `sample_responses`.
        eos_ids: the tokenizer's EOS id(s).
        seeds: one seed per prompt.
        work_dir: where the request and the responses are written (`vllm_request.json`, `vllm_responses.json`); the
            responses already there are returned when they answer the same request (a re-launched run).
        engine: keyword arguments of `vllm.LLM` (e.g. tensor_parallel_size, dtype, gpu_memory_utilization,
            revision, trust_remote_code).
    """
    require("vllm", "rollout.backend=vllm", "vllm")
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt is needed, got {len(seeds)} seeds for {len(prompts)} prompts")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    request, out = work_dir / "vllm_request.json", work_dir / "vllm_responses.json"
    request.write_text(
        json.dumps(
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
    )
    subprocess.run(
        [sys.executable, "-m", "specdistill.rollout.vllm_backend", str(request), str(out)], check=True
    )
    responses = json.loads(out.read_text())
    if len(responses) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(responses)} responses for {len(prompts)} prompts")
    return responses


def _main(request_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(Path(request_path).read_text())
    engine = {"trust_remote_code": False, **request["engine"]}
    llm = LLM(**engine)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in request["prompts"]],
        [SamplingParams(**params) for params in request["params"]],
        use_tqdm=True,
    )
    responses = [
        response_tokens(
            o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, request["eos_ids"]
        )
        for o in outputs
    ]
    Path(out_path).write_text(json.dumps(responses))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
