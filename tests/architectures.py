"""Tiny random-weight configs of every architecture the model presets name, for the architecture-matrix tests.

Each entry is the `config` of a `ModelSpec` (`model_type` + keyword arguments for `AutoConfig.for_model`) with
untied embeddings; the sliding-window variants use a window of `WINDOW` positions, so a test whose prompt plus
output is three windows long crosses it several times.
"""

from __future__ import annotations

from typing import Any

WINDOW = 8

_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
_GQA = {**_SMALL, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt_neox": {"model_type": "gpt_neox", **_SMALL, "rotary_pct": 0.25, "max_position_embeddings": 256,
                 "tie_word_embeddings": False},
    "codegen": {"model_type": "codegen", "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 256,
                "n_ctx": 256, "tie_word_embeddings": False},
    "phi": {"model_type": "phi", **_SMALL, "partial_rotary_factor": 0.5, "max_position_embeddings": 256,
            "tie_word_embeddings": False},
    "llama": {"model_type": "llama", **_GQA},
    "qwen2": {"model_type": "qwen2", **_GQA, "use_sliding_window": False},
    "qwen2_sliding": {"model_type": "qwen2", **_GQA, "use_sliding_window": True, "sliding_window": WINDOW,
                      "max_window_layers": 0},
    "mistral": {"model_type": "mistral", **_GQA, "sliding_window": WINDOW},
    "gemma2": {"model_type": "gemma2", **_GQA, "head_dim": 8, "sliding_window": WINDOW,
               "query_pre_attn_scalar": 8},
}  # fmt: skip

SLIDING = ("qwen2_sliding", "mistral", "gemma2")
