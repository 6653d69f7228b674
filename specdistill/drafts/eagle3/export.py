"""Export an EAGLE-3 head in the `speculators` format (vLLM project's `Eagle3Speculator`, speculators 0.9.0).

`speculators` is vLLM's library of draft models; its checkpoints carry their own config schema
(`speculators_model_type: "eagle3"`), which vLLM recognises by that field, and which
`speculators.SpeculatorModel.from_pretrained` loads as an `Eagle3DraftModel` (to fine-tune it there, or to serve it
with the verifier it names). The layout mirrors what speculators' own `save_pretrained` and its EAGLE-3 converter
(`speculators/convert/eagle/eagle3_converter.py`, which renames SpecForge's `midlayer.*` to `layers.0.*`) write; this
module does not import speculators (it pins an older transformers: tests/speculators_env.sh). A speculators EAGLE-3
head without our record (ours or one trained with speculators) is read back by `specdistill.drafts.eagle3`
(`Eagle3.from_layout`, `read_foreign_head`) through `our_key` and the constants below. What any head on the target's
states writes the same way (the checkpoint's files, the verifier, speculators' common fields) is
`specdistill.drafts.target_heads.export`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head
from specdistill.drafts.target_heads.export import speculators_record, write_checkpoint
from specdistill.export.hf import umask_modes

ARCHITECTURE = "Eagle3Speculator"  # Eagle3SpeculatorConfig's default `architectures`
LAYER_PREFIX = "layers.0."  # speculators' decoder layers; our one `midlayer` is its first (and only) layer
MODEL_TYPE = "eagle3"  # `speculators_model_type`, the field vLLM recognises a speculators checkpoint by
# the verifier's tensors a speculators model holds beside the head (model.py `_load_verifier_weights`: its final norm
# and lm_head, for training); a checkpoint may carry them, and drafting reads neither
VERIFIER_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight")
# speculators' variants of the head (an input norm before fc, per-layer fc norms, EAGLE 3.1's normed feedback): config
# fields that are false in every head `Eagle3Head` can hold
VARIANT_FIELDS = ("norm_before_fc", "fc_norm", "norm_output")


def speculators_key(name: str) -> str:
    """Our state-dict name -> speculators' (`midlayer.X` -> `layers.0.X`; `fc`, `norm`, `lm_head`, `d2t`, `t2d`
    keep their names), as speculators' EAGLE-3 converter renames a SpecForge/EAGLE-3 checkpoint's keys."""
    return LAYER_PREFIX + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def our_key(name: str) -> str:
    """The inverse of `speculators_key`: speculators' `layers.0.X` -> our `midlayer.X`, other names unchanged (vLLM's
    `llama_eagle3.py` reads SpecForge's `midlayer.X` as `layers.0.X` the same way)."""
    return "midlayer." + name.removeprefix(LAYER_PREFIX) if name.startswith(LAYER_PREFIX) else name


def export_speculators(
    head: Eagle3Head,
    out_dir: Path,
    verifier: str | None,
    tokenizer: Any = None,
    *,
    verifier_architectures: Sequence[str] = (),
    speculative_tokens: int = 3,
    with_embeddings: bool = False,
) -> Path:
    """Write `head` to `out_dir` as a speculators `Eagle3Speculator`; returns `out_dir`.

    Writes:

    - `config.json`: `Eagle3SpeculatorConfig`'s fields, every one stated (vLLM's reader defaults a missing
      `norm_before_residual` to true, which is not our default): `speculators_model_type: "eagle3"`,
      `transformer_layer_config` (a one-layer Llama of the head's shape over the target's vocabulary, which
      speculators builds its decoder layer, norms and rotary embedding from), `draft_vocab_size`,
      `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (our `aux_layer_ids`
      unchanged: both index the target's `output_hidden_states`), speculators' extra input/output norms off, and
      `speculators_config` (greedy proposals of `speculative_tokens` tokens, the verifier `verifier` with
      `verifier_architectures`);
    - `model.safetensors`: the head's weights under speculators' names (`speculators_key`); `d2t`/`t2d` only when the
      draft vocabulary is smaller than the target's (speculators has no such buffers otherwise); no embeddings unless
      `with_embeddings`: the head uses the target's, and so do vLLM and SGLang;
    - the tokenizer, when given.

    Embeddings: speculators' `from_pretrained` means to take a missing `embed_tokens` from the verifier, but it does so
    only where the weight is still NaN (model.py `_load_verifier_weights`), and with transformers 5 a weight missing
    from the checkpoint is left uninitialised memory instead: without `with_embeddings`, a speculators user loads the
    verifier's embeddings explicitly (`model._load_verifier_weights(overwrite_embed_tokens=True)`) before running it.
    With it, `embed_tokens.weight` holds the head's attached target embeddings (`vocab_size x hidden_size` more).

    Args:
        head: the trained head.
        out_dir: the directory to write (created).
        verifier: the target's hub id or local path, recorded as the verifier (speculators loads its embeddings
            from there; vLLM takes it as the target model); None records none (a loader must then attach the
            target's embeddings itself).
        tokenizer: saved beside the weights; its BOS, EOS and pad ids go into `transformer_layer_config`.
        verifier_architectures: the target's `architectures` (its config.json), recorded with the verifier.
        speculative_tokens: the proposal chain's default length (what vLLM uses unless told otherwise).
        with_embeddings: also write the attached target embeddings as `embed_tokens.weight` (for speculators'
            own loading and fine-tuning, see above).

    Raises:
        ValueError: the head has a shape or draft vocabulary that speculators cannot represent, or
            `with_embeddings` and no embeddings attached.
    """
    check_representable(head)
    state = speculators_state_dict(head, with_embeddings)
    dtype = str(head.fc.weight.dtype).removeprefix("torch.")
    record = speculators_config(
        head.config, verifier, tokenizer, dtype, verifier_architectures, speculative_tokens
    )
    out = write_checkpoint(Path(out_dir), state, record, tokenizer)
    umask_modes(out)
    return out


def check_representable(head: Eagle3Head) -> None:
    """Raise ValueError where speculators' `Eagle3DraftModel` cannot hold `head`.

    - `target_hidden_size != hidden_size`: its `fc` is `num_aux * hidden_size -> hidden_size` (models/eagle3/core.py),
      it cannot read a target of another width.
    - a draft vocabulary as large as the target's with a mapping other than the identity: it then has no `d2t`/`t2d`
      (model.py, `DraftVocabMixin._init_vocab`) and would read draft id `i` as target id `i`.
    - `d2t` and `t2d` naming different tokens: speculators would score the rows of one and map through the other.

    (`norm_before_residual` is representable: speculators' first layer takes the same option.)
    """
    config = head.config
    if config.target_hidden_size != config.hidden_size:
        raise ValueError(
            f"this EAGLE-3 head reads a target of width {config.target_hidden_size} into width {config.hidden_size}: "
            "speculators' Eagle3DraftModel has fc: 3*hidden_size -> hidden_size and cannot hold it. Train the head at "
            "the target's width (as draft=eagle3 does), or use the vLLM/SGLang export (Eagle3.export), which can"
        )
    target_ids = head.target_ids.cpu()
    if config.draft_vocab_size == config.vocab_size:
        if not torch.equal(target_ids, torch.arange(config.vocab_size)):
            raise ValueError(
                "this EAGLE-3 head drafts the whole target vocabulary in another order (d2t is not zero): "
                "speculators keeps no d2t/t2d when draft_vocab_size == vocab_size and would map draft id i to target "
                "id i. Set the vocabulary with head.set_vocabulary(draft_vocabulary(...)), which keeps ids ascending"
            )
        return
    t2d = head.t2d.cpu().bool()
    if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise ValueError(
            f"this EAGLE-3 head's t2d marks {int(t2d.sum())} target ids and its d2t maps {config.draft_vocab_size} "
            "draft ids to others: they must name the same tokens. Set both with head.set_vocabulary(...)"
        )


def speculators_state_dict(head: Eagle3Head, with_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """The head's weights under speculators' names (`speculators_key`), contiguous on the CPU; no `d2t`/`t2d` when the
    draft vocabulary is the target's; `embed_tokens.weight` (the attached target embeddings, in the head's dtype)
    only `with_embeddings`."""
    full_vocab = head.config.draft_vocab_size == head.config.vocab_size
    state = {}
    for name, tensor in head.state_dict().items():
        if full_vocab and name in ("d2t", "t2d"):
            continue
        state[speculators_key(name)] = tensor.detach().cpu().contiguous()
    if with_embeddings:
        ids = torch.arange(head.config.vocab_size, device=head.fc.weight.device)
        state["embed_tokens.weight"] = head.embed(ids[None])[0].detach().cpu().contiguous()
    return state


def transformer_layer_config(config: Eagle3Config, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """The Llama config speculators builds the head's layer from (`Eagle3SpeculatorConfig.transformer_layer_config`):
    one layer of the head's shape, the target's vocabulary (`embed_tokens` and `t2d` rows)."""
    return {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 5 reads rope_parameters (what speculators writes), older readers rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None if tokenizer is None else tokenizer.bos_token_id,
        "eos_token_id": None if tokenizer is None else tokenizer.eos_token_id,
        "pad_token_id": None if tokenizer is None else tokenizer.pad_token_id,
        "dtype": dtype,
    }


def speculators_config(
    config: Eagle3Config,
    verifier: str | None,
    tokenizer: Any,
    dtype: str,
    verifier_architectures: Sequence[str] = (),
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """The `config.json` of the export (see `export_speculators`): speculators' fields of an EAGLE-3 head in
    `speculators_record`."""
    fields = {
        "transformer_layer_config": transformer_layer_config(config, tokenizer, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        # speculators' variants of the head (gpt-oss input norm, per-layer fc norms, EAGLE 3.1 normed feedback): ours
        # has none of them
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return speculators_record(
        MODEL_TYPE, ARCHITECTURE, fields, verifier, verifier_architectures, speculative_tokens
    )
