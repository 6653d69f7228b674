"""Every config group and preset composes, and the objects it names can be built."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def hydra_ctx():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def resolve_except_hydra(cfg) -> dict:
    cfg = cfg.copy()
    cfg.paths.output_dir = "/tmp/unused"
    return OmegaConf.to_container(cfg, resolve=True)


def test_default_composes_to_the_embedded_pipeline():
    cfg = compose("train")
    assert cfg.stage.name == "pipeline" and cfg.task.name == "arith" and cfg.models.name == "tiny"
    # the tiny pair's tuning is picked by the interpolated defaults entry
    assert cfg.sft.lr != compose("train", overrides=["models=pythia_31m_to_1.4b"]).sft.lr
    resolve_except_hydra(cfg)


@pytest.mark.parametrize(
    "group",
    [
        "task",
        "models",
        "stage",
        "divergence",
        "selector",
        "optimizer",
        "scheduler",
        "trainer",
        "logger",
        "policy",
        "experiment",
    ],
)
def test_every_option_of_every_group_composes(group):
    names = options(group)
    if group != "experiment":
        assert names, f"conf/{group} has no options"
    for name in names:
        # policies are not in the root defaults: evaluate lists several at once
        override = f"+{group}={name}" if group == "policy" else f"{group}={name}"
        cfg = compose("train", overrides=[override])
        resolve_except_hydra(cfg)


@pytest.mark.parametrize("name", options("task"))
def test_task_presets_build(name):
    cfg = compose("train", overrides=[f"task={name}"])
    task = instantiate(cfg.task)
    assert task.name == name


@pytest.mark.parametrize("name", options("models"))
def test_model_presets_build_specs(name):
    cfg = compose("train", overrides=[f"models={name}"])
    for role in ("target", "draft"):
        spec = instantiate(cfg.models[role])
        assert spec.trust_remote_code is False, "trust_remote_code must stay off unless the user turns it on"
        assert spec.is_pretrained == (name != "tiny")


@pytest.mark.parametrize("name", options("divergence") + [f"selector/{s}" for s in options("selector")])
def test_losses_and_selectors_build(name):
    group, _, option = name.rpartition("/")
    cfg = compose("train", overrides=[f"{group or 'divergence'}={option}"])
    instantiate(cfg.selector if group == "selector" else cfg.divergence)


def test_adaspec_k_reaches_the_selector():
    cfg = compose("train", overrides=["adaspec.k=0.8", "selector=adaspec"])
    assert instantiate(cfg.selector).selector.k == 0.8


def test_unknown_preset_names_the_options():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="Available options"):
        compose("train", overrides=["models=nonexistent_pair"])
