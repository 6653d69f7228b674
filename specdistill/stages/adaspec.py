"""Stage `adaspec`: selective distillation of the base draft, guided by a frozen reference (docs/METHODS.md section 3).

Three models: the frozen target, the frozen reference (the `distill` stage's export, by path) and the trainable
draft, initialised from the *base* draft checkpoint. The selector (`conf/selector/`) keeps the fraction `adaspec.k`
of answer tokens; the reference's per-token divergence comes from the online reference or, with
`adaspec.cached_scores` (default), from one scoring pass saved beside the run (`reference_scores/`), run at fit start
where the Trainer's strategy put the target, each rank scoring a shard. With `adaspec.target_cache=<m>` the
target's top-m answer distributions are cached once (`target_cache/`, or `adaspec.target_cache_dir`, which a
pipeline fills with the distill step's cache: reused when the key matches), at fit start in the same way, and
training runs without the target model (docs/METHODS.md section 2, "Cached target distributions").

With `draft=eagle3` the draft and the reference are EAGLE-3 heads: the draft starts from random weights like the
distill step's, the reference is that step's export, and the selector ranks the unrolled steps' rows by the gap
between the draft's and the reference head's divergence on the same row (`KindReference`, online: set
`adaspec.cached_scores=false`; the reference must fuse the same layers and draft the same vocabulary).
"""

from __future__ import annotations

import enum
import functools
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, open_dict

from specdistill.callbacks.token_selection import SelectionReport
from specdistill.data.datamodule import TaskDataModule
from specdistill.drafts import load_draft
from specdistill.drafts.base import DraftKind
from specdistill.errors import ConfigError
from specdistill.losses.divergence import Divergence
from specdistill.models import ModelSpec
from specdistill.models.frozen import Frozen
from specdistill.modules.distill import DistillModule
from specdistill.selection.base import Selector
from specdistill.selection.reference import (
    KindReference,
    OnlineReference,
    ReferenceScores,
    ScoreOnceReference,
)
from specdistill.selection.self_reference import SelfReference
from specdistill.stages.datamodules import training_datamodule
from specdistill.stages.distill import train_and_export
from specdistill.stages.model_loading import draft_kind, load_models, model_spec
from specdistill.stages.outputs import write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import AdaSpecSettings, build_settings
from specdistill.stages.trainer import build_trainer, trainer_config
from specdistill.utils.batching import BatchPlan, batch_plan, matched_max_steps, world_size

log = logging.getLogger(__name__)
TRAINED_ROLES = ("draft",)  # built by the draft kind with fp32 master weights; target, reference stay frozen


@dataclass(frozen=True)
class Baseline:
    """The run AdaSPEC is matched to: the stage's own global batch plan and epochs, before scaling by 1/k."""

    plan: BatchPlan
    epochs: int


def compute_matched(
    settings: AdaSpecSettings, trainer_cfg: DictConfig
) -> tuple[AdaSpecSettings, DictConfig, Baseline]:
    """The authors' compute-matched protocol: global batch and micro-batch / k (`settings.k` = 0.4: 16 -> 40 and
    2 -> 5 per device), so every optimizer step sees the baseline's number of kept tokens; returns the scaled copies
    and the baseline (the unscaled batch plan on this world size, and the epochs).

    The step count is set by `matched_steps` once the training set's size is known. Only when the stage states its
    own `max_steps` (e.g. the tiny pair's tuning) does that cap stay, with epochs / k rounded up as before.
    """
    baseline = Baseline(
        batch_plan(
            settings.batch_size, world_size(trainer_cfg), settings.micro_batch_size,
            trainer_cfg.get("accumulate_grad_batches"),
        ),
        int(trainer_cfg.max_epochs),
    )  # fmt: skip
    k = settings.k
    micro = settings.micro_batch_size
    settings = replace(
        settings,
        batch_size=math.ceil(settings.batch_size / k),
        micro_batch_size=math.ceil(micro / k) if micro else micro,
    )
    trainer_cfg = trainer_cfg.copy()
    with open_dict(trainer_cfg):
        trainer_cfg.max_epochs = math.ceil(trainer_cfg.max_epochs / k)
    return settings, trainer_cfg, baseline


def matched_steps(baseline: Baseline, num_examples: int, trainer_cfg: DictConfig) -> None:
    """Train exactly the baseline's optimizer steps (`matched_max_steps`) unless `trainer_cfg` already caps the steps;
    epochs then stop bounding the run (the last one is partial: k = 0.4 gives 7.5 epochs, where whole epochs would
    give 8, 6.7% more steps than the baseline)."""
    if trainer_cfg.get("max_steps", -1) not in (None, -1):
        log.info("compute matching keeps the stage's own max_steps=%s", trainer_cfg.max_steps)
        return
    steps = matched_max_steps(num_examples, baseline.plan, baseline.epochs)
    with open_dict(trainer_cfg):
        trainer_cfg.max_steps = steps
        trainer_cfg.max_epochs = -1
    log.info("compute matched: %d optimizer steps, as the baseline's %s", steps, baseline)


def is_self_referencing(cfg: DictConfig) -> bool:
    """Whether the selector scores with the draft's own earlier weights (`selector=adaspec_lagged|adaspec_ema`):
    then no reference model is loaded and `adaspec.reference` and `adaspec.cached_scores` are not read."""
    selector = cfg.get("selector")
    return selector is not None and selector.get("self_reference") is not None


class ReferenceSource(str, enum.Enum):
    """Where the selector's reference divergence D(p, r) comes from (None where the selector reads none):

    - `self`: the draft's own earlier weights, online (`SelfReference`; no reference model);
    - `kind`: a reference of the draft's kind scored online on the draft's training rows (`KindReference`: an
      EAGLE-3 head, several rows per answer token);
    - `cached`: the reference LM scores the train split once at fit start (`ScoreOnceReference`);
    - `online`: the reference LM scores every micro-batch (`OnlineReference`).
    """

    SELF = "self"
    KIND = "kind"
    CACHED = "cached"
    ONLINE = "online"

    @property
    def loads_reference(self) -> bool:
        """Whether a reference model is loaded from `adaspec.reference` (every source but `self`)."""
        return self is not ReferenceSource.SELF


def reference_source(
    needs_reference: bool, self_referencing: bool, per_row: bool, cached_scores: bool
) -> ReferenceSource | None:
    """The `ReferenceSource` of a selector that reads a reference (`needs_reference`), scoring with the draft's
    own weights (`self_referencing`) or not, for a kind with several rows per answer token (`per_row`) or one,
    under `adaspec.cached_scores`; None when the selector reads no reference (nothing is loaded)."""
    if not needs_reference:
        return None
    if self_referencing:
        return ReferenceSource.SELF
    if per_row:
        return ReferenceSource.KIND
    return ReferenceSource.CACHED if cached_scores else ReferenceSource.ONLINE


def configured_reference_source(cfg: DictConfig) -> ReferenceSource | None:
    """The adaspec stage's `ReferenceSource` from its config alone (the selector's class, the draft kind,
    `adaspec.cached_scores`), checked: what the stage and validation both read.

    Raises:
        ConfigError: the per-token score cache for a kind scored row by row (`check_reference_source`).
    """
    selector = cfg.get("selector")
    if selector is None:
        return None
    cached_scores = bool(cfg.adaspec.cached_scores)
    source = reference_source(
        bool(getattr(get_class(selector._target_), "needs_reference", False)),
        is_self_referencing(cfg),
        not draft_kind(cfg).one_row_per_token,
        cached_scores,
    )
    check_reference_source(source, cached_scores)
    return source


def check_reference_source(source: ReferenceSource | None, cached_scores: bool) -> None:
    """A draft kind with several training rows per answer token (EAGLE-3) is scored by its reference online, row
    by row: refuse the per-token score cache for it."""
    if source is ReferenceSource.KIND and cached_scores:
        raise ConfigError(
            "adaspec.cached_scores=true caches one reference score per answer token, but this draft kind trains "
            "on several rows per answer token (EAGLE-3: one per unrolled step), which its reference head scores "
            "online on the same target pass: set adaspec.cached_scores=false"
        )


def build_reference(
    source: ReferenceSource | None,
    models: dict,
    kind: DraftKind,
    selector: Selector,
    divergence: Divergence,
    vocab_size: int,
    scores_dir: Path,
    datamodule: TaskDataModule,
    target: Frozen | None,
) -> ReferenceScores | None:
    """The provider of D(p, r) for `source` (`reference_source`); `models` holds the draft, and the reference
    model where the source runs one; `target`: the frozen target a cached scoring pass shares, if any."""
    if source is None:
        return None
    if source is ReferenceSource.SELF:
        # the draft's own earlier weights score, online (a cache cannot hold scores of weights that keep moving)
        log.info("AdaSPEC with a %s self-reference: no reference model is loaded", selector.self_reference)
        scorer = (
            functools.partial(KindReference, kind=kind) if not kind.one_row_per_token else OnlineReference
        )
        return SelfReference(
            models["draft"], lambda model: scorer(model, divergence=divergence, vocab_size=vocab_size),
            mode=selector.self_reference, every=selector.every, decay=selector.decay,
            warmup_steps=selector.warmup_steps,
        )  # fmt: skip
    if source is ReferenceSource.KIND:
        return KindReference(models["reference"], kind, divergence, vocab_size)
    if source is ReferenceSource.CACHED:
        # scored at fit start, on the devices the Trainer gives the target, every rank a shard of the train split
        return ScoreOnceReference(
            models["reference"], divergence, vocab_size, scores_dir, datamodule, target=target
        )
    return OnlineReference(models["reference"], divergence, vocab_size)


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "adaspec")
    k = settings.k  # in (0, 1], checked by AdaSpecSettings
    kind = draft_kind(cfg, settings.init)
    selector = instantiate(cfg.selector, k=k)
    self_referencing = is_self_referencing(cfg)
    source = configured_reference_source(cfg)
    if source is not None and source.loads_reference and not settings.reference:
        raise ValueError(
            "adaspec.reference is not set: pass the export directory of a `distill` run "
            "(adaspec.reference=<distill_run_dir>/export), or run stage=pipeline which wires it."
        )
    trainer_cfg = trainer_config(cfg, "adaspec")
    baseline = None
    if settings.compute_matched:
        settings, trainer_cfg, baseline = compute_matched(settings, trainer_cfg)
    seed_everything(cfg)
    reference_spec = None
    if source is not None and source.loads_reference:
        reference_spec = ModelSpec(
            pretrained_model_name_or_path=settings.reference, dtype=cfg.models.draft.get("dtype", "float32")
        )
    specs = {"target": model_spec(cfg.models.target)}
    if source in (ReferenceSource.CACHED, ReferenceSource.ONLINE):
        specs["reference"] = reference_spec
    tokenizer, models, vocab_size = load_models(cfg, specs, drafts=dict.fromkeys(TRAINED_ROLES, kind))
    kind = kind.resolve(models["target"])  # what it leaves to the target, fixed once (DraftKind.resolve)
    datamodule = training_datamodule(cfg, tokenizer, settings, trainer_cfg)
    kind.prepare(models["draft"], datamodule)
    if source is ReferenceSource.KIND:
        # a reference of the draft's kind (an EAGLE-3 head reads the target), scored on the draft's own rows
        models["reference"] = load_draft(reference_spec, vocab_size, target=models["target"]).model
        kind.check_reference(models["draft"], models["reference"])
    if baseline is not None:
        matched_steps(baseline, len(datamodule.tokenized("train")), trainer_cfg)
    divergence = instantiate(cfg.divergence)
    training = settings.target_source(kind).build(
        models.pop("target"), settings.target_cache_path(out_dir), tokenizer, datamodule, vocab_size, kind
    )
    # with a cached target the module holds no target model: the fit-start passes share its one holder
    reference = build_reference(
        source, models, kind, selector, divergence, vocab_size, out_dir / "reference_scores", datamodule,
        training.frozen,
    )  # fmt: skip
    module = DistillModule(
        draft=models["draft"],
        target=training.target,
        vocab_size=vocab_size,
        divergence=divergence,
        optimizer=instantiate(settings.optimizer),
        scheduler=instantiate(settings.scheduler),
        selector=selector,
        reference=reference,
        kind=kind,
        target_states=training.states,
    )
    # its `frozen` holder would keep the target in memory after the cache's fit-start pass releases it
    del training
    report = SelectionReport(tokenizer=tokenizer, output_dir=str(out_dir))
    trainer = build_trainer(cfg, "adaspec", out_dir, trainer_cfg, [report], select_best=settings.select_best)
    reference_name = f"self ({selector.self_reference})" if self_referencing else settings.reference
    metadata = {"stage": "adaspec", "task": cfg.task.name, "reference": reference_name, "k": k}
    trained = train_and_export(trainer, module, datamodule, tokenizer, out_dir, metadata)
    return write_result(out_dir, {"stage": "adaspec", "k": k, **trained})
