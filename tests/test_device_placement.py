"""Frozen targets placed across devices (`models.target.device_map`): same tokens as on one device.

On CPU the second "device" is accelerate's disk offload (the layer's weights stay on disk and are brought in for
its forward), which runs the same hooks that move activations between GPUs; the `gpu` test splits the target over
two CUDA devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.models import ModelSpec, load_model
from specdistill.models.loading import is_placed_across_devices
from specdistill.rollout.generate import sample_responses
from specdistill.stages.model_loading import load_models
from tests.architectures import WINDOW
from tests.test_architectures import tiny_pair
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

GREEDY = SamplingConfig(greedy=True)
VOCAB = 32
PROMPT = [3, 1, 4, 1, 5, 9]
CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A hybrid sliding-window target (Gemma-2) saved as a checkpoint, and a draft that it rejects at times."""
    target, draft = tiny_pair("gemma2", VOCAB)
    path = tmp_path_factory.mktemp("target")
    target.save_pretrained(path)
    return path, target, draft


def _split_map(second: str) -> dict[str, str]:
    return {
        "model.embed_tokens": "cpu" if second == "disk" else "cuda:0",
        "model.rotary_emb": "cpu" if second == "disk" else "cuda:0",
        "model.layers.0": "cpu" if second == "disk" else "cuda:0",
        "model.layers.1": second,
        "model.norm": second,
        "lm_head": second,
    }


def _decodes(target, draft) -> tuple[list[int], list[int]]:
    decoder = SpeculativeDecoder(target, draft, FixedLength(3), GREEDY, None, VOCAB)
    speculative = decoder.generate(PROMPT, 3 * WINDOW).tokens
    plain = autoregressive(target, PROMPT, 3 * WINDOW, GREEDY, None, VOCAB).tokens
    return speculative, plain


def test_target_across_devices_decodes_the_same_tokens(exported):
    pytest.importorskip("accelerate", reason="device_map needs accelerate (a dependency: pip install -e .)")
    path, target, draft = exported
    placed = load_model(ModelSpec(pretrained_model_name_or_path=str(path), device_map=_split_map("disk")))
    assert is_placed_across_devices(placed) and set(placed.hf_device_map.values()) == {"cpu", "disk"}
    placed.eval()
    speculative, plain = _decodes(placed, draft)
    reference_speculative, reference_plain = _decodes(target, draft)
    assert speculative == reference_speculative == plain == reference_plain
    prompts = [PROMPT, PROMPT[:3]]
    torch.manual_seed(0)
    seeds = list(range(len(prompts)))
    expected = sample_responses(target, prompts, GREEDY, 12, [VOCAB - 1], 0, VOCAB, seeds)
    actual = sample_responses(placed, prompts, GREEDY, 12, [VOCAB - 1], 0, VOCAB, seeds)
    assert actual[0] == expected[0]  # rollout responses
    for placed_logits, one_device in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(placed_logits, one_device)


@pytest.mark.gpu
def test_target_across_two_gpus_decodes_the_same_tokens(exported):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    path, target, draft = exported
    placed = load_model(
        ModelSpec(pretrained_model_name_or_path=str(path), device_map=_split_map("cuda:1"))
    ).eval()
    assert {str(d) for d in placed.hf_device_map.values()} == {"cuda:0", "cuda:1"}
    draft = draft.to("cuda:0")
    assert _decodes(placed, draft) == _decodes(target.to("cuda:0"), draft)


def test_device_map_is_refused_where_it_cannot_apply(exported):
    path, _, _ = exported
    with pytest.raises(ValueError, match="no checkpoint"):
        ModelSpec(config={"model_type": "llama"}, device_map="auto")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["stage=distill"])
    GlobalHydra.instance().clear()
    spec = ModelSpec(pretrained_model_name_or_path=str(path), device_map="auto")
    with pytest.raises(ValueError, match="Training stages place their models with the Trainer's strategy"):
        load_models(cfg, {"target": spec})
