"""The DFlash draft kind: a block drafter on the frozen target's hidden states (`specdistill.drafts.dflash.model`).

`python train.py stage=distill draft=dflash` trains a `DFlashDrafter` through `DistillModule`:

- `resolve`: the kind for a target, a new kind: its fused layers (`target_layer_ids`, spread over the target when
  none are set), its mask token (`mask_token_id`, the last row of the target's embeddings when none is set) and the
  target it names as verifier;
- `build`: the drafter's shape from the target's config, the target attached (its embeddings and output layer,
  frozen, shared, never exported);
- `training_rows`: the public recipe. In each sequence `blocks_per_sequence` anchor positions are drawn among the
  answer positions (`block_anchors`); the block anchored at `a` holds token `a` and masks, sees the target's states of
  the positions before `a`, and its position `j >= 1` is scored against the target's distribution of token `a + j`
  (the answer row `a + j - 1`), weighted `exp(-(j - 1) / loss_decay)`; rows past the answer are left out. All blocks
  of a batch run in one pass (`DFlashDrafter.blocks`). The anchors are a pseudo-random function of the batch's
  tokens and `anchor_seed`, so a reference drafter scores the very same rows (AdaSPEC's selection then compares the
  draft and the reference block position by block position: `KindReference`); a batch drawn again in a later epoch
  gets the same anchors.
- `teacher_forced` (rollout labels, acceptance-head inputs): the states of blocks tiled over the sequence, anchored
  every `block_size - 1` positions, so every token after the first is proposed by exactly one block position, each of
  positions `1 .. block_size - 1` in turn, each block on the target's states before its anchor, as a decoding round
  drafts its block (decoding's own anchors follow what the target accepts: a fully accepted block and the target's
  bonus token move the next one `block_size` on); `chain_candidates` (offline acceptance): a block anchored at every
  position, what decoding drafts after the sequence's own tokens (`specdistill.evaluation.offline`).
- `export`: the layout vLLM loads with `method: "dflash"` (`export_config`); `load` reads it back on the target;
  `proposer`: a `DFlashProposer`, one block per round.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdistill.drafts.base import (
    NO_CANDIDATE,
    DraftKind,
    DraftStates,
    TargetPass,
    TrainingRows,
    target_states,
)
from specdistill.drafts.dflash.export import config_from_export, export_config
from specdistill.drafts.dflash.model import (
    BLOCK_SIZES,
    DFlashConfig,
    DFlashDrafter,
    check_target_layer_ids,
    default_target_layer_ids,
    dflash_config_for,
)
from specdistill.drafts.dflash.proposer import DFlashProposer
from specdistill.drafts.target_heads.export import WEIGHTS_FILE, verifier_of, write_checkpoint
from specdistill.errors import ConfigError, InputFileError
from specdistill.losses.rows import HiddenRows
from specdistill.losses.sparse import SparseRows
from specdistill.models.loading import ModelSpec

log = logging.getLogger(__name__)

ANCHORS_PER_PASS = 64  # blocks per drafter pass in `teacher_forced` and `chain_candidates`


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"draft.{name}={value!r} must be a positive int")
    return value


class DFlash(DraftKind):
    """The draft is a DFlash block drafter (`conf/draft/dflash.yaml`).

    Args:
        block_size: positions per block, `block_size - 1` candidates per pass (8 or 16 in the public recipe).
        num_layers: the drafter's decoder layers.
        target_layer_ids: the target states fused (`output_hidden_states` indices); None: `num_target_features`
            states spread over the target, fixed by `resolve`.
        num_target_features: how many target states a default `target_layer_ids` fuses.
        mask_token_id: the target embedding row filling a block's unknown positions; None: the target's last row.
        blocks_per_sequence: blocks drawn per training sequence.
        loss_decay: block position `j`'s loss weight is `exp(-(j - 1) / loss_decay)`.
        anchor_seed: mixed into the anchors' draw (see the module docstring).
        verifier: `(name_or_path, architectures)` of the target, named in the export; `resolve` sets it.
    """

    reads_target = True
    one_row_per_token = False
    exported_settings = (
        "block_size",
        "num_layers",
        "target_layer_ids",
        "num_target_features",
        "mask_token_id",
        "blocks_per_sequence",
        "loss_decay",
        "anchor_seed",
    )
    zero3_refusal = (
        "the drafter shares the frozen target's embeddings and output layer, and ZeRO-3 would partition them across "
        "ranks, which this kind does not gather yet: use trainer=deepspeed_zero2 (or ddp, gpu)"
    )

    def __init__(
        self,
        block_size: int = 8,
        num_layers: int = 1,
        target_layer_ids: list[int] | tuple[int, ...] | None = None,
        num_target_features: int = 3,
        mask_token_id: int | None = None,
        blocks_per_sequence: int = 8,
        loss_decay: float = 4.0,
        anchor_seed: int = 0,
        *,
        verifier: tuple[str | None, Sequence[str]] | None = None,
    ) -> None:
        if block_size not in BLOCK_SIZES:
            raise ConfigError(f"draft.block_size={block_size!r} must be one of {list(BLOCK_SIZES)}")
        self.block_size = block_size
        self.num_layers = _positive_int("num_layers", num_layers)
        self.target_layer_ids = None if target_layer_ids is None else tuple(int(i) for i in target_layer_ids)
        self.num_target_features = _positive_int("num_target_features", num_target_features)
        if mask_token_id is not None and (
            isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int)
        ):
            raise ConfigError(f"draft.mask_token_id={mask_token_id!r} must be a token id or null")
        self.mask_token_id = mask_token_id
        self.blocks_per_sequence = _positive_int("blocks_per_sequence", blocks_per_sequence)
        if not math.isfinite(float(loss_decay)) or float(loss_decay) <= 0:
            raise ConfigError(f"draft.loss_decay={loss_decay!r} must be a positive number")
        self.loss_decay = float(loss_decay)
        if isinstance(anchor_seed, bool) or not isinstance(anchor_seed, int):
            raise ConfigError(f"draft.anchor_seed={anchor_seed!r} must be an int")
        self.anchor_seed = anchor_seed
        name, architectures = verifier if verifier is not None else (None, [])
        self.verifier: tuple[str | None, list[str]] = (name, list(architectures))

    @property
    def target_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """The target states the stages fetch: `target_layer_ids`, none before `resolve` fixes them."""
        return () if self.target_layer_ids is None else self.target_layer_ids

    def settings(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "target_layer_ids": None if self.target_layer_ids is None else list(self.target_layer_ids),
            "num_target_features": self.num_target_features,
            "mask_token_id": self.mask_token_id,
            "blocks_per_sequence": self.blocks_per_sequence,
            "loss_decay": self.loss_decay,
            "anchor_seed": self.anchor_seed,
        }

    def resolve(self, target: nn.Module | None) -> DFlash:
        """This kind for `target`: `target_layer_ids` the given ones or spread over it, checked against its depth;
        `mask_token_id` the given one or its last embedding row, checked; `verifier` naming it.

        Raises:
            ConfigError: fused layers outside the target's decoder layers, or a mask token it has no row for.
        """
        if target is None:
            raise ValueError(
                "a DFlash drafter reads the target's hidden states: this stage loads no target model"
            )
        layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
        rows = int(target.get_input_embeddings().weight.shape[0])
        try:
            ids = (
                default_target_layer_ids(layers, self.num_target_features)
                if self.target_layer_ids is None
                else self.target_layer_ids
            )
            ids = check_target_layer_ids(ids, layers)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        mask = rows - 1 if self.mask_token_id is None else self.mask_token_id
        if not 0 <= mask < rows:
            raise ConfigError(
                f"draft.mask_token_id={mask} is not a row of this target's {rows} input embeddings: set a token id "
                "below it, or null for the last row"
            )
        if not bool(target.get_input_embeddings().weight[mask].detach().any()):
            # a zero input is normed to zero: every mask position would get the same query, key and value, so every
            # position of a one-layer drafter would propose the same token, whatever it learns
            raise ConfigError(
                f"draft.mask_token_id={mask} is an all-zero row of this target's input embeddings (a padding row): "
                "the block's masked positions could not be told apart; set draft.mask_token_id to a real token's id "
                "(a rare one, or the tokenizer's mask or pad token)"
            )
        settings = {**self.settings(), "target_layer_ids": list(ids), "mask_token_id": mask}
        return DFlash(**settings, verifier=verifier_of(target))

    def loaded_kind(self, draft: nn.Module, target: nn.Module | None) -> DFlash:
        """The kind of the drafter `draft` that `load` read: its shape's settings, this kind's training settings."""
        config = draft.config
        settings = {
            **self.settings(),
            "block_size": config.block_size,
            "num_layers": config.num_hidden_layers,
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
        }
        return DFlash(**settings, verifier=verifier_of(target))

    # -- building and training

    def build(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool = False) -> nn.Module:
        """A random drafter shaped for `target` (its layers, mask token and fused states as `resolve` fixes them)."""
        resolved = self.resolve(target)
        embeddings = target.get_input_embeddings()
        config = dflash_config_for(
            target.config,
            int(embeddings.weight.shape[0]),
            resolved.target_layer_ids,
            self.block_size,
            resolved.mask_token_id,
            self.num_layers,
        )
        drafter = DFlashDrafter(config)
        drafter.to(device=embeddings.weight.device, dtype=torch.bfloat16 if pure_bf16 else torch.float32)
        drafter.attach_target(target)
        drafter.train()
        return drafter

    def check_reference(self, draft: nn.Module, reference: nn.Module) -> None:
        """An AdaSPEC reference must be a DFlash drafter of the same block size and fused layers: its rows are then
        the draft's, block position by block position (`KindReference`)."""
        if not isinstance(reference, DFlashDrafter):
            raise ConfigError(
                f"the AdaSPEC reference is a {type(reference).__name__}, but the draft is a DFlash drafter: pass the "
                "export of a distill run with draft=dflash (adaspec.reference=<distill_run_dir>/export)"
            )
        ours, theirs = draft.config, reference.config
        for name in ("block_size", "target_layer_ids"):
            if getattr(ours, name) != getattr(theirs, name):
                raise ConfigError(
                    f"the AdaSPEC reference drafter has {name}={getattr(theirs, name)}, the draft "
                    f"{getattr(ours, name)}: train both with the same draft.{name}"
                )

    def training_rows(
        self,
        draft: nn.Module,
        batch: Mapping[str, Any],
        keep: torch.Tensor,
        target: TargetPass,
        vocab_size: int,
    ) -> TrainingRows:
        """The rows of the blocks at this batch's anchors (see the module docstring), `M` of them."""
        size = draft.config.block_size
        anchors = block_anchors(keep, batch["input_ids"], self.blocks_per_sequence, self.anchor_seed)
        features = torch.cat([target.hidden_states[i] for i in draft.config.target_layer_ids], dim=-1)
        states = draft.blocks(features, batch["input_ids"], batch["attention_mask"], anchors)
        answer = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
        answer[keep] = torch.arange(int(keep.sum()), device=keep.device)
        # block (b, i), position j >= 1 scores answer row a + j - 1
        offsets = torch.arange(1, size, device=keep.device)
        rows = anchors[..., None] + offsets - 1  # (B, n, size - 1)
        inside = (anchors[..., None] >= 0) & (rows < keep.shape[1])
        index = torch.where(
            inside, answer.gather(1, rows.clamp(0, keep.shape[1] - 1).flatten(1)).view_as(rows), -1
        )
        valid = index >= 0
        hidden = states[:, :, 1:][valid]
        weight = torch.exp(-(offsets - 1).float() / self.loss_decay).expand_as(rows)[valid]
        answer_index = index[valid]
        return TrainingRows(
            target=select_rows(target.rows, answer_index),
            draft=HiddenRows(hidden, draft.output_head(vocab_size)),
            weight=weight,
            answer_index=answer_index,
        )

    @torch.no_grad()
    def teacher_forced(
        self,
        draft: nn.Module,
        target: nn.Module | None,
        batch: Mapping[str, Any],
        vocab_size: int | None,
    ) -> DraftStates:
        """Blocks tiled over each sequence, anchored at `0, s, 2 s, ...` (`s = block_size - 1`): the state at position
        `t` is block position `t + 1 - a` of the block anchored at `a` (the one proposing token `t + 1`), after the
        final norm; the head is the target's output layer. The block anchored at 0 has no context (decoding never
        drafts one: its first block is anchored at the prompt's end), so only the states of the first
        `block_size - 1` positions come from a block no decoding round runs."""
        input_ids = batch["input_ids"]
        b, t = input_ids.shape
        stride = draft.config.block_size - 1
        starts = torch.arange(0, t, stride, device=input_ids.device)
        states = self._blocks(draft, target, batch, starts.expand(b, -1))  # (B, n, size, H)
        positions = torch.arange(t, device=input_ids.device)
        block, offset = positions // stride, positions % stride + 1
        hidden = states[:, block, offset]
        return DraftStates(hidden, draft.output_head(vocab_size))

    @torch.no_grad()
    def chain_candidates(
        self,
        draft: nn.Module,
        target: nn.Module | None,
        batch: Mapping[str, Any],
        depth: int,
        vocab_size: int | None,
    ) -> torch.Tensor:
        """A block anchored at every position `t >= 1` of the one sequence: candidate `j` after `t` is its greedy token
        at block position `j + 1` (at most `block_size - 1` deep; deeper candidates and position 0 propose nothing)."""
        ids = batch["input_ids"]
        t = ids.shape[1]
        out = torch.full((t, depth), NO_CANDIDATE, dtype=torch.long, device=ids.device)
        if t < 2:
            return out
        states = self._blocks(draft, target, batch, torch.arange(1, t, device=ids.device)[None])[0]
        reach = min(depth, draft.config.block_size - 1)
        out[1:, :reach] = draft.output_head(vocab_size)(states[:, 1 : reach + 1]).argmax(dim=-1)
        return out

    def _blocks(
        self, draft: nn.Module, target: nn.Module | None, batch: Mapping[str, Any], anchors: torch.Tensor
    ) -> torch.Tensor:
        if target is None:
            raise ValueError("a DFlash drafter drafts from the target's hidden states: pass the target")
        layers = draft.config.target_layer_ids
        _, states = target_states(target, batch, layers)
        features = torch.cat([states[i] for i in layers], dim=-1)
        # a few blocks per pass: every block's queries see every key (masked), so one pass over all of a long
        # sequence's blocks would hold (T * block_size)^2 attention scores; the context's keys and values once
        positions = torch.arange(features.shape[1], device=features.device)
        contexts = draft.context_keys_values(draft.context(features), positions)
        return torch.cat(
            [
                draft.blocks(features, batch["input_ids"], batch["attention_mask"], chunk, contexts)
                for chunk in anchors.split(ANCHORS_PER_PASS, dim=1)
            ],
            dim=1,
        )

    # -- export and loading

    def export(
        self,
        draft: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        out_dir: Path,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """vLLM's DFlash layout (`export_config`), the tokenizer and this kind's record."""
        out = write_checkpoint(Path(out_dir), draft.state_dict(), export_config(draft, tokenizer), tokenizer)
        return self.finish_export(out, metadata)

    def load(
        self, spec: ModelSpec, vocab_size: int | None = None, target: nn.Module | None = None
    ) -> nn.Module:
        """The drafter in `spec.dtype`, on `target` (required), which it must fit (`check_fits_target`)."""
        path = Path(spec.pretrained_model_name_or_path).expanduser()
        if target is None:
            raise ValueError(
                f"{path} is a DFlash drafter, which drafts on the target's embeddings, output layer and hidden "
                "states: load it with the target (load_draft(path, vocab_size, target=target))"
            )
        config = config_from_export(path)
        check_fits_target(config, target, path)
        try:
            state = load_file(str(path / WEIGHTS_FILE))
        except (OSError, SafetensorError) as error:
            raise InputFileError(
                f"{path / WEIGHTS_FILE} is not a readable DFlash drafter ({error}): copy or re-export it"
            ) from error
        drafter = DFlashDrafter(config)
        try:
            drafter.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise InputFileError(
                f"{path / WEIGHTS_FILE} does not hold this DFlash drafter ({error})"
            ) from error
        drafter.to(device=target.get_input_embeddings().weight.device, dtype=spec.torch_dtype)
        drafter.attach_target(target)
        return drafter.eval()

    def proposer(self, model: nn.Module, vocab_size: int) -> nn.Module:
        return DFlashProposer(model, vocab_size)


def block_anchors(keep: torch.Tensor, input_ids: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """`(B, n)` long anchor positions, `-1` where a sequence has fewer: per sequence `min(count, answers)` distinct
    answer positions (rows of `keep` `(B, T-1)`, the first candidate of a block anchored there is an answer token),
    drawn by a generator seeded from `seed` and the batch's tokens, sorted."""
    digest = zlib.crc32(input_ids.detach().cpu().numpy().tobytes())
    generator = torch.Generator().manual_seed(seed * 1_000_003 + digest)
    chosen = []
    for row in keep.cpu():
        positions = row.nonzero(as_tuple=True)[0]
        pick = torch.randperm(positions.numel(), generator=generator)[:count]
        chosen.append(positions[pick].sort().values)
    width = max([len(c) for c in chosen] + [1])
    out = torch.full((keep.shape[0], width), -1, dtype=torch.long)
    for i, c in enumerate(chosen):
        out[i, : len(c)] = c
    return out.to(keep.device)


def select_rows(rows: HiddenRows | SparseRows, index: torch.Tensor) -> HiddenRows | SparseRows:
    """Row `i` of the result is row `index[i]` of `rows` (the target's answer rows, live or cached)."""
    if isinstance(rows, HiddenRows):
        return HiddenRows(rows.hidden[index], rows.head)
    if isinstance(rows, SparseRows):
        return SparseRows(rows.log_probs[index], rows.token_ids[index], rows.tail_mass[index])
    raise TypeError(f"a DFlash drafter trains against the target's answer rows, got {type(rows).__name__}")


def check_fits_target(config: DFlashConfig, target: nn.Module, source: Path) -> None:
    """Refuse a target whose states, embeddings or depth the drafter `config` (read from `source`) cannot take.

    Raises:
        ConfigError: one line naming the export, what the drafter was trained on, what this target has, the fix.
    """
    text = target.config.get_text_config(decoder=True)
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    rows, width = (int(n) for n in target.get_input_embeddings().weight.shape)
    fix = "evaluate it with the target it was trained on (models.target), or train one for this target (draft=dflash)"
    found = {
        "hidden size": (config.target_hidden_size, hidden),
        "embedding width": (config.hidden_size, width),
        "vocabulary (embedding rows)": (config.vocab_size, rows),
    }
    for what, (trained, here) in found.items():
        if trained != here:
            raise ConfigError(
                f"the DFlash drafter {source} was trained on a target of {what} {trained}, this target has {here}: "
                f"{fix}"
            )
    if max(config.target_layer_ids) >= layers:
        raise ConfigError(
            f"the DFlash drafter {source} fuses target states {list(config.target_layer_ids)}, but this target has "
            f"{layers} layers: {fix}"
        )
