"""The EAGLE-3 draft kind: a head on the frozen target's hidden states (`specdistill.drafts.eagle3.model`).

`python train.py stage=distill draft=eagle3` trains an `Eagle3Head` through `DistillModule`:

- `resolve`: the kind for a target, a new kind (a kind is never changed): its fused layers (`aux_layer_ids`, the
  target's default when none are set) and the target it names as verifier, what the stages and the export read;
- `build`: the head's shape from the target's config (the layers `resolve` fixes), the target's input embeddings
  attached (frozen, shared, never exported); `prepare` sets the draft vocabulary to the `draft_vocab_size` most frequent answer tokens of the
  training split (ties by id), so the vocabulary is a function of the task's training data only.
- `training_rows`: training-time test. The head is unrolled on its own outputs for `ttt_steps` steps
  (`Eagle3Head.unroll`); step `j`'s rows are every answer position, scored by the head's chain of `j` own steps
  before it, weighted `step_weight ** j`, against the target's softmax restricted to the draft vocabulary (its
  logits at those columns, renormalised); rows whose target argmax lies outside the draft vocabulary, and rows whose
  chain would start before the sequence, are left out. With forward KL (`divergence=forward_kl`, the default) this
  is the public recipe's loss (soft cross-entropy up to the target's entropy, which has no gradient).
- `export`: the layout vLLM and SGLang load (`config.json` with `architectures: ["LlamaForCausalLMEagle3"]`,
  `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, no embeddings), the tokenizer,
  `specdistill.json` and `draft_kind.json`; and in `speculators/` the same head in vLLM's `speculators` format
  (`Eagle3Speculator`, `specdistill.drafts.eagle3.export`), naming the target it was built on as its verifier.
- `load`: needs the loaded target (`load_draft(..., target=...)`, which evaluate, rollout and acceptance_head
  pass), whose input embeddings the head attaches, and refuses in one line a target the head does not fit (another
  hidden size or vocabulary, too few layers for its `aux_layer_ids`), and `loaded_kind` is the kind of the head it
  read; `proposer`: an `Eagle3Proposer`, the proposer of every head on the target's states
  (`specdistill.drafts.target_heads`).
- heads trained elsewhere, without our record: `Eagle3.from_layout(path)` recognises an EAGLE-3 head in the layout
  vLLM and SGLang read (SpecForge's and SafeAILab/EAGLE's `LlamaForCausalLMEagle3`, vLLM's other names for its Llama
  EAGLE-3 head) or in vLLM's `speculators` layout (`speculators_model_type: eagle3`), and `load` reads it: its tensors
  renamed to ours, its shape from its config (`read_foreign_head`). One it cannot hold is one `InputFileError`.
- `teacher_forced`: SpecDec++ on the head (rollout labels, acceptance-head inputs): the unroll's step 0 over the
  target's states, the state after the final norm and the logits on target ids (`-inf` outside the draft vocabulary).

Index convention: `aux_layer_ids` are indices into the target's `output_hidden_states` (the state entering decoder
layer `i`), the same numbers as vLLM's `eagle_aux_hidden_state_layer_ids` (see `specdistill.drafts.eagle3.model`).
"""

from __future__ import annotations

import json
import logging
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
from specdistill.drafts.eagle3.export import export_speculators
from specdistill.drafts.eagle3.foreign import WEIGHTS_FILE, one_line, read_foreign_head
from specdistill.drafts.eagle3.model import (
    Eagle3Config,
    Eagle3Head,
    answer_token_counts,
    check_aux_layer_ids,
    default_aux_layer_ids,
    draft_vocabulary,
    eagle3_config_for,
)
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.drafts.target_heads.export import verifier_of, write_checkpoint
from specdistill.errors import ConfigError, InputFileError
from specdistill.losses.rows import GatheredLogitRows, HiddenRows
from specdistill.models.loading import ModelSpec

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_DIR = (
    "speculators"  # the same head in vLLM's speculators format (specdistill.drafts.eagle3.export)
)


class ProjectedHead:
    """A linear output layer as an `OutputHead`-like head: `(..., H) -> (..., vocab_size)` (the draft's rows)."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer  # what the chunked loss checks for trainable parameters
        self.vocab_size = layer.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden)


def _unrolled(
    draft: nn.Module, target: nn.Module | None, batch: Mapping[str, Any], steps: int, caller: str
) -> list[Any]:
    """The head's unroll of `steps` steps over the target's states of `batch` (`Eagle3Head.unroll`)."""
    if target is None:
        raise ValueError(
            f"an EAGLE-3 head drafts from the target's hidden states: pass the target to {caller}"
        )
    layers = draft.config.aux_layer_ids
    _, states = target_states(target, batch, layers)
    features = torch.cat([states[i] for i in layers], dim=-1)
    return draft.unroll(features, batch["input_ids"], batch["attention_mask"], steps)


class TargetVocabularyHead:
    """An EAGLE-3 head's output layer on the target's ids: `(..., H) -> (..., vocab_size)`, draft id `i` at target
    id `i + d2t[i]`, `-inf` at every other target id (`vocab_size` None: the head's whole target vocabulary)."""

    def __init__(self, head: Eagle3Head, vocab_size: int | None = None) -> None:
        self.head = head
        self.vocab_size = head.config.vocab_size if vocab_size is None else vocab_size
        self.target_ids = head.target_ids
        if int(self.target_ids.max()) >= self.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head's draft vocabulary names target ids up to {int(self.target_ids.max())}, outside "
                f"the tokenizer's {self.vocab_size} tokens: build the draft vocabulary from this tokenizer's data"
            )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.head.lm_head(hidden)
        logits = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.target_ids] = draft
        return logits


class Eagle3(DraftKind):
    """The draft is an EAGLE-3 head (`conf/draft/eagle3.yaml`).

    A kind is never changed by its methods: `resolve(target)` returns the kind with what it leaves to the target
    fixed (`aux_layer_ids` None becomes the target's default, `verifier` names the target), which the stages read
    once the target is loaded and an export records; `loaded_kind` the kind of a head `load` read.

    Args:
        draft_vocab_size: tokens of the draft vocabulary (capped at the tokenizer's vocabulary).
        aux_layer_ids: the three target states fused (output_hidden_states indices); None: `(2, L // 2, L - 3)`,
            fixed by `resolve`.
        ttt_steps: training-time-test steps (>= 1).
        step_weight: loss weight ratio between consecutive steps (step `j` weighs `step_weight ** j`).
        norm_before_residual: the head's residual is the normed input (SpecForge's option); exported as stated.
        verifier: `(name_or_path, architectures)` of the target the head drafts for, which the `speculators` export
            names (`verifier_of`); None: not known (`resolve` sets it).
    """

    reads_target = True
    one_row_per_token = False
    exported_settings = (
        "draft_vocab_size",
        "aux_layer_ids",
        "ttt_steps",
        "step_weight",
        "norm_before_residual",
    )
    packing_refusal = None  # its unroll masks attention and chains per example (`unroll(segment_ids=...)`)
    zero3_refusal = (
        "the head shares the frozen target's embeddings and reads its output layer directly, and ZeRO-3 would "
        "partition them across ranks, which this kind does not gather yet: use trainer=deepspeed_zero2 (or ddp, "
        "gpu), with the target's weights whole on every GPU"
    )

    def __init__(
        self,
        draft_vocab_size: int = 32000,
        aux_layer_ids: list[int] | tuple[int, ...] | None = None,
        ttt_steps: int = 7,
        step_weight: float = 0.8,
        norm_before_residual: bool = False,
        *,
        verifier: tuple[str | None, Sequence[str]] | None = None,
    ) -> None:
        if (
            isinstance(draft_vocab_size, bool)
            or not isinstance(draft_vocab_size, int)
            or draft_vocab_size < 1
        ):
            raise ConfigError(f"draft.draft_vocab_size={draft_vocab_size!r} must be a positive int")
        if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, int) or ttt_steps < 1:
            raise ConfigError(f"draft.ttt_steps={ttt_steps!r} must be an int >= 1 (1: no unrolling)")
        if not 0.0 < float(step_weight) <= 1.0:
            raise ConfigError(f"draft.step_weight={step_weight!r} must lie in (0, 1]")
        self.draft_vocab_size = draft_vocab_size
        self.aux_layer_ids = None if aux_layer_ids is None else tuple(int(i) for i in aux_layer_ids)
        self.ttt_steps = ttt_steps
        self.step_weight = float(step_weight)
        self.norm_before_residual = bool(norm_before_residual)
        # where the target came from (path or hub id, architectures): the speculators export names it as verifier
        name, architectures = verifier if verifier is not None else (None, [])
        self.verifier: tuple[str | None, list[str]] = (name, list(architectures))

    @property
    def target_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """The target states the stages fetch for the head: `aux_layer_ids`, none before `resolve` fixes them."""
        return () if self.aux_layer_ids is None else self.aux_layer_ids

    def resolve(self, target: nn.Module | None) -> Eagle3:
        """This kind for `target`: `aux_layer_ids` the given ones or the target's default (`(2, L // 2, L - 3)`),
        checked against its depth, and `verifier` naming it; the other settings unchanged.

        Raises:
            ConfigError: the fused layers are not three increasing states entering the target's decoder layers.
        """
        if target is None:
            raise ValueError(
                "an EAGLE-3 head reads the target's hidden states: this stage loads no target model"
            )
        layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
        ids = default_aux_layer_ids(layers) if self.aux_layer_ids is None else self.aux_layer_ids
        try:
            ids = check_aux_layer_ids(ids, layers)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        return Eagle3(**{**self.settings(), "aux_layer_ids": list(ids)}, verifier=verifier_of(target))

    def loaded_kind(self, draft: nn.Module, target: nn.Module | None) -> Eagle3:
        """The kind of the head `draft` that `load` read for `target`: the head's draft vocabulary, fused layers
        and `norm_before_residual` (a kind with default settings that loaded a head trained with others takes the
        head's), this kind's training settings, the target as verifier."""
        config = draft.config
        return Eagle3(
            draft_vocab_size=config.draft_vocab_size,
            aux_layer_ids=list(config.aux_layer_ids),
            ttt_steps=self.ttt_steps,
            step_weight=self.step_weight,
            norm_before_residual=config.norm_before_residual,
            verifier=verifier_of(target),
        )

    def settings(self) -> dict[str, Any]:
        return {
            "draft_vocab_size": self.draft_vocab_size,
            "aux_layer_ids": None if self.aux_layer_ids is None else list(self.aux_layer_ids),
            "ttt_steps": self.ttt_steps,
            "step_weight": self.step_weight,
            "norm_before_residual": self.norm_before_residual,
        }

    # -- building and training

    def build(self, target: nn.Module | None, vocab_size: int, pure_bf16: bool = False) -> nn.Module:
        """A random head shaped for `target` (fusing the layers `resolve(target)` fixes), its draft vocabulary the
        first ids until `prepare` sets it."""
        resolved = self.resolve(target)
        embeddings = target.get_input_embeddings()
        size = min(self.draft_vocab_size, vocab_size)
        if size < self.draft_vocab_size:
            log.info(
                "draft.draft_vocab_size=%d capped at the tokenizer's %d tokens", self.draft_vocab_size, size
            )
        try:
            config = eagle3_config_for(
                target.config, embeddings.weight.shape[0], size, resolved.aux_layer_ids
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error
        config = Eagle3Config(**{**config.to_dict(), "norm_before_residual": self.norm_before_residual})
        head = Eagle3Head(config)
        head.to(device=embeddings.weight.device, dtype=torch.bfloat16 if pure_bf16 else torch.float32)
        head.attach_embeddings(embeddings)
        head.train()
        return head

    def prepare(self, draft: nn.Module, data: Any) -> None:
        """The draft vocabulary: the most frequent answer tokens of the training split (`draft_vocabulary`)."""
        counts = answer_token_counts(data.tokenized("train")["labels"], draft.config.vocab_size)
        draft.set_vocabulary(draft_vocabulary(counts, draft.config.draft_vocab_size))

    def check_reference(self, draft: nn.Module, reference: nn.Module) -> None:
        """An AdaSPEC reference head must fuse the same target layers and draft the same vocabulary as `draft`:
        its unrolled rows are then the draft's rows, one for one (`KindReference`)."""
        if not isinstance(reference, Eagle3Head):
            raise ConfigError(
                f"the AdaSPEC reference is a {type(reference).__name__}, but the draft is an EAGLE-3 head: pass the "
                "export of a distill run with draft=eagle3 (adaspec.reference=<distill_run_dir>/export)"
            )
        if tuple(reference.config.aux_layer_ids) != tuple(draft.config.aux_layer_ids):
            raise ConfigError(
                f"the AdaSPEC reference head fuses target layers {list(reference.config.aux_layer_ids)}, the draft "
                f"{list(draft.config.aux_layer_ids)}: train both with the same draft.aux_layer_ids"
            )
        if not torch.equal(reference.target_ids.cpu(), draft.target_ids.cpu()):
            raise ConfigError(
                f"the AdaSPEC reference head's draft vocabulary ({reference.config.draft_vocab_size} tokens) is not "
                f"the draft's ({draft.config.draft_vocab_size}): train both on the same task with the same "
                "draft.draft_vocab_size, so that their unrolled rows are the same rows"
            )

    def training_rows(
        self,
        draft: nn.Module,
        batch: Mapping[str, Any],
        keep: torch.Tensor,
        target: TargetPass,
        vocab_size: int,
    ) -> TrainingRows:
        """The unrolled steps' rows (see the module docstring), `M <= ttt_steps * N` of them.

        Step `j` scores the answer row `(b, s)` (the target's row predicting token `s + 1`) from index
        `p = s - 1 - j` of the unroll, the chain anchored at `p`; `p < 0` has no chain and is left out, and so is a
        chain anchored in another example of a packed row (`specdistill.data.packing`).
        """
        if not isinstance(target.rows, HiddenRows):
            raise ValueError(
                "an EAGLE-3 head trains against the target's hidden rows, not cached distributions"
            )
        features = torch.cat([target.hidden_states[i] for i in draft.config.aux_layer_ids], dim=-1)
        rows, positions = keep.nonzero(as_tuple=True)  # (N,) answer rows in row-major order
        # the earliest anchor any row reads: the prompt's earlier anchors are attended to, never unrolled
        start = max(0, int(positions.min()) - self.ttt_steps) if positions.numel() else 0
        segment_ids = batch.get("segment_ids")  # packed rows: no chain reads across an example's end
        outputs = draft.unroll(
            features, batch["input_ids"], batch["attention_mask"], self.ttt_steps, start, segment_ids
        )
        with torch.no_grad():
            argmax, restricted = _target_columns(target.rows, draft.target_ids)
            in_vocab = draft.t2d[argmax]
        hidden, weight, index = [], [], []
        answer = torch.arange(rows.numel(), device=rows.device)
        for step, out in enumerate(outputs):
            anchor = positions - 1 - step
            valid = (anchor >= 0) & in_vocab
            if segment_ids is not None:
                valid &= segment_ids[rows, anchor.clamp_min(0)] == segment_ids[rows, positions]
            hidden.append(out.normed[rows[valid], anchor[valid] - start])
            weight.append(torch.full((int(valid.sum()),), self.step_weight**step, device=rows.device))
            index.append(answer[valid])
        answer_index = torch.cat(index)
        return TrainingRows(
            target=GatheredLogitRows(restricted, answer_index),
            draft=HiddenRows(torch.cat(hidden), ProjectedHead(draft.lm_head)),
            weight=torch.cat(weight),
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
        """The unroll's step 0 over the target's states of `batch`: the state at position `t` is EAGLE position
        `t - 1` after the final norm (it read the target's states of `t - 1` and token `t`, and proposes token
        `t + 1`, as the decoding proposer's real-state positions do); position 0 has no target state before it and
        holds zeros. The head's logits are on the target's ids, `-inf` outside the draft vocabulary (such a token
        cannot be drafted)."""
        step = _unrolled(draft, target, batch, 1, "teacher_forced")[0]
        hidden = torch.cat([torch.zeros_like(step.normed[:, :1]), step.normed[:, :-1]], dim=1)
        return DraftStates(hidden, TargetVocabularyHead(draft, vocab_size))

    @torch.no_grad()
    def chain_candidates(
        self,
        draft: nn.Module,
        target: nn.Module | None,
        batch: Mapping[str, Any],
        depth: int,
        vocab_size: int | None,
    ) -> torch.Tensor:
        """The unroll's `depth` steps over the target's states of the one sequence in `batch`: candidate `j` after
        position `t` is step `j` at EAGLE index `t - 1` (it read the target's states up to `t - 1`, token `t` and its
        own `j` steps; see `teacher_forced`), on the target's ids; position 0 proposes nothing."""
        head = TargetVocabularyHead(draft, vocab_size)
        steps = _unrolled(draft, target, batch, depth, "chain_candidates")
        ids = batch["input_ids"]
        out = torch.full((ids.shape[1], depth), NO_CANDIDATE, dtype=torch.long, device=ids.device)
        for j, step in enumerate(steps):
            out[1:, j] = head(step.normed[0, :-1]).argmax(dim=-1)
        return out

    # -- export and loading

    def export(
        self,
        draft: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        out_dir: Path,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """vLLM's and SGLang's EAGLE-3 layout (see the module docstring), the tokenizer and this kind's record."""
        out = write_checkpoint(
            Path(out_dir), draft.state_dict(), export_config(draft.config, tokenizer, draft), tokenizer
        )
        verifier, architectures = self.verifier
        export_speculators(
            draft, out / SPECULATORS_DIR, verifier, tokenizer, verifier_architectures=architectures
        )
        return self.finish_export(out, metadata)

    @classmethod
    def from_layout(cls, path: Path) -> Eagle3 | None:
        """The kind of an EAGLE-3 head that `path` holds without our `draft_kind.json` record, in the layout vLLM and
        SGLang read (SpecForge, SafeAILab/EAGLE) or in vLLM's `speculators` layout; None when `path` is no EAGLE-3 head
        (a Hugging Face causal LM, a hub id, no folder). Its settings are the head's (draft vocabulary, fused target
        layers, `norm_before_residual`); `load` reads the head.

        Raises:
            InputFileError: the folder holds an EAGLE-3 head this kind cannot read (tensors missing, unknown or of
                shapes its config.json does not give, options the head does not have): one line naming the folder,
                what it found and what it expects.
        """
        head = read_foreign_head(Path(path))
        if head is None:
            return None
        return cls(
            draft_vocab_size=head.fields["draft_vocab_size"],
            aux_layer_ids=head.aux_layer_ids,
            norm_before_residual=head.fields["norm_before_residual"],
        )

    def load(
        self, spec: ModelSpec, vocab_size: int | None = None, target: nn.Module | None = None
    ) -> nn.Module:
        """The head in `spec.dtype`, on the target's embeddings (`target` is required): our export (its config.json's
        `specdistill_eagle3`), or a head trained elsewhere (`from_layout`'s layouts; fused target layers it does not
        record are vLLM's default for this target). A target the head does not fit is refused before any tensor is
        read (`check_head_fits_target`)."""
        path = Path(spec.pretrained_model_name_or_path).expanduser()
        if target is None:
            raise ValueError(
                f"{path} is an EAGLE-3 head, which drafts on the target's embeddings and hidden states: load it "
                "with the target (load_draft(path, vocab_size, target=target))"
            )
        foreign = None if _is_our_export(path) else read_foreign_head(path)
        if foreign is None:
            config = config_from_export(path)
            check_head_fits_target(config, target, path)
            try:
                state = load_file(str(path / WEIGHTS_FILE))
            except (OSError, SafetensorError) as error:
                raise InputFileError(
                    f"{path / WEIGHTS_FILE} is not a readable EAGLE-3 head ({one_line(error)}): it was probably cut "
                    "short while copying; copy or re-export it"
                ) from error
        else:
            config = foreign.config(target)
            check_head_fits_target(config, target, path, recorded=foreign.aux_layer_ids is not None)
            state = foreign.state_dict(target)
        head = Eagle3Head(config)
        try:
            head.load_state_dict(state, strict=True)
        except (OSError, RuntimeError) as error:
            raise InputFileError(
                f"{path / WEIGHTS_FILE} does not hold this EAGLE-3 head ({one_line(error)})"
            ) from error
        head.to(dtype=spec.torch_dtype)
        head.attach_embeddings(target.get_input_embeddings())
        head.to(target.get_input_embeddings().weight.device)
        return head.eval()

    def proposer(self, model: nn.Module, vocab_size: int) -> nn.Module:
        return Eagle3Proposer(model, vocab_size)


def _target_columns(
    rows: HiddenRows, columns: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(argmax (N,), logits (N, len(columns)))` of the target's rows: the argmax over the whole vocabulary and the
    logits at the draft vocabulary's columns, projected `chunk` rows at a time (never all `(N, V)` at once). The
    unrolled steps' rows gather from these (`GatheredLogitRows`), so each answer row is projected once, not once
    per step; they hold `N x draft_vocab_size` values."""
    argmax, kept = [], []
    for i in range(0, len(rows), chunk):
        logits = rows.head(rows.hidden[i : i + chunk])
        argmax.append(logits.argmax(-1))
        kept.append(logits[..., columns])
    if not argmax:
        empty = rows.hidden.new_zeros((0, columns.numel()))
        return torch.zeros(0, dtype=torch.long, device=rows.hidden.device), empty
    return torch.cat(argmax), torch.cat(kept)


def export_config(
    config: Eagle3Config, tokenizer: PreTrainedTokenizerBase, head: nn.Module
) -> dict[str, Any]:
    """The `config.json` vLLM (`eagle3`), SGLang and SafeAILab/EAGLE read: a one-layer Llama with EAGLE-3 fields,
    plus `specdistill_eagle3`, the head's full shape for `config_from_export`."""
    dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_mtp_layernorm": False,
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": dtype,
        "specdistill_eagle3": config.to_dict(),
    }


def config_from_export(path: Path) -> Eagle3Config:
    """The head's shape recorded in an export's `config.json`."""
    config_path = path / "config.json"
    try:
        record = json.loads(config_path.read_text())["specdistill_eagle3"]
        return Eagle3Config(**record)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise InputFileError(
            f"{config_path} is not a specdistill EAGLE-3 export's config ({error!r}): re-export the head"
        ) from error


def _is_our_export(path: Path) -> bool:
    """Whether `path/config.json` records our head's shape (`specdistill_eagle3`, what `export_config` writes)."""
    try:
        record = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "specdistill_eagle3" in record


# ---------------------------------------------------------------------------------------------- the target


def _target_name(target: nn.Module) -> str:
    name = verifier_of(target)[0]
    return f"{type(target).__name__} {name}" if name else type(target).__name__


def check_head_fits_target(
    config: Eagle3Config, target: nn.Module, source: Path, recorded: bool = True
) -> None:
    """Refuse, before any tensor op, a target whose states or embeddings the head `config` (read from `source`)
    cannot take: another hidden size (`fc` reads `3 x target_hidden_size` features, the layer the target's
    embeddings of width `hidden_size`), another vocabulary (`t2d` and the embeddings have `vocab_size` rows), or too
    few layers for `aux_layer_ids` (`recorded`: the head names them; else they are the target's default).

    Raises:
        ConfigError: one line naming the export, what the head was trained on, what this target has, and the fix.
    """
    text = target.config.get_text_config(decoder=True)
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    rows, width = (int(n) for n in target.get_input_embeddings().weight.shape)
    name = _target_name(target)
    fix = (
        "evaluate it with the target it was trained on (models.target), or train a head for this target "
        "(draft=eagle3)"
    )
    if config.target_hidden_size != hidden:
        raise ConfigError(
            f"the EAGLE-3 head {source} reads a target of hidden size {config.target_hidden_size} (its "
            f"target_hidden_size), but this target ({name}) has hidden size {hidden}: {fix}"
        )
    if config.hidden_size != width:
        raise ConfigError(
            f"the EAGLE-3 head {source} is {config.hidden_size} wide and reads the target's input embeddings, but "
            f"this target's ({name}) are {width} wide: {fix}"
        )
    if config.vocab_size != rows:
        raise ConfigError(
            f"the EAGLE-3 head {source} drafts over a target vocabulary of {config.vocab_size} tokens (its "
            f"vocab_size), but this target ({name}) has {rows} input embeddings: {fix}"
        )
    ids = list(config.aux_layer_ids)
    if max(ids) >= layers:
        where = "its eagle_aux_hidden_state_layer_ids" if recorded else "vLLM's default for this target"
        raise ConfigError(
            f"the EAGLE-3 head {source} fuses the target states entering layers {ids} ({where}), but this target "
            f"({name}) has {layers} layers: {fix}"
        )
