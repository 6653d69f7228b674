"""A stage's tokenizer and models, loaded from its config and vocabulary-checked.

The pair's tokenizer checked against every pretrained model's own (`shared_tokenizer`), the run's draft kind
(`draft_kind`), the models of a training stage with fp32 master weights for the trained roles (`load_models`), draft
exports loaded by the kind each records (`named_drafts`, `load_exported_drafts`) and, for the stages without training,
the frozen target with them on one device (`load_frozen_target_and_drafts`, `pick_device`). One model from its spec
loads in specdistill/models/loading.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.drafts import DraftKind, LoadedDraft, Standalone, exported_kind, load_draft
from specdistill.models import ModelSpec, check_model_covers_vocab, check_same_tokenizer, freeze, load_model
from specdistill.models.loading import is_placed_across_devices
from specdistill.models.precision import trainable_spec
from specdistill.models.tokenizer import ensure_pad_token, load_tokenizer


def model_spec(node: DictConfig | ModelSpec) -> ModelSpec:
    return node if isinstance(node, ModelSpec) else instantiate(node)


def shared_tokenizer(cfg: DictConfig, specs: dict[str, ModelSpec]) -> PreTrainedTokenizerBase:
    """The pair's tokenizer, checked against the tokenizer of every pretrained model in `specs`.

    Models built from a config take the shared tokenizer; a pretrained model (hub id or an earlier export) brings its
    own tokenizer, which must map the same strings to the same ids.
    """
    tokenizer = ensure_pad_token(instantiate(cfg.models.tokenizer))
    tokenizers = {"models.tokenizer": tokenizer}
    for role, spec in specs.items():
        if spec.is_pretrained:
            tokenizers[role] = load_tokenizer(
                spec.pretrained_model_name_or_path, spec.revision, spec.trust_remote_code, spec.gguf_file
            )
    check_same_tokenizer(tokenizers)
    return tokenizer


def draft_kind(cfg: DictConfig, init: str | None = None) -> DraftKind:
    """The run's draft kind, `cfg.draft` (`draft=<kind>`: conf/draft/<kind>.yaml), continuing from the export `init`
    when one is given (`<stage>.init`; `DraftKind.continued_from`).

    With no kind chosen (the default, so every existing config composes as before) the draft is `Standalone`, the
    pair's `models.draft`, exactly what `draft=standalone` builds.
    """
    node = cfg.get("draft")
    kind = Standalone(model_spec(cfg.models.draft)) if node is None else instantiate(node)
    return kind if init is None else kind.continued_from(init)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def brings_tokenizer(spec: ModelSpec) -> bool:
    """Whether `spec` has a tokenizer of its own to check against the pair's: every model but a head on the target's
    states saved without one (a SpecForge EAGLE-3 checkpoint): it drafts the target's ids, and its vocabulary size is
    checked against the target's when it loads (`specdistill.drafts.eagle3.check_head_fits_target`)."""
    if not spec.is_pretrained or spec.gguf_file is not None:
        return True
    folder = Path(spec.pretrained_model_name_or_path).expanduser()
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return True
    return not exported_kind(folder).reads_target


def _check_placement(specs: Mapping[str, ModelSpec], placed_roles: tuple[str, ...]) -> None:
    for role, spec in specs.items():
        if spec.device_map is not None and role not in placed_roles:
            raise ValueError(
                f"the {role} has a device_map, which only rollout and evaluate use (for their frozen target). "
                "Training stages place their models with the Trainer's strategy: drop the device_map and use "
                "trainer=deepspeed_zero3 for a target larger than one GPU."
            )


def _load_checked(role: str, spec: ModelSpec, vocab_size: int) -> PreTrainedModel:
    model = load_model(spec, vocab_size=vocab_size)
    check_model_covers_vocab(role, model, vocab_size)
    return model


def load_models(
    cfg: DictConfig,
    specs: dict[str, ModelSpec],
    trainable: tuple[str, ...] = (),
    placed_roles: tuple[str, ...] = (),
    drafts: Mapping[str, DraftKind] | None = None,
) -> tuple[PreTrainedTokenizerBase, dict[str, nn.Module], int]:
    """Load the tokenizer and each model once; return `(tokenizer, models, real_vocab_size)`.

    The roles named in `trainable` load in float32 (fp32 master weights; bfloat16 only under `pure_bf16=true`),
    whatever their spec's dtype, which is the dtype of the frozen roles (specdistill/models/precision.py). Only the
    roles in `placed_roles` may carry a `device_map` (frozen models of stages that place them themselves).
    `drafts` (role -> `DraftKind`) are the trained drafts: each is built by its kind (`DraftKind.build`, fp32 master
    weights) after the models of `specs`, from the target among them (`specs["target"]`) when there is one.
    """
    drafts = drafts or {}
    sources = dict(specs)
    for role, kind in drafts.items():
        sources.update(kind.specs(role))
    _check_placement(sources, placed_roles)
    tokenizer = shared_tokenizer(cfg, sources)
    vocab_size = len(tokenizer)
    pure_bf16 = bool(cfg.get("pure_bf16", False))
    models: dict[str, nn.Module] = {}
    for role, spec in specs.items():
        if role in trainable:
            spec = trainable_spec(spec, pure_bf16=pure_bf16)
        models[role] = _load_checked(role, spec, vocab_size)
    for role, kind in drafts.items():
        models[role] = kind.build(models.get("target"), vocab_size, pure_bf16=pure_bf16)
    return tokenizer, models, vocab_size


def named_drafts(cfg: DictConfig, paths: DictConfig | None) -> dict[str, ModelSpec]:
    """`paths` (draft name -> export directory) as model specs, or the pair's draft (`draft`) when none is given.

    `load_draft` loads each through the draft kind its export records (`load_exported_drafts`)."""
    if not paths:
        return {"draft": model_spec(cfg.models.draft)}
    dtype = cfg.models.draft.get("dtype", "float32")
    return {name: ModelSpec(pretrained_model_name_or_path=path, dtype=dtype) for name, path in paths.items()}


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU; any other value is a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_exported_drafts(
    cfg: DictConfig, drafts: Mapping[str, ModelSpec]
) -> tuple[PreTrainedTokenizerBase, dict[str, LoadedDraft], int]:
    """`(tokenizer, drafts, vocab_size)`: each draft export (see `named_drafts`) loaded through the kind it records
    (`specdistill.drafts.load_draft`), after the same tokenizer checks as every other stage."""
    _check_placement(drafts, ())
    tokenizer = shared_tokenizer(cfg, dict(drafts))
    vocab_size = len(tokenizer)
    return tokenizer, {name: load_draft(spec, vocab_size) for name, spec in drafts.items()}, vocab_size


def load_frozen_target_and_drafts(
    cfg: DictConfig, drafts: Mapping[str, ModelSpec], device: torch.device
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, dict[str, LoadedDraft], int]:
    """For stages without training (rollout, evaluate): `(tokenizer, target, drafts, vocab_size)`, all frozen on
    `device` (a target loaded with `models.target.device_map` stays where it was placed), after the same tokenizer
    checks as every other stage. Each draft export (see `named_drafts`) loads through the kind it records."""
    specs = {"target": model_spec(cfg.models.target), **drafts}
    _check_placement(specs, ("target",))
    tokenizer = shared_tokenizer(cfg, {name: spec for name, spec in specs.items() if brings_tokenizer(spec)})
    vocab_size = len(tokenizer)
    target = _load_checked("target", specs.pop("target"), vocab_size)
    loaded = {name: load_draft(spec, vocab_size, target) for name, spec in specs.items()}
    for model in [target, *(draft.model for draft in loaded.values())]:
        freeze(model)
        if not is_placed_across_devices(model):
            model.to(device)
    return tokenizer, target, loaded, vocab_size
