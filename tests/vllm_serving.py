"""What the vLLM consumer tests share: running a worker script in vLLM's environment, and the acceptance both engines
report (overall and per draft position), read the same way from our `DecodingStats` and vLLM's counters."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from specdistill.decoding.stats import DecodingStats
from tests.test_vllm_backend import VLLM_PYTHON


def run_worker(worker: str, request: dict, cwd: Path, env: dict[str, str] | None = None) -> dict:
    """Run `worker` (Python source) in vLLM's environment with the JSON `request` as its argument, in one process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), and return the JSON of its `RESULT ` line."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    proc = subprocess.run([VLLM_PYTHON, "-c", worker, json.dumps(request)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def our_acceptance(stats: DecodingStats, positions: int) -> tuple[float, list[float]]:
    """Our accepted / drafted candidates, and per draft position the fraction of drafting rounds that accepted its
    candidate (the prefill-only first rounds draft nothing and are not counted)."""
    drafting_rounds = stats.rounds - stats.draft_length_hist[0]
    by_position = [
        (stats.accepted_by_position + [0] * positions)[i] / drafting_rounds for i in range(positions)
    ]
    return stats.accepted_tokens / stats.drafted_tokens, by_position


def vllm_acceptance(counters: dict, positions: int) -> tuple[float, list[float]]:
    """The same two figures from vLLM's speculative-decoding counters."""
    rate = counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_draft_tokens"]
    accepted = (list(counters["vllm:spec_decode_num_accepted_tokens_per_pos"]) + [0] * positions)[:positions]
    return rate, [a / counters["vllm:spec_decode_num_drafts"] for a in accepted]


def assert_same_acceptance(
    stats: DecodingStats, counters: dict, positions: int
) -> tuple[list[float], list[float]]:
    """Both engines accept a trained drafter's candidates at the same rate (> 0.3, within 0.1), position by
    position too; returns (ours, vLLM's) per position."""
    our_rate, ours = our_acceptance(stats, positions)
    vllm_rate, theirs = vllm_acceptance(counters, positions)
    assert our_rate > 0.3 and abs(vllm_rate - our_rate) < 0.1, (our_rate, vllm_rate, counters)
    assert all(abs(v - o) < 0.1 for v, o in zip(theirs, ours, strict=True)), (ours, theirs)
    return ours, theirs
