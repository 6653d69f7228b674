"""Checks of what a config plans over its whole run, made before the first model loads (`validate_config`).

- A draft continued from an export (`<stage>.init`) must be of a kind that can continue from it, and the export of
  the kind it trains (an EAGLE-3 export is not a causal LM to continue as one).
- Every phase of `stage=sequential`: the phase's settings, its draft kind continuing the previous phase's draft
  (phases after the first), and its self-reference warm-up, so that a mistake in phase 2 costs a second and not a
  whole first phase.
- A self-reference selector (`selector=adaspec_lagged|adaspec_ema`) must start scoring before the run's last
  optimizer step, or the run is plain distillation labelled AdaSPEC. When the steps are capped (`max_steps`) this
  is checked here; when they follow from the data (epochs), `SelfReference.place` checks it at fit start.
"""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.errors import ConfigError, UserError
from specdistill.selection.self_reference import check_scoring_starts, first_scoring_step

TRAINING_STEPS = ("distill", "adaspec")  # the steps that train a draft of `cfg.draft`'s kind


def check_plan(cfg: DictConfig, stages: list[str]) -> None:
    """All the checks above for a launch that runs `stages` (`validation.running_stages`)."""
    if "sequential" in stages and cfg.get("sequential") is not None:
        check_sequential_phases(cfg)
        return
    for stage in stages:
        if stage in TRAINING_STEPS and cfg.get(stage) is not None:
            check_init_kind(cfg, stage)
    if "adaspec" in stages and cfg.get("adaspec") is not None:
        check_self_reference_steps(cfg)


def check_init_kind(cfg: DictConfig, stage: str) -> None:
    """`<stage>.init`, an earlier export, holds a draft of the kind this run trains, and that kind can continue it."""
    from specdistill.drafts import exported_kind
    from specdistill.drafts.registry import kind_name
    from specdistill.stages.model_loading import draft_kind

    init = cfg[stage].get("init")
    if not init:
        return
    configured = draft_kind(cfg)
    found = exported_kind(init)
    differs = type(found) is not type(configured)
    if differs and (found.reads_target or configured.reads_target):
        want, have = kind_name(type(configured)), kind_name(type(found))
        raise ConfigError(
            f"{stage}.init={init} is an export of the {have} draft kind, but this run trains a {want} draft: continue "
            f"it with draft={have}, or point {stage}.init at an export of a {want} draft"
        )
    configured.continued_from(str(init))  # a kind that cannot continue from an export refuses here


def check_sequential_phases(cfg: DictConfig) -> None:
    """Each phase of `stage=sequential` as `sequential.run` will compose it, checked before phase 1 trains."""
    from specdistill.stages.model_loading import draft_kind
    from specdistill.stages.sequential import METHOD_STEPS, phase_config
    from specdistill.stages.settings import SequentialSettings, build_settings
    from specdistill.validation import check_stage_settings, running_stages

    settings: SequentialSettings = build_settings(cfg, "sequential")
    kind = draft_kind(cfg)
    first = dict.fromkeys(METHOD_STEPS)
    for index, task in enumerate(settings.phases):
        later = {method: f"<phase {index} {method} export>" for method in METHOD_STEPS}
        phase = phase_config(
            cfg, task, first if index == 0 else later, settings.epochs, settings.target_answers
        )
        for step in running_stages(phase):
            check_stage_settings(phase, step)
        if index > 0:
            try:
                kind.continued_from(later["distillspec"])
            except ConfigError as error:
                raise ConfigError(
                    f"stage=sequential: phase {index + 1} ({task}) continues each method's draft of phase {index}, "
                    f"which this draft kind cannot do: {error}"
                ) from error
        check_self_reference_steps(phase, where=f"phase {index + 1} ({task}) of stage=sequential: ")


def check_self_reference_steps(cfg: DictConfig, where: str = "") -> None:
    """The selector's settings (built once, as the adaspec stage builds it), then a self-reference selector's first
    scoring step against the adaspec stage's `max_steps`, where capped."""
    from specdistill.stages.adaspec import compute_matched, is_self_referencing
    from specdistill.stages.settings import build_settings
    from specdistill.stages.trainer import trainer_config

    settings = build_settings(cfg, "adaspec")
    try:  # every selector range check, before the pipeline's earlier steps train
        instantiate(cfg.selector, k=settings.k)
    except InstantiationException as error:
        if isinstance(error.__cause__, UserError):
            raise error.__cause__ from None
        raise
    if not is_self_referencing(cfg):
        return
    selector = cfg.selector
    first = first_scoring_step(
        str(selector.self_reference), selector.get("every", 1), selector.get("warmup_steps", 1)
    )
    trainer = trainer_config(cfg, "adaspec")
    if settings.compute_matched:
        _, trainer, _ = compute_matched(settings, trainer)
    steps = trainer.get("max_steps")
    if steps is None or int(steps) < 0:
        return  # the steps follow from the data: SelfReference.place checks them at fit start
    check_scoring_starts(first, int(steps), f"{where}adaspec.trainer.max_steps={int(steps)}")
