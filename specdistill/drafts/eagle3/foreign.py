"""EAGLE-3 heads trained elsewhere: a head without our record, in the layout vLLM and SGLang read (SpecForge,
SafeAILab/EAGLE: `config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, tensors `fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`) or in vLLM's `speculators` layout, read as vLLM reads it (`read_foreign_head`), for
`specdistill.drafts.eagle3.Eagle3.from_layout` and `Eagle3.load`. Only config.json and the safetensors headers are
read to recognise a head; its weights load from safetensors only (a pickle is refused unread). A head this module
cannot read, or an EAGLE head of another architecture, gets one line naming the folder, what was found and what is
expected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.activations import ACT2FN

from specdistill.drafts.eagle3 import export as speculators
from specdistill.drafts.eagle3.export import our_key
from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head, default_aux_layer_ids
from specdistill.errors import ConfigError, InputFileError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def one_line(error: BaseException | str) -> str:
    """A library's message on one line (some span several)."""
    return " ".join(str(error).split())


# the architectures vLLM loads as its Llama EAGLE-3 head (vllm/model_executor/models/registry.py maps each to
# llama_eagle3.Eagle3LlamaForCausalLM); SpecForge and SafeAILab/EAGLE save LlamaForCausalLMEagle3
EAGLE3_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLMEagle3",
        "Eagle3LlamaForCausalLM",
        "Eagle3Qwen2_5vlForCausalLM",
        "Eagle3Qwen3vlForCausalLM",
        "Eagle3MiniMaxM2ForCausalLM",
    }
)
# EAGLE heads of other shapes, which an Eagle3Head cannot hold (vLLM's registry), with what they are
OTHER_EAGLE_ARCHITECTURES = {
    "PEagleDraftModel": "a parallel-drafting (P-EAGLE) head",
    "PeagleLlamaForCausalLM": "a parallel-drafting (P-EAGLE) head",
    "Eagle3DeepseekV2ForCausalLM": "a DeepSeek EAGLE-3 head (MLA attention)",
    "Eagle3DeepseekV3ForCausalLM": "a DeepSeek EAGLE-3 head (MLA attention)",
    "EagleLlamaForCausalLM": "an EAGLE-1/EAGLE-2 head (one target state, no draft vocabulary)",
    "EagleLlama4ForCausalLM": "an EAGLE-1/EAGLE-2 head (one target state, no draft vocabulary)",
    "EagleMiniCPMForCausalLM": "an EAGLE-1/EAGLE-2 head (one target state, no draft vocabulary)",
}
SHARD_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = "pytorch_model.bin"  # SafeAILab/EAGLE's own releases: a pickle, refused unread
EMBEDDINGS = "embed_tokens.weight"  # the target's embeddings, which SpecForge may save with the head
READS_EXPECTED = (
    "specdistill reads one-layer Llama EAGLE-3 heads (fc, midlayer.* or layers.0.*, norm, lm_head, d2t, t2d), "
    "as vLLM's llama_eagle3.py does"
)
CUT_SHORT = "it was probably cut short while copying or downloading: copy or download it again"


def _architectures(record: Mapping[str, Any]) -> list[str]:
    names = record.get("architectures")
    if isinstance(names, str):
        return [names]
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


class _Unreadable(Exception):
    """What is wrong with a foreign head: `found` (a clause: "its config.json has ...") and `expected` (what specdistill
    reads, or the fix), made one InputFileError by `_input_error`."""

    def __init__(self, found: str, expected: str = READS_EXPECTED) -> None:
        super().__init__(found)
        self.found, self.expected = found, expected


def _listed(names: list[str]) -> str:
    return f"{names[:4]}{' ...' if len(names) > 4 else ''}"


def _weight_listing(path: Path) -> tuple[str, dict[str, tuple[tuple[int, ...], Path]]]:
    """`(what, {tensor name: (shape, file)})` of the head's weights in `path` (safetensors or sharded safetensors);
    only headers are read. A pickle (SafeAILab/EAGLE's `pytorch_model.bin`) is refused unread."""
    single, index, pickled = path / WEIGHTS_FILE, path / SHARD_INDEX, path / PICKLED_WEIGHTS
    if single.is_file():
        files = [single]
        what = WEIGHTS_FILE
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise _Unreadable(
                f"its {SHARD_INDEX} is no shard index ({one_line(error)})", CUT_SHORT
            ) from error
        what = SHARD_INDEX
    elif pickled.is_file():
        raise _Unreadable(
            f"its weights are {PICKLED_WEIGHTS}, a pickle, which specdistill never loads",
            "convert them to safetensors (safetensors.torch.save_file of its state dict, as model.safetensors)",
        )
    else:
        raise _Unreadable(
            f"it has no weights ({WEIGHTS_FILE}, {SHARD_INDEX} or {PICKLED_WEIGHTS})",
            "copy or download the whole folder",
        )
    listing = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    listing[name] = (tuple(handle.get_slice(name).get_shape()), file)
        except (OSError, SafetensorError) as error:
            raise _Unreadable(
                f"its {file.name} is not a readable safetensors file ({one_line(error)})", CUT_SHORT
            ) from error
    return what, listing


def _layout(record: Mapping[str, Any], path: Path) -> str | None:
    """What `record` (a config.json) says the folder holds, for messages ("an EAGLE-3 head in ..."); None: no EAGLE
    head. A speculators model of another algorithm, or an EAGLE head of another architecture, is refused."""
    if "speculators_model_type" in record:
        kind = record["speculators_model_type"]
        if kind != speculators.MODEL_TYPE:
            raise _Unreadable(
                f"its config.json has speculators_model_type {kind!r}",
                f"specdistill reads speculators' {speculators.MODEL_TYPE!r} heads only",
            )
        return (
            f"an EAGLE-3 head in the speculators layout (speculators_model_type {speculators.MODEL_TYPE!r})"
        )
    names = _architectures(record)
    known = [n for n in names if n in EAGLE3_ARCHITECTURES]
    if known:
        return f"an EAGLE-3 head in the vLLM/SGLang layout (architectures {known[0]})"
    other = [n for n in names if n in OTHER_EAGLE_ARCHITECTURES or "eagle" in n.lower()]
    if other:
        what = OTHER_EAGLE_ARCHITECTURES.get(other[0], "an EAGLE head of an architecture vLLM does not name")
        raise _Unreadable(f"its config.json's architectures {other[0]} name {what}")
    # no architecture says so, but a config of EAGLE-3 fields over a head's tensors does
    if not names and ("draft_vocab_size" in record or "eagle_config" in record):
        try:
            _, listing = _weight_listing(path)
        except _Unreadable:
            return None
        if "fc.weight" in listing and any(n.startswith(("midlayer.", "layers.0.")) for n in listing):
            return "an EAGLE-3 head in the vLLM/SGLang layout (no architectures; EAGLE-3 fields and tensors)"
    return None


def _integer(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Unreadable(f"its config.json has {key}={value!r}", f"{key} is a positive integer in any head")
    return value


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _Unreadable(f"its config.json has {key}={value!r}", f"{key} is a positive number in any head")
    return float(value)


def _rope_theta(layer: Mapping[str, Any]) -> float:
    """The layer's RoPE base (LlamaConfig's default 10000 when unstated, as vLLM reads it too); a RoPE scaling or a
    partial rotation, which the head does not compute, is refused."""
    parameters = layer.get("rope_parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    for key in ("rope_scaling", "rope_parameters"):
        options = layer.get(key)
        if isinstance(options, dict):
            kind = options.get("rope_type", options.get("type", "default"))
            if kind not in (None, "default"):
                raise _Unreadable(
                    f"its config.json has a {key} of rope_type {kind!r}",
                    "specdistill's head computes plain RoPE only (rope_scaling null)",
                )
    for options in (layer, parameters):
        factor = options.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise _Unreadable(
                f"its config.json has partial_rotary_factor={factor!r}",
                "specdistill's head rotates the whole head dimension",
            )
    theta = parameters.get("rope_theta", layer.get("rope_theta"))
    return _number({"rope_theta": theta}, "rope_theta", 10000.0)


def _aux_layer_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or len(value) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        or list(value) != sorted(set(value))
    ):
        raise _Unreadable(
            f"its config.json has eagle_aux_hidden_state_layer_ids={value!r}",
            "an EAGLE-3 head fuses three strictly increasing target layer ids (or records none: vLLM's default)",
        )
    return tuple(value)


def _head_fields(
    record: Mapping[str, Any], in_speculators: bool
) -> tuple[dict[str, Any], tuple[int, ...] | None]:
    """`(Eagle3Config fields but aux_layer_ids, aux_layer_ids or None)` of a foreign head's config.json, read as vLLM
    reads it (`llama_eagle3.py`; `transformers_utils/configs/speculators/algos.py` for speculators): the layer's shape
    from the config (speculators: its `transformer_layer_config`), `draft_vocab_size` defaulting to the target's
    vocabulary, `target_hidden_size` to the head's width, `norm_before_residual` to false (speculators: true, vLLM's
    default there). Options the head does not compute are refused."""
    if in_speculators:
        layer = record.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise _Unreadable(
                f"its config.json has transformer_layer_config={layer!r}",
                "a speculators head states its Llama layer there (a JSON object)",
            )
        for key in speculators.VARIANT_FIELDS:
            if record.get(key):
                raise _Unreadable(
                    f"its config.json sets {key}: true (a speculators variant of the head)",
                    f"specdistill reads heads without it ({key} false or absent)",
                )
        ids = record.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = record.get("norm_before_residual", True)
    else:
        layer = record
        eagle = record.get("eagle_config")
        eagle = eagle if isinstance(eagle, dict) else {}
        if eagle.get("use_aux_hidden_state") is False:
            raise _Unreadable(
                "its eagle_config sets use_aux_hidden_state: false (no fc over the target's states)"
            )
        if eagle.get("use_input_layernorm_in_first_layer") is False or eagle.get("use_mtp_layernorm"):
            raise _Unreadable(
                "its eagle_config sets use_input_layernorm_in_first_layer: false or use_mtp_layernorm: true"
            )
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", record.get("eagle_aux_hidden_state_layer_ids"))
        norm_before_residual = record.get("norm_before_residual", False)
    if layer.get("num_hidden_layers") not in (None, 1):
        raise _Unreadable(f"its config.json has num_hidden_layers={layer.get('num_hidden_layers')!r}")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise _Unreadable(f"its config.json sets {key}: true", READS_EXPECTED + ", without biases")
    if record.get("logit_scale") not in (None, 1, 1.0):
        raise _Unreadable(
            f"its config.json has logit_scale={record.get('logit_scale')!r}",
            "specdistill's head scales no logits",
        )
    if not isinstance(norm_before_residual, bool):
        raise _Unreadable(
            f"its config.json has norm_before_residual={norm_before_residual!r}", "true or false"
        )
    act = layer.get("hidden_act", "silu")
    if act not in ACT2FN:
        raise _Unreadable(
            f"its config.json has hidden_act={act!r}", "an activation transformers knows (silu)"
        )
    hidden = _integer(layer, "hidden_size")
    heads = _integer(layer, "num_attention_heads")
    vocab = _integer(layer, "vocab_size")
    max_positions = layer.get("max_position_embeddings")
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        max_positions = 2048  # not read by the head (RoPE at any position); a record of the head only
    fields = {
        "hidden_size": hidden,
        "target_hidden_size": _integer(record, "target_hidden_size", hidden),
        "intermediate_size": _integer(layer, "intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": _integer(layer, "num_key_value_heads", heads),
        "head_dim": _integer(layer, "head_dim", max(hidden // heads, 1)),
        "vocab_size": vocab,
        "draft_vocab_size": _integer(record, "draft_vocab_size", vocab),
        "rms_norm_eps": _number(layer, "rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(layer),
        "max_position_embeddings": max_positions,
        "hidden_act": act,
        "norm_before_residual": norm_before_residual,
    }
    ids = _aux_layer_ids(ids)
    try:  # the checks the head's own config makes (vocabularies, heads), with any three ids
        Eagle3Config(**fields, aux_layer_ids=ids or (0, 1, 2))
    except ValueError as error:
        raise _Unreadable(f"its config.json gives no head's shape ({one_line(error)})") from error
    return fields, ids


def _tensor_names(
    listing: Mapping[str, tuple[tuple[int, ...], Path]], config: Eagle3Config
) -> tuple[dict[str, str], str | None]:
    """`({our name: its name}, its embeddings' name or None)` after checking the file's tensors against the shapes
    `config` gives: every one of ours present (`d2t` may be absent for a draft vocabulary that is the target's, `t2d`
    always: it is derived from `d2t`), none unknown."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Eagle3Head(config).state_dict().items()}
    names: dict[str, str] = {}
    unknown, embeddings = [], None
    for name in listing:
        ours = our_key(name)
        if ours in expected and ours not in names:
            names[ours] = name
        elif name == EMBEDDINGS:
            embeddings = name
        elif name not in speculators.VERIFIER_TENSORS:
            unknown.append(name)
    optional = {"t2d"} | ({"d2t"} if config.draft_vocab_size == config.vocab_size else set())
    missing = sorted(set(expected) - set(names) - optional)
    if missing:
        raise _Unreadable(
            f"its weights lack the tensors {_listed(missing)}",
            "the head is incomplete: copy or download the whole folder again",
        )
    if unknown:
        raise _Unreadable(f"its weights hold tensors the head does not have: {_listed(sorted(unknown))}")
    mismatched = "its config.json and its weights describe different heads: copy or download the folder again"
    for ours, theirs in names.items():
        shape = listing[theirs][0]
        if shape != expected[ours]:
            raise _Unreadable(
                f"its {theirs} has shape {list(shape)}, where its config.json gives {list(expected[ours])}",
                mismatched,
            )
    if embeddings is not None:
        shape = listing[embeddings][0]
        if shape != (config.vocab_size, config.hidden_size):
            raise _Unreadable(
                f"its {embeddings} has shape {list(shape)}, where its config.json gives "
                f"{[config.vocab_size, config.hidden_size]} (vocab_size x hidden_size)",
                mismatched,
            )
    return names, embeddings


@dataclass(frozen=True)
class ForeignHead:
    """An EAGLE-3 head trained elsewhere, as `read_foreign_head` found it in `path`.

    Attributes:
        path: its folder.
        layout: which layout, for messages.
        fields: `Eagle3Config`'s fields but `aux_layer_ids`, from its config.json.
        aux_layer_ids: the target states it fuses (`output_hidden_states` indices), None when it records none.
        names: our state-dict name -> its tensor's name.
        embeddings: the name of its copy of the target's embeddings, or None (the head uses the target's).
        weights: its tensor's name -> the file holding it.
    """

    path: Path
    layout: str
    fields: dict[str, Any]
    aux_layer_ids: tuple[int, ...] | None
    names: dict[str, str]
    embeddings: str | None
    weights: dict[str, Path]

    def config(self, target: nn.Module) -> Eagle3Config:
        """Its config; fused layers it does not record are vLLM's default for `target`, `(2, L // 2, L - 3)`."""
        ids = self.aux_layer_ids
        if ids is None:
            layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
            ids = default_aux_layer_ids(layers)
            if list(ids) != sorted(set(ids)) or min(ids) < 0:
                raise ConfigError(
                    f"the EAGLE-3 head {self.path} records no eagle_aux_hidden_state_layer_ids, and vLLM's default "
                    f"for this target of {layers} layers, {list(ids)}, is no three distinct layers: evaluate it with "
                    "the target it was trained on, or add the ids it was trained with to its config.json"
                )
        return Eagle3Config(**self.fields, aux_layer_ids=ids)

    def unreadable(self, found: str, expected: str = READS_EXPECTED) -> InputFileError:
        return _input_error(self.path, self.layout, found, expected)

    def state_dict(self, target: nn.Module) -> dict[str, torch.Tensor]:
        """Its tensors under our names, `t2d` derived from `d2t` (vLLM reads `d2t` only); a copy of the target's
        embeddings is left out (the head uses the target's own, as vLLM does when they are the same), with a
        warning when it differs from `target`'s."""
        wanted = [*self.names.values(), *([self.embeddings] if self.embeddings else [])]
        tensors = self._load(wanted)
        state = {ours: tensors[theirs] for ours, theirs in self.names.items()}
        config = self.config(target)
        d2t = state.get("d2t")
        if d2t is None:
            d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        elif d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise self.unreadable(
                f"its {self.names['d2t']} is of dtype {d2t.dtype}",
                "d2t holds integer offsets (draft id i is target id i + d2t[i])",
            )
        d2t = d2t.to(torch.long)
        ids = torch.arange(d2t.numel()) + d2t
        if ids.numel() and (
            int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or ids.unique().numel() != ids.numel()
        ):
            raise self.unreadable(
                f"its {self.names.get('d2t', 'd2t')} maps draft ids to target ids outside [0, {config.vocab_size}) "
                "or to one target id twice",
                "each draft id is a distinct target id of its vocabulary: copy or download the folder again",
            )
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        if "t2d" in state and not torch.equal(state["t2d"].to(torch.bool), t2d):
            log.warning(
                "%s: its t2d does not mark the tokens its d2t drafts; using d2t's (as vLLM does)", self.path
            )
        state["d2t"], state["t2d"] = d2t, t2d
        if self.embeddings is not None:
            own = tensors[self.embeddings]
            theirs = target.get_input_embeddings().weight.detach()
            if not torch.allclose(own.float(), theirs.to(device=own.device, dtype=own.dtype).float()):
                log.warning(
                    "%s: its %s differ from the target's input embeddings; the head drafts on the target's",
                    self.path,
                    self.embeddings,
                )
        return state

    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weights[name], []).append(name)
        tensors = {}
        for file, wanted in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    tensors.update({name: handle.get_tensor(name) for name in wanted})
            except _Unreadable as error:
                raise self.unreadable(error.found, error.expected) from error
            except (OSError, SafetensorError) as error:
                raise self.unreadable(
                    f"its {file.name} is not readable ({one_line(error)})", CUT_SHORT
                ) from error
        return tensors


def _input_error(path: Path, layout: str, found: str, expected: str) -> InputFileError:
    """The one line for a foreign head specdistill cannot read: the folder, what it holds, what was found, what is
    expected (`found` and `expected` from `_Unreadable`)."""
    return InputFileError(f"{path} holds {layout}, but {found}: {expected}")


def read_foreign_head(path: Path) -> ForeignHead | None:
    """The EAGLE-3 head in `path` in a layout other than our export's (see `Eagle3.from_layout`), its config and
    its tensors' names and shapes checked (headers only); None when `path` holds none (no config.json, or one that
    names no EAGLE-3 head).

    Raises:
        InputFileError: it holds an EAGLE-3 head that cannot be read, in one line: the folder, what was found, what
            is expected.
    """
    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    try:
        record = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None  # not a config anyone reads: the causal-LM loader says so
    if not isinstance(record, dict):
        return None
    layout = "a speculative-decoding draft"
    try:
        found = _layout(record, path)
        if found is None:
            return None
        layout = found
        fields, ids = _head_fields(record, "speculators_model_type" in record)
        what, listing = _weight_listing(path)
        names, embeddings = _tensor_names(listing, Eagle3Config(**fields, aux_layer_ids=ids or (0, 1, 2)))
    except _Unreadable as error:
        raise _input_error(path, layout, error.found, error.expected) from error
    log.info("%s holds %s (%s)", path, layout, what)
    return ForeignHead(
        path, layout, fields, ids, names, embeddings, {name: f for name, (_, f) in listing.items()}
    )
