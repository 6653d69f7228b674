"""The vLLM side of `rollout.backend=vllm`: `python vllm_worker.py REQUEST OUT`.

This file imports only the standard library and vLLM, so it runs under any Python that has vLLM, including a separate
environment (`rollout.vllm_python`): vLLM pins its own torch and transformers, which often cannot share an
environment with training. REQUEST is the JSON that `specdistill.rollout.vllm_backend.generate_with_vllm` writes
(`engine`: `vllm.LLM` arguments; `prompts`: token ids; `params`: one `vllm.SamplingParams` per prompt; `eos_ids`; and
optionally `chunks`: `{"size", "out"}` in prompt order, each chunk generated in turn and its responses written to its
`out` as soon as it is done); OUT receives one response (token ids) per prompt, in order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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


def main(request_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(Path(request_path).read_text())
    # our defaults, which the request's `engine` may override: no model code from the hub, weights from safetensors
    # only (never pickle), and token ids in and out (the tokenizer is ours)
    engine = {
        "trust_remote_code": False,
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        **request["engine"],
    }
    llm = LLM(**engine)
    prompts, params = request["prompts"], request["params"]
    # one chunk of everything unless the request splits it (a chunk is done, and kept, before the next starts)
    chunks = request.get("chunks") or [{"size": len(prompts), "out": None}]
    responses: list[list[int]] = []
    for chunk in chunks:
        start, end = len(responses), len(responses) + int(chunk["size"])
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[start:end]],
            [SamplingParams(**p) for p in params[start:end]],
            use_tqdm=True,
        )
        done = [
            response_tokens(
                o.outputs[0].token_ids,
                o.outputs[0].finish_reason,
                o.outputs[0].stop_reason,
                request["eos_ids"],
            )
            for o in outputs
        ]
        if chunk["out"] is not None:
            write_whole(chunk["out"], done)
        responses += done
    write_whole(out_path, responses)


def write_whole(path: str, responses: list[list[int]]) -> None:
    """Write `responses` as JSON to `path` through a sibling file: a killed run leaves no half-written file."""
    partial = Path(path).with_suffix(".partial")
    partial.write_text(json.dumps(responses))
    partial.replace(path)


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which import this file again
    main(*sys.argv[1:3])
