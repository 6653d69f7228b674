"""What every draft kind provides: `DraftKind`, the target pass it reads (`TargetPass`) and a loaded draft.

A draft kind is one way of making a draft for speculative decoding: a standalone causal LM (`standalone/`), a
draft cut from the target's own first layers (`cut_layers/`), and later kinds that read the target's hidden
states. One object per kind is built by Hydra from `conf/draft/<kind>.yaml` (`cfg.draft`); the stages only call
its methods, so a new kind is one new folder (`specdistill/drafts/<kind>/`) and one config file.

An export records its kind in `draft_kind.json` (`KIND_FILE`): `record()`, the kind's registry name and its settings as
plain values. `specdistill.drafts.load_draft` looks the name up in `specdistill.drafts.registry` (never importing or
calling anything the record names), checks the settings against the kind's typed settings and lets it load the export.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdistill.data.packing import is_packed
from specdistill.errors import ConfigError
from specdistill.export.hf import export_pretrained, umask_modes, write_metadata
from specdistill.losses.rows import HiddenRows, OutputHead, answer_rows, final_hidden_states
from specdistill.losses.sparse import SparseRows
from specdistill.models.loading import ModelSpec, load_model
from specdistill.models.vocab import check_model_covers_vocab

KIND_FILE = "draft_kind.json"


# a chain position with no candidate (`DraftKind.chain_candidates`)
NO_CANDIDATE = -1


@dataclass(frozen=True)
class TargetPass:
    """What the target's forward gave for one micro-batch (computed once, without gradients).

    Attributes:
        rows: the target's answer rows, `(N, H)` final hidden states and its output layer (`HiddenRows`), or its
            cached top-m distributions (`SparseRows`) when training from a target cache.
        hidden_states: layer index -> `(B, T, H)` hidden states of the target at that layer (0: the embeddings,
            as Hugging Face's `output_hidden_states` counts), for the layers the draft kind's `target_layers` names;
            empty otherwise.
    """

    rows: HiddenRows | SparseRows
    hidden_states: Mapping[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingRows:
    """The rows a divergence compares in training (`DraftKind.training_rows`), `M` of them.

    Attributes:
        target: the target's rows (`M` of them).
        draft: the draft's rows, same order.
        weight: `(M,)` weight of each row's divergence in the loss, or None for 1 (the plain per-token loss).
        answer_index: `(M,)` long, the answer token (row of `keep`, row-major) each row belongs to, or None when
            row `i` is answer token `i` (`M = N`); a selector's statistics read the token ids through it.
    """

    target: HiddenRows | SparseRows
    draft: HiddenRows
    weight: torch.Tensor | None = None
    answer_index: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftStates:
    """A draft's teacher-forced states over whole sequences (`DraftKind.teacher_forced`).

    Attributes:
        hidden: `(B, T, H)` the state that proposes token `t + 1` at position `t` (after the draft's final norm):
            what an acceptance head reads and what `head` projects.
        head: `(..., H) -> (..., V)` the draft's logits over the target's vocabulary (`V`: the `vocab_size` asked
            for, or every output row when None); a token the draft cannot propose gets `-inf`.
    """

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]


def target_pass(
    target: nn.Module,
    batch: Mapping[str, Any],
    keep: torch.Tensor,
    vocab_size: int,
    layers: Sequence[int] = (),
) -> TargetPass:
    """Run the target once on `batch`: its answer rows and its hidden states at `layers`.

    Args:
        target: the frozen causal LM (call under `torch.no_grad()`).
        batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
        keep: `(B, T-1)` bool answer mask.
        vocab_size: the tokenizer's real vocabulary.
        layers: hidden-state layers to keep (none: exactly `answer_rows`, the same ops as a plain target pass).
    """
    if not layers:
        return TargetPass(answer_rows(target, batch, keep, vocab_size))
    last, states = target_states(target, batch, layers)
    rows = HiddenRows(last[:, :-1][keep], OutputHead(target, vocab_size))
    return TargetPass(rows, states)


def target_states(
    target: nn.Module, batch: Mapping[str, Any], layers: Sequence[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`(last, states)`: the target body's `(B, T, H)` last hidden state and its `(B, T, H)` hidden states at
    `layers` (`output_hidden_states` indices), from one pass over `batch` (`input_ids`, `attention_mask`; a packed
    batch's `position_ids` instead of the mask, so each example attends only to itself: `specdistill.data.packing`)."""
    body = getattr(target, "base_model", target)
    if is_packed(batch):
        out = body(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
            use_cache=False, output_hidden_states=True,
        )  # fmt: skip
    else:
        out = body(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
    states = out.hidden_states
    missing = [layer for layer in layers if not -len(states) <= layer < len(states)]
    if missing:
        raise ValueError(
            f"the draft kind asks for target layers {missing}, but the target gives {len(states)} hidden states "
            f"(embeddings and {len(states) - 1} layers)"
        )
    return out.last_hidden_state, {layer: states[layer] for layer in layers}


class DraftKind:
    """One kind of draft: how it is built, trained against the target, exported, loaded and decoded with.

    A kind implements `build`. The other methods default to what a draft that is a standalone causal LM once built
    does (`standalone/`, `cut_layers/`): its rows are its own answer rows, it exports and loads as a Hugging Face
    model and the engine drafts with the model itself. A kind whose draft is something else (a head reading the
    target's hidden states: it sets `target_layers`) overrides them. A kind's constructor arguments are its settings
    (`conf/draft/<kind>.yaml`); `settings()` returns those that an export needs to be loaded again.

    A kind is immutable: no method changes it. A setting left to the target (EAGLE-3's `aux_layer_ids` None: the
    target's default layers) is fixed by `resolve(target)`, which returns a new kind, resolved once when a stage has
    loaded the target and read from then on (its `target_layers`, its export's record); the kind of a loaded export
    is `loaded_kind(draft, target)`.
    """

    target_layers: tuple[int, ...] = ()
    # whether the draft reads the target's hidden states: stages then load the target beside it
    reads_target: bool = False
    # whether `training_rows` gives one row per answer token (False: several, e.g. EAGLE-3's unrolled steps; an
    # AdaSPEC reference is then scored on those rows by a reference of the same kind, never from a per-token cache)
    one_row_per_token: bool = True
    # why this kind cannot train under DeepSpeed ZeRO-3 and what to use instead (None: it can)
    zero3_refusal: str | None = None
    # why this kind cannot train on packed rows (`<stage>.packing`, specdistill/data/packing.py; None: it can)
    packing_refusal: str | None = (
        "packed rows need a draft whose training attends within each example only; this kind's does not yet: set "
        "packing=false, or train an EAGLE-3 head (draft=eagle3)"
    )
    # the constructor parameters an export records (`settings()`); only these, as plain values, are read back
    exported_settings: tuple[str, ...] = ()

    @classmethod
    def from_layout(cls, path: Path) -> DraftKind | None:
        """This kind, when the folder `path` holds a draft of it in another trainer's layout without our record
        (`draft_kind.json`); None when it does not look like one (the default)."""
        return None

    def specs(self, role: str) -> dict[str, ModelSpec]:
        """The checkpoints this kind loads its draft from, by role name (their tokenizers are checked against the
        pair's); none by default."""
        return {}

    def continued_from(self, export: str) -> DraftKind:
        """This kind, building its draft from the earlier export `export` instead (`<stage>.init`); a kind whose
        draft is built from the target refuses."""
        raise ConfigError(
            f"the draft kind {type(self).__name__} builds its draft from the target and cannot continue from an "
            f"export ({export}) yet: use a standalone (no draft= override) or cut_layers draft for init and "
            "stage=sequential"
        )

    def resolve(self, target: nn.Module | None) -> DraftKind:
        """This kind for `target` (the loaded frozen target, None in stages without one): a new kind whose settings
        that depend on the target are fixed, this one unchanged. A kind with none returns itself (the default)."""
        return self

    def loaded_kind(self, draft: nn.Module, target: nn.Module | None) -> DraftKind:
        """The kind of `draft`, which `load` read for `target` (what `load_draft` returns beside it): by default
        `resolve(target)`; a kind whose export holds settings of its own (an EAGLE-3 head's shape) takes them."""
        return self.resolve(target)

    def build(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool = False) -> nn.Module:
        """The trainable draft a training stage starts from, with fp32 weights (bfloat16 under `pure_bf16`).

        Args:
            target: the loaded frozen target (None in stages without one).
            vocab_size: the tokenizer's real vocabulary.
            pure_bf16: train bfloat16 parameters without fp32 master weights.
        """
        raise NotImplementedError

    def rows(
        self,
        draft: nn.Module,
        batch: Mapping[str, Any],
        keep: torch.Tensor,
        target: TargetPass,
        vocab_size: int,
    ) -> HiddenRows:
        """The draft's answer rows that the divergences compare with `target.rows` (same `N` rows, same order);
        by default the draft's own `answer_rows` (`(N, H)` final hidden states and its output layer).

        Args:
            draft: the model `build` (or `load`) returned.
            batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
            keep: `(B, T-1)` bool answer mask.
            target: the target pass of this batch.
            vocab_size: the tokenizer's real vocabulary.
        """
        return answer_rows(draft, batch, keep, vocab_size)

    def training_rows(
        self,
        draft: nn.Module,
        batch: Mapping[str, Any],
        keep: torch.Tensor,
        target: TargetPass,
        vocab_size: int,
    ) -> TrainingRows:
        """What `DistillModule` trains on: by default the target's answer rows against `rows(...)`, one per answer
        token with weight 1. A kind that trains on more rows per answer token (EAGLE-3's unrolled steps, each with
        its weight) or on other columns overrides it; the arguments are those of `rows`."""
        return TrainingRows(target.rows, self.rows(draft, batch, keep, target, vocab_size))

    def teacher_forced(
        self,
        draft: nn.Module,
        target: nn.Module | None,
        batch: Mapping[str, Any],
        vocab_size: int | None,
    ) -> DraftStates:
        """The draft's states and output layer over `batch` under teacher forcing (no gradients needed), what
        rollout labels (`specdistill.rollout.generate`) and acceptance-head inputs (`specdistill.head_data`) read; by
        default the causal LM's own body (`final_hidden_states`) and output layer (`OutputHead`).

        Args:
            draft: the model `build` (or `load`) returned.
            target: the frozen target, for kinds that read its hidden states (None is fine for a causal LM).
            batch: holds `input_ids` and `attention_mask`, both `(B, T)`, right-padded.
            vocab_size: the tokenizer's real vocabulary (the head drops padded output rows), or None for every row.
        """
        return DraftStates(final_hidden_states(draft, batch), OutputHead(draft, vocab_size))

    @torch.no_grad()
    def chain_candidates(
        self,
        draft: nn.Module,
        target: nn.Module | None,
        batch: Mapping[str, Any],
        depth: int,
        vocab_size: int | None,
    ) -> torch.Tensor:
        """`(T, depth)` the greedy chain the draft proposes after each position of the one sequence in `batch`, its
        earlier candidates being the sequence's own tokens (the chain a greedy target accepts): `[t, j]` proposes
        token `t + 1 + j`, `NO_CANDIDATE` past the sequence (`specdistill.evaluation.offline` reads it). A causal
        LM's candidate `j` is its teacher-forced argmax at `t + j`; a kind whose later steps read its own states
        (EAGLE-3) overrides it. The arguments are those of `teacher_forced`; `batch` holds one sequence."""
        states = self.teacher_forced(draft, target, batch, vocab_size)
        greedy = states.head(states.hidden[0]).argmax(dim=-1)  # (T,): position t proposes token t + 1
        return torch.cat([greedy, greedy.new_full((depth,), NO_CANDIDATE)]).unfold(0, depth, 1)[
            : greedy.numel()
        ]

    def check_reference(self, draft: nn.Module, reference: nn.Module) -> None:
        """Refuse an AdaSPEC `reference` of this kind whose rows would not line up with `draft`'s (see
        `specdistill.selection.reference.KindReference`); nothing to check by default."""

    def prepare(self, draft: nn.Module, data: Any) -> None:
        """Called once by a training stage after its data module is built, before training: a kind that derives
        part of its draft from the training data (EAGLE-3's draft vocabulary) does it here; nothing by default.

        Args:
            draft: the model `build` returned.
            data: the stage's `TaskDataModule` (`tokenized("train")` holds the training answers' `labels`).
        """

    def export(
        self,
        draft: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        out_dir: Path,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Write `draft` (safetensors), `tokenizer` and this kind's record (`write_record`) into `out_dir`; by
        default the Hugging Face export (`export_pretrained`, `metadata` in `specdistill.json`) and the record."""
        out = export_pretrained(draft, tokenizer, out_dir, metadata)
        self.write_record(out)
        return out

    def load(
        self, spec: ModelSpec, vocab_size: int | None = None, target: nn.Module | None = None
    ) -> nn.Module:
        """The draft of an export of this kind (`spec.pretrained_model_name_or_path`), in `spec.dtype`; by default
        `load_model(spec)`, checked to cover the tokenizer's `vocab_size` when given. `target` is the loaded frozen
        target, for kinds whose draft uses part of it (EAGLE-3 heads its embeddings); a causal LM ignores it."""
        model = load_model(spec, vocab_size=vocab_size)
        if vocab_size is not None:
            check_model_covers_vocab("draft", model, vocab_size)
        return model

    def proposer(self, model: nn.Module, vocab_size: int) -> nn.Module:
        """What the decoding engine drafts with for `model`.

        A kind may return any proposer the engine accepts; by default the model itself, a causal LM, which the
        engine drafts with as it always has.
        """
        return model

    def record(self) -> dict[str, Any]:
        """What an export records of this kind: its registry name and its settings (plain JSON values)."""
        from specdistill.drafts.registry import kind_name  # the registry imports the kinds, which import this

        return {"kind": kind_name(type(self)), "settings": self.settings()}

    def settings(self) -> dict[str, Any]:
        """The constructor arguments an export of this kind needs to be loaded (plain JSON values, the parameters
        `exported_settings` names); none by default."""
        return {}

    def finish_export(self, out_dir: Path, metadata: dict[str, Any] | None) -> Path:
        """The end of every export that does not go through `export_pretrained`: `metadata` in `specdistill.json`,
        this kind's record, and file modes as the user's umask asks (`umask_modes`); returns `out_dir`."""
        write_metadata(out_dir, metadata)
        self.write_record(out_dir)
        umask_modes(out_dir)
        return out_dir

    def write_record(self, out_dir: Path) -> Path:
        """Write `record()` to `<out_dir>/draft_kind.json`; returns its path."""
        path = Path(out_dir) / KIND_FILE
        path.write_text(json.dumps(self.record(), indent=2) + "\n")
        return path


@dataclass(frozen=True)
class LoadedDraft:
    """A draft ready for a stage: its kind and its model (e.g. what `load_draft` returns for an export).

    Attributes:
        kind: the draft kind that built or loaded `model`.
        model: the draft model (its state dict is what an acceptance head's fingerprint reads).
        source: where it was loaded from (export directory or hub id); None when built.
    """

    kind: DraftKind
    model: nn.Module
    source: str | None = None

    def proposer(self, vocab_size: int) -> nn.Module:
        """What the decoding engine drafts with (`DraftKind.proposer`)."""
        return self.kind.proposer(self.model, vocab_size)
