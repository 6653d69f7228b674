"""One root `seed` drives the embedded pair's generated data and initial weights; the same seed gives the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from specdistill.stages.model_loading import load_models, model_spec
from specdistill.utils.seeds import derive_seed

CONF = Path(__file__).resolve().parents[1] / "conf"
SMALL = ["task.sizes.train=20", "task.sizes.validation=4", "task.sizes.test=4"]


def embedded(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def questions(cfg) -> list[str]:
    return instantiate(cfg.task).load_split("train")["question"]


def initial_weights(cfg) -> dict[str, torch.Tensor]:
    specs = {role: model_spec(cfg.models[role]) for role in ("target", "draft")}
    _, models, _ = load_models(cfg, specs)
    return {f"{role}.{name}": p for role, m in models.items() for name, p in m.state_dict().items()}


def test_derived_seeds_differ_by_part_and_by_root_seed():
    parts = ["task", "models.target", "models.draft", "selector"]
    assert len({derive_seed(0, p) for p in parts}) == len(parts)
    assert all(derive_seed(0, p) != derive_seed(1, p) for p in parts)
    assert derive_seed(3, "task") == derive_seed(3, "task")
    assert all(0 <= derive_seed(s, "task") < 2**31 for s in range(20))
    with pytest.raises(TypeError, match="integer"):
        derive_seed("0", "task")


def test_the_same_seed_gives_the_same_data_and_weights():
    first, second = embedded("seed=4"), embedded("seed=4")
    assert questions(first) == questions(second)
    a, b = initial_weights(first), initial_weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_another_seed_gives_other_data_and_other_initial_weights():
    zero, one = embedded("seed=0"), embedded("seed=1")
    assert questions(zero) != questions(one)
    a, b = initial_weights(zero), initial_weights(one)
    weights = [k for k in a if k.endswith(".weight") and a[k].dim() == 2]
    assert weights and all(not torch.equal(a[k], b[k]) for k in weights)


def test_a_pinned_part_stays_while_the_rest_follows_the_seed():
    zero, one = (
        embedded("seed=0", "task.seed=7", "models.draft.seed=11"),
        embedded("seed=1", "task.seed=7", "models.draft.seed=11"),
    )
    assert questions(zero) == questions(one)
    a, b = initial_weights(zero), initial_weights(one)
    draft = [k for k in a if k.startswith("draft.")]
    target = [k for k in a if k.startswith("target.") and k.endswith(".weight") and a[k].dim() == 2]
    assert all(torch.equal(a[k], b[k]) for k in draft)
    assert all(not torch.equal(a[k], b[k]) for k in target)
