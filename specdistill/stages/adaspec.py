"""Stage `adaspec`: selective distillation of the base draft, guided by the frozen reference (METHODS.md section 3).

Three models: the frozen target, the frozen reference (the `distill` stage's export, by path) and the trainable
draft, initialised from the *base* draft checkpoint. The token-selection callback (`conf/selector/`) decides which
answer tokens train the draft. With `adaspec.cached_scores` (default) the reference's per-token divergence is a
property of the data: it is computed once by a scoring pass, saved beside the run (`reference_scores/`) and read by
the callback instead of running the reference every step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import datasets
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from specdistill.models import ModelSpec
from specdistill.modules.distill import DistillModule
from specdistill.selection.scoring import score_reference
from specdistill.stages.common import (
    build_datamodule,
    build_trainer,
    load_models,
    model_spec,
    seed_everything,
    stage_dir,
    write_result,
)
from specdistill.stages.distill import train_and_export

log = logging.getLogger(__name__)


def compute_matched(settings: DictConfig, k: float) -> DictConfig:
    """The authors' compute-matched protocol: batch / k and epochs / k, so optimizer steps and loss tokens match."""
    matched = settings.copy()
    with open_dict(matched):
        matched.batch_size = math.ceil(settings.batch_size / k)
        matched.max_epochs = math.ceil(settings.max_epochs / k)
    return matched


def run(cfg: DictConfig) -> dict:
    settings = cfg.adaspec
    if not settings.reference:
        raise ValueError(
            "adaspec.reference is not set: pass the export directory of a `distill` run "
            "(adaspec.reference=<distill_run_dir>/export), or run stage=pipeline which wires it."
        )
    k = float(settings.k)
    if settings.compute_matched:
        settings = compute_matched(settings, k)
    out_dir = stage_dir(cfg, "adaspec")
    seed_everything(cfg)
    specs = {
        "target": model_spec(cfg.models.target),
        "reference": ModelSpec(
            pretrained_model_name_or_path=settings.reference, dtype=cfg.models.draft.dtype
        ),
        "draft": model_spec(cfg.models.draft),
    }
    tokenizer, models, vocab_size = load_models(cfg, specs)
    datamodule = build_datamodule(cfg, tokenizer, settings)
    divergence = instantiate(cfg.divergence)
    reference = models["reference"]
    if settings.cached_scores:
        rows = reference_scores(
            out_dir / "reference_scores", models["target"], reference, datamodule, divergence, vocab_size
        )
        datamodule.attach_column("train", "ref_divergence", rows)
        reference = None  # the callback reads the cached column; the reference is not run again
    selection = instantiate(cfg.selector, reference=reference, tokenizer=tokenizer, output_dir=str(out_dir))
    module = DistillModule(
        draft=models["draft"],
        target=models["target"],
        vocab_size=vocab_size,
        divergence=divergence,
        optimizer=instantiate(cfg.optimizer, lr=settings.lr),
        scheduler=instantiate(cfg.scheduler),
        accumulate_grad_batches=settings.accumulate_grad_batches,
    )
    trainer = build_trainer(cfg, out_dir, settings, callbacks=[selection])
    metadata = {"stage": "adaspec", "task": cfg.task.name, "reference": settings.reference, "k": k}
    trained = train_and_export(trainer, module, datamodule, tokenizer, out_dir, metadata)
    return write_result(out_dir, {"stage": "adaspec", "k": k, **trained})


def reference_scores(
    path: Path, target, reference, datamodule, divergence, vocab_size: int
) -> list[list[float]]:
    """Per train example, D(target, reference) at each shifted position; computed once and saved under `path`.

    The saved copy records the tokenised inputs' fingerprint, so a changed dataset, tokenizer or max_length is
    recomputed rather than silently reused.
    """
    train = datamodule.tokenized("train")
    fingerprint = train._fingerprint
    meta = path / "specdistill_scores.json"
    if meta.is_file() and json.loads(meta.read_text()).get("fingerprint") == fingerprint:
        log.info("reusing cached reference scores from %s", path)
        return datasets.load_from_disk(str(path))["ref_divergence"]
    log.info("scoring %d train examples with the reference (once)", len(train))
    loader = datamodule.scoring_dataloader("train")
    scores = score_reference(target, reference, loader, divergence, vocab_size)
    rows = [scores[i] for i in range(len(train))]
    datasets.Dataset.from_dict({"example_id": list(range(len(rows))), "ref_divergence": rows}).save_to_disk(
        str(path)
    )
    meta.write_text(json.dumps({"fingerprint": fingerprint}))
    return rows
