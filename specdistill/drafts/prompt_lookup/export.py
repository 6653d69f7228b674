"""Prompt lookup's export: the `speculative_config` vLLM serves it with (`method: "ngram"`), as data.

Nothing is trained, so the export is the settings alone: the n-gram bounds the evaluation ran with and the K chosen
for them on the selection split. vLLM takes the file's object as `--speculative-config` (or `LLM(...,
speculative_config=...)`); SGLang's `--speculative-algorithm NGRAM` reads the same three numbers under its own names.
"""

from __future__ import annotations

import json
from pathlib import Path

NGRAM_CONFIG_FILE = "prompt_lookup_speculative_config.json"


def ngram_speculative_config(
    min_ngram: int, max_ngram: int, num_speculative_tokens: int
) -> dict[str, object]:
    """vLLM's `speculative_config` for n-gram lookup with these bounds and K."""
    return {
        "method": "ngram",
        "num_speculative_tokens": num_speculative_tokens,
        "prompt_lookup_min": min_ngram,
        "prompt_lookup_max": max_ngram,
    }


def write_ngram_config(out_dir: Path, min_ngram: int, max_ngram: int, num_speculative_tokens: int) -> Path:
    """Write `ngram_speculative_config(...)` to `<out_dir>/prompt_lookup_speculative_config.json`."""
    path = Path(out_dir) / NGRAM_CONFIG_FILE
    config = ngram_speculative_config(min_ngram, max_ngram, num_speculative_tokens)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path
