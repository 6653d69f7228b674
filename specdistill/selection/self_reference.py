"""A draft that is its own reference: AdaSPEC's D(p, r) scored by an earlier state of the draft being trained.

AdaSPEC's reference r is a draft distilled on all tokens by a separate stage. `SelfReference` replaces it with a
frozen copy of the training draft that follows it at a distance, so no reference stage runs (the question the
AdaSPEC authors leave open: "dynamically assign the reference model to be an earlier checkpoint of the draft").
Two ways to follow, both updated by `DistillModule.on_before_optimizer_step` with the draft's weights *before* the
optimizer changes them (`before_optimizer_step(draft, step)`, `step` = optimizer steps done):

- `lagged` (every N): at every step s that is a multiple of N, the reference takes the snapshot saved N steps
  earlier and the current weights become the next snapshot, so from step N on the weights that score are between
  N and 2N steps old (two copies of the draft are held).
- `ema` (decay d): after every step, r = d * r + (1 - d) * w with w the weights the step started from, so r holds
  only earlier weights (their mean age is d / (1 - d) steps).

Both start as the draft's initial weights, which at step 0 *are* the current weights: the reference scores a step
(`scores_step`) only once it is old enough (`lagged`: its weights are at least N steps old; `ema`: after
`warmup_steps` >= 1 steps), and until then the module keeps every answer token (plain distillation, recorded with
no scores), so the current weights never score. `reference_step` is the step whose weights the lagged reference
holds (tests check it).

Scoring is delegated to the provider of the draft's kind built on the copy (`OnlineReference` for one row per
answer token, `KindReference` for EAGLE-3's unrolled rows): online, every micro-batch. The copies travel in the
module's checkpoint (`state_dict()` / `load_state_dict()`), so a resumed run follows the same weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from specdistill.errors import ConfigError
from specdistill.selection.reference import ReferenceScores

MODES = ("lagged", "ema")


class SelfReference(ReferenceScores):
    """A frozen copy of the draft following it `lagged` or by `ema` (module docstring).

    Args:
        draft: the trainable draft (copied now; the copy is frozen and held outside every state dict).
        scorer: builds the kind's provider on the copy: `scorer(copy) -> ReferenceScores`
            (`OnlineReference(copy, divergence, vocab_size)` or `KindReference(copy, kind, divergence, vocab_size)`).
        mode: `lagged` or `ema`.
        every: `lagged`: the refresh period N in optimizer steps, >= 1.
        decay: `ema`: d in (0, 1).
        warmup_steps: `ema`: steps of plain distillation before the EMA scores, >= 1.
    """

    follows_draft = True

    def __init__(
        self,
        draft: nn.Module,
        scorer: Callable[[nn.Module], ReferenceScores],
        mode: str = "lagged",
        every: int = 50,
        decay: float = 0.99,
        warmup_steps: int = 10,
    ) -> None:
        check_self_reference(mode, every, decay, warmup_steps)
        self.mode, self.every, self.decay, self.warmup_steps = (
            mode,
            int(every),
            float(decay),
            int(warmup_steps),
        )
        self.inner = scorer(copy.deepcopy(draft))
        self.per_row = self.inner.per_row
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.reference_step = 0
        self._pending: dict[str, torch.Tensor] | None = (
            None  # lagged: the snapshot that becomes the reference next
        )

    @property
    def model(self) -> nn.Module:
        """The frozen copy that scores."""
        return self.inner.model

    # -- scoring: the kind's provider on the copy --

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        return self.inner.score(batch, answer_mask, target_rows)

    def score_rows(
        self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target: Any, rows: Any
    ) -> torch.Tensor:
        return self.inner.score_rows(batch, answer_mask, target, rows)

    def place(self, trainer: Any) -> None:
        """Refuse ZeRO-3 and a run whose optimizer steps end before the reference first scores, then place it."""
        from specdistill.utils.strategy import deepspeed_stage

        planned = trainer.estimated_stepping_batches
        if planned != float("inf"):
            check_scoring_starts(
                first_scoring_step(self.mode, self.every, self.warmup_steps), int(planned),
                "the adaspec run's planned optimizer steps (trainer.estimated_stepping_batches)",
            )  # fmt: skip

        if deepspeed_stage(trainer.strategy) == 3:
            raise ValueError(
                "a self-reference copies the draft's weights every step or every N steps, which ZeRO-3 partitions "
                "across ranks: use DeepSpeed stage 2 (trainer.strategy=deepspeed_stage_2) or a trained reference "
                "(selector=adaspec with adaspec.reference)"
            )
        self.inner.place(trainer)

    def to(self, device: torch.device | str) -> None:
        self.inner.to(device)

    # -- following the draft --

    def scores_step(self, step: int) -> bool:
        """True when the reference may score step `step`: its weights are old enough (never the current ones)."""
        if self.mode == "lagged":
            return step - self.reference_step >= self.every
        return step >= self.warmup_steps

    @torch.no_grad()
    def before_optimizer_step(self, draft: nn.Module, step: int) -> None:
        """Follow `draft`, whose weights are those step `step` started from (called before the optimizer runs)."""
        if self.mode == "ema":
            for ours, theirs in zip(self.model.parameters(), draft.parameters(), strict=True):
                ours.lerp_(theirs.detach().to(ours), 1.0 - self.decay)
            return
        if step % self.every:
            return
        if self._pending is not None:
            self.model.load_state_dict(self._pending)
            self.reference_step = step - self.every
        self._pending = {name: value.detach().clone() for name, value in draft.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the copy's weights, the pending snapshot and the reference's step."""
        return {
            "mode": self.mode,
            "reference_step": self.reference_step,
            "model": {name: value.detach().cpu() for name, value in self.model.state_dict().items()},
            "pending": None
            if self._pending is None
            else {name: value.cpu() for name, value in self._pending.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(
                f"the checkpoint's self-reference follows the draft by {state.get('mode')!r} but this run by "
                f"{self.mode!r}: resume with the selector the run started with"
            )
        self.model.load_state_dict(state["model"])
        self.reference_step = int(state["reference_step"])
        device = next(self.model.parameters()).device
        pending = state.get("pending")
        self._pending = None if pending is None else {k: v.to(device) for k, v in pending.items()}


def first_scoring_step(mode: str, every: int, warmup_steps: int) -> int:
    """The first optimizer step a self-reference scores (`SelfReference.scores_step`): `every` for `lagged` (the
    first snapshot is then `every` steps old), `warmup_steps` for `ema`."""
    return int(every) if mode == "lagged" else int(warmup_steps)


def check_scoring_starts(first: int, steps: int, where: str) -> None:
    """Refuse a run of `steps` optimizer steps (described by `where`) in which a self-reference that first scores at
    step `first` never scores: it would train plain distillation and export it as AdaSPEC.

    Raises:
        ConfigError: `first >= steps`.
    """
    if first < steps:
        return
    raise ConfigError(
        f"the self-reference first scores at optimizer step {first}, but the run has {steps} ({where}): every step "
        f"would be plain distillation exported as AdaSPEC. Lower selector.every (lagged) or selector.warmup_steps (ema) "
        f"below {steps} (e.g. {max(1, steps // 4)}), or train longer"
    )


def _integer_at_least_one(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check_self_reference(mode: str, every: int, decay: float, warmup_steps: int) -> None:
    """Raise ConfigError (a ValueError) naming the `selector.<option>`, its value, its range and the fix for a
    self-reference setting out of range; only the options `mode` reads are checked."""
    if mode not in MODES:
        raise ConfigError(
            f"selector.self_reference={mode!r} must be one of {list(MODES)}: choose selector=adaspec_lagged or "
            "selector=adaspec_ema"
        )
    if mode == "lagged" and not _integer_at_least_one(every):
        raise ConfigError(
            f"selector.every={every!r}: the optimizer steps between refreshes of the lagged reference must be an "
            "integer >= 1: set e.g. selector.every=50"
        )
    if mode == "ema":
        try:
            in_range = 0.0 < float(decay) < 1.0  # False for NaN
        except (TypeError, ValueError):
            in_range = False
        if isinstance(decay, bool) or not in_range:
            raise ConfigError(
                f"selector.decay={decay!r}: the EMA's weight on its past must lie in (0, 1) (mean age "
                "decay / (1 - decay) steps): set e.g. selector.decay=0.99"
            )
        if not _integer_at_least_one(warmup_steps):
            raise ConfigError(
                f"selector.warmup_steps={warmup_steps!r} must be an integer >= 1 (at step 0 the EMA is the current "
                "draft, which must not score itself): set e.g. selector.warmup_steps=10"
            )
