"""The configuration layer: every group and preset composes, each stage composes only what it uses, one home per key,
and the Trainer gets the stage's values with the command line on top."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdistill.stages.trainer import build_trainer, trainer_config
from tests.helpers import hydra_conf

CONF = Path(__file__).resolve().parents[1] / "conf"
STAGES = ["sft", "target_answers", "distill", "adaspec", "rollout", "acceptance_head", "evaluate", "analyse"]
TRAINING_STAGES = ["sft", "distill", "adaspec", "acceptance_head"]
MAX_LEAVES = 80  # the most: stage=adaspec on the tiny pair (80 since one target_cache key)
# options with settings the user must give (`???` paths, their own files): what these tests give them
REQUIRED = {
    ("models", "local"): ["models.target_path=/models/target", "models.draft_path=/models/draft"],
    ("task", "local"): [
        f"task.data_files={CONF.parent / 'tests' / 'fixtures' / 'local' / 'qa_train.jsonl'}",
        "task.fields.prompt=q",
        "task.fields.answer=a",
    ],
    ("task", "python_folder"): [f"task.root={CONF.parent / 'tasks'}"],
}


def given(group: str, name: str) -> list[str]:
    return REQUIRED.get((group, name), [])


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def hydra_ctx():
    with hydra_conf():
        yield


def resolve_except_hydra(cfg) -> dict:
    cfg = cfg.copy()
    cfg.paths.output_dir = "/tmp/unused"
    return OmegaConf.to_container(cfg, resolve=True)


def leaves(node, prefix: str = "") -> dict[str, object]:
    """Dotted path -> value of every leaf setting (an empty dict or a list counts as one leaf)."""
    if isinstance(node, dict) and node:
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def composed_leaves(*overrides: str) -> dict[str, object]:
    return leaves(OmegaConf.to_container(compose("train", overrides=list(overrides)), resolve=False))


def test_default_composes_to_the_embedded_pipeline():
    cfg = compose("train")
    assert cfg.stage.name == "pipeline" and cfg.task.name == "arith"
    assert cfg.models.tokenizer._target_.endswith("arith_tokenizer")  # the tiny pair
    assert list(cfg.pipeline.steps) == [
        "sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate", "analyse"
    ]  # fmt: skip
    # the tiny pair's per-stage tuning is picked by the interpolated defaults entry, in a pipeline and alone
    pythia = compose("train", overrides=["models=pythia_31m_to_1.4b"])
    assert cfg.sft.optimizer.lr != pythia.sft.optimizer.lr
    assert compose("train", overrides=["stage=sft"]).sft.optimizer.lr == cfg.sft.optimizer.lr
    resolve_except_hydra(cfg)


@pytest.mark.parametrize("stage", [*STAGES, "pipeline"])
@pytest.mark.parametrize("models", ["tiny", "pythia_31m_to_1.4b"])
def test_a_stage_composes_only_what_it_uses(stage, models):
    cfg = compose("train", overrides=[f"stage={stage}", f"models={models}"])
    own = set(STAGES) if stage == "pipeline" else {stage}
    assert own <= set(cfg), sorted(cfg)
    assert not (set(STAGES) - own) & set(cfg), f"stage={stage} composes other stages' settings: {sorted(cfg)}"
    if stage != "pipeline":
        # the group's `_target_` names its settings class (specdistill/stages/settings.py): code, not a setting
        count = len(set(composed_leaves(f"stage={stage}", f"models={models}")) - {f"{stage}._target_"})
        assert count <= MAX_LEAVES, f"stage={stage} composes {count} settings (at most {MAX_LEAVES})"


def test_only_the_stages_that_use_them_compose_divergence_selector_and_sampling():
    uses = {
        "divergence": {"distill", "adaspec"},
        "selector": {"adaspec"},
        "sampling": {"rollout", "evaluate"},
    }
    for stage in STAGES:
        cfg = compose("train", overrides=[f"stage={stage}"])
        for group, users in uses.items():
            assert (group in cfg) == (stage in users), (stage, group)


def test_one_home_per_concept():
    """k, the head's thresholds and draft-length bounds, and every trainer setting each live in exactly one place."""
    settings = composed_leaves()  # the pipeline composes every stage
    named = lambda name: sorted(k for k in settings if k.rsplit(".", 1)[-1] == name)  # noqa: E731
    assert named("k") == ["adaspec.k"]
    assert named("thresholds") == ["evaluate.acceptance_head.thresholds"]
    assert named("min_draft_length") == ["evaluate.acceptance_head.min_draft_length"]
    assert named("max_draft_length") == ["evaluate.max_draft_length"]
    assert named("sampling") == [] and "sampling.temperature" in settings
    for key in (
        "max_steps",
        "max_epochs",
        "accumulate_grad_batches",
        "limit_val_batches",
        "val_check_interval",
    ):
        assert all(k.startswith("trainer.") or ".trainer." in k for k in named(key)), named(key)
    assert named("accumulate_grad_batches") == ["trainer.accumulate_grad_batches"]
    # the SpecDec++ head has one name: acceptance_head (no `head` group, no `specdecpp` keys)
    assert not any(part in {"head", "specdecpp"} for k in settings for part in k.split("."))
    assert "head" not in options("policy") and not (CONF / "head").exists()


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_command_line_trainer_settings_reach_every_training_stage(stage, tmp_path):
    """`trainer.max_steps=7` on the command line wins over the stage's own block (the tiny tuning sets max_steps)."""
    cfg = compose("train", overrides=[f"stage={stage}", "trainer.max_steps=7", "+trainer.max_time=00:01:00:00"],
                  return_hydra_config=True)  # fmt: skip
    HydraConfig.instance().set_config(cfg)
    try:
        merged = trainer_config(cfg, stage)
    finally:
        HydraConfig.instance().cfg = None
    assert merged.max_steps == 7 and merged.max_time == "00:01:00:00"
    assert merged.max_epochs == cfg[stage].trainer.max_epochs  # the stage's values where the user set none
    # without the command line the stage's own block wins over the preset
    plain = compose("train", overrides=[f"stage={stage}", "trainer.max_steps=7"])
    assert trainer_config(plain, stage).max_steps == cfg[stage].trainer.get("max_steps", 7)
    cfg.paths.output_dir = str(tmp_path)
    trainer = build_trainer(cfg, stage, tmp_path, merged)
    assert isinstance(trainer, L.Trainer) and trainer.max_steps == 7


def test_a_stage_trainer_block_is_merged_into_the_preset():
    cfg = compose("train", overrides=["stage=sft", "trainer=gpu", "+sft.trainer.accumulate_grad_batches=4"])
    merged = trainer_config(cfg, "sft")
    assert merged.accumulate_grad_batches == 4 and merged.max_steps == cfg.sft.trainer.max_steps
    assert merged.precision == "bf16-mixed" and merged._target_ == "lightning.Trainer"


@pytest.mark.parametrize(
    ("group", "stage", "override"),
    [
        ("task", "pipeline", "task={}"),
        ("models", "pipeline", "models={}"),
        ("stage", None, "stage={}"),
        ("pipeline", "pipeline", "pipeline={}"),
        ("trainer", "pipeline", "trainer={}"),
        ("logger", "pipeline", "logger={}"),
        ("divergence", "distill", "divergence={}"),
        ("selector", "adaspec", "selector={}"),
        ("sampling", "evaluate", "sampling={}"),
        ("optimizer", "sft", "optimizer@sft.optimizer={}"),
        ("scheduler", "acceptance_head", "scheduler@acceptance_head.scheduler={}"),
        ("policy", "evaluate", "+policy@evaluate.policies.extra={}"),
    ],
)
def test_every_option_of_every_group_composes(group, stage, override):
    names = options(group)
    assert names, f"conf/{group} has no options"
    for name in names:
        overrides = [override.format(name), *given(group, name)] + ([f"stage={stage}"] if stage else [])
        resolve_except_hydra(compose("train", overrides=overrides))


@pytest.mark.parametrize("experiment", options("experiment"))
@pytest.mark.parametrize("models", options("models"))
def test_every_experiment_composes_with_every_pair(experiment, models):
    cfg = compose(
        "train",
        overrides=[f"experiment={experiment}", f"models={models}", "task=gsm8k", *given("models", models)],
    )
    resolve_except_hydra(cfg)
    if cfg.stage.name == "pipeline":
        assert set(cfg.pipeline.steps) <= set(cfg.stage.steps)


def test_experiments_override_only_what_differs():
    """A preset restates no default: each of its leaves differs from the composition of its group choices alone
    (on a real pair, whose per-task tuning the preset must not restate either). A preset built on another one
    (`defaults: [<experiment>]`) is compared with that one."""
    for experiment in options("experiment"):
        body = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
        defaults = body.pop("defaults", [])
        parents = [
            f"experiment={entry}" for entry in defaults if isinstance(entry, str) and entry != "_self_"
        ]
        choices = parents + [
            f"{key.removeprefix('override /')}={value}"
            for entry in defaults
            if isinstance(entry, dict)
            for key, value in entry.items()
            if key.startswith("override /")
        ]
        task = [] if any(c.startswith("task=") for c in choices) else ["task=gsm8k"]
        without = composed_leaves(*choices, *task, "models=pythia_31m_to_1.4b")
        for key, value in leaves(OmegaConf.to_container(body)).items():
            assert without.get(key, "<absent>") != value, f"{experiment} restates the default {key}={value}"


@pytest.mark.parametrize("name", options("task"))
def test_task_presets_build(name):
    cfg = compose("train", overrides=[f"task={name}", *given("task", name)])
    task = instantiate(cfg.task)
    assert task.name == name


@pytest.mark.parametrize("name", options("models"))
def test_model_presets_build_specs(name):
    cfg = compose("train", overrides=[f"models={name}", *given("models", name)])
    for role in ("target", "draft"):
        spec = instantiate(cfg.models[role])
        assert spec.trust_remote_code is False, "trust_remote_code must stay off unless the user turns it on"
        assert spec.is_pretrained == (name != "tiny")


@pytest.mark.parametrize("name", options("selector"))
def test_selectors_build_with_the_one_k(name):
    cfg = compose("train", overrides=["stage=adaspec", f"selector={name}", "adaspec.k=0.8"])
    if name == "none":
        with pytest.raises(InstantiationException, match="adaspec.k=1"):
            instantiate(cfg.selector, k=cfg.adaspec.k)
        assert instantiate(cfg.selector, k=1.0).needs_reference is False
    else:
        assert instantiate(cfg.selector, k=cfg.adaspec.k).k == 0.8


@pytest.mark.parametrize("name", options("divergence"))
def test_divergences_build(name):
    instantiate(compose("train", overrides=["stage=distill", f"divergence={name}"]).divergence)


def test_a_group_a_stage_does_not_use_cannot_be_set():
    """`selector=random` with stage=sft is an error, not a silently ignored setting."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="selector"):
        compose("train", overrides=["stage=sft", "selector=random"])


def test_unknown_preset_names_the_options():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="Available options"):
        compose("train", overrides=["models=nonexistent_pair"])
