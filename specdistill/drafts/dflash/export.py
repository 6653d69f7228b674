"""Exporting a DFlash drafter in the layout vLLM loads with `speculative_config={"method": "dflash", ...}`.

vLLM 0.32's `qwen3_dflash` (`DFlashQwen3ForCausalLM`, architecture `DFlashDraftModel`) reads a Qwen3 config of the
drafter's layers with a `dflash_config` section and the weights `fc`, `hidden_norm`, `layers.<i>.*`, `norm`; it takes
the embeddings and the output layer from the target when the checkpoint has none (ours never has: they are the
target's). `target_layer_ids` count decoder-layer outputs there (vLLM adds one to get its auxiliary-state ids), so an
id here, an `output_hidden_states` index, is written minus one. Causality is stated explicitly (`is_causal`,
`dflash_config.causal`, `layer_types`), since vLLM's defaults for it depend on which fields a config has.

vLLM reads no block size from the config (`block_size` here is ours): it runs `1 + num_speculative_tokens` block
positions, and refuses a DFlash drafter without `num_speculative_tokens`. Serve an export with
`num_speculative_tokens = block_size - 1`, the block it was trained on (a shorter one changes what every position
sees; tests/test_dflash_vllm.py checks that vLLM then drafts block for block as our engine does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdistill.drafts.dflash.model import DFlashConfig, DFlashDrafter
from specdistill.errors import InputFileError

ARCHITECTURE = "DFlashDraftModel"  # what vLLM's registry maps to its qwen3_dflash model
RECORD_KEY = "specdistill_dflash"  # our full shape in config.json (`config_from_export`)


def export_config(drafter: DFlashDrafter, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The `config.json` vLLM reads (`method: "dflash"`, `qwen3_dflash`): a Qwen3 config of the drafter's layers,
    `dflash_config` (`mask_token_id`, `target_layer_ids` in DFlash's count, decoder-layer outputs: ours minus one,
    `block_size`, `causal: false`), every layer's attention stated non-causal and full (`is_causal`, `layer_types`),
    and `specdistill_dflash`, the drafter's full shape for `config_from_export`."""
    config = drafter.config
    dtype = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "num_target_layers": len(config.target_layer_ids),
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "is_causal": False,
        "vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": [i - 1 for i in config.target_layer_ids],
            "block_size": config.block_size,
            "causal": False,
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": dtype,
        RECORD_KEY: config.to_dict(),
    }


def config_from_export(path: Path) -> DFlashConfig:
    """The drafter's shape recorded in an export's `config.json`."""
    config_path = path / "config.json"
    try:
        return DFlashConfig(**json.loads(config_path.read_text())[RECORD_KEY])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise InputFileError(
            f"{config_path} is not a specdistill DFlash export's config ({error!r}): re-export the drafter"
        ) from error
