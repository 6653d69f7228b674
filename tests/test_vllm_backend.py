"""`rollout.backend=vllm`: vLLM's sampling settings and completions mapped to ours, the missing-extra error, and (on a
GPU with vLLM installed) greedy vLLM responses equal to our own loop's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.rollout.generate import sample_responses
from specdistill.rollout.vllm_backend import generate_with_vllm, response_tokens, sampling_params
from tests.test_rollout import tiny_lm

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_sampling_params_sample_like_ours_and_stop_at_our_eos_only():
    params = sampling_params(SamplingConfig(temperature=0.6, top_p=0.9), 64, [2, 7], seed=5)
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.6, 0.9, -1)
    assert params["max_tokens"] == 64 and params["seed"] == 5 and params["n"] == 1
    assert params["ignore_eos"] is True and params["stop_token_ids"] == [
        2,
        7,
    ]  # the model's own EOS is not used
    assert params["repetition_penalty"] == 1.0 and params["min_p"] == 0.0  # nothing warps but our settings
    assert sampling_params(SamplingConfig(temperature=1.3, top_k=20), 8, [0], 1)["top_k"] == 20
    assert sampling_params(SamplingConfig(temperature=0.0), 8, [0], 1)["temperature"] == 0.0
    assert sampling_params(SamplingConfig(temperature=0.7, greedy=True), 8, [0], 1)["temperature"] == 0.0


def test_completions_become_responses_with_their_eos():
    assert response_tokens([5, 6, 2], "stop", 2, [2]) == [5, 6, 2]  # EOS kept
    assert response_tokens([5, 6], "stop", 2, [2, 3]) == [5, 6, 2]  # a version that leaves the stop token out
    assert response_tokens([5, 6, 9], "length", None, [2]) == [5, 6, 9]  # the budget ran out: no EOS
    assert response_tokens([5, 3, 6], "stop", 3, [2, 3]) == [5, 3]  # nothing after the first EOS


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vLLM is missing")
def test_missing_vllm_names_the_extra(tmp_path):
    with pytest.raises(ImportError, match=r"rollout.backend=vllm needs `vllm`.*specdistill\[vllm\]"):
        generate_with_vllm("some/model", [[1, 2]], SamplingConfig(), 4, [0], [0], tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install 'specdistill[vllm]')")
def test_greedy_vllm_responses_equal_our_loop(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "target")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    greedy = SamplingConfig(greedy=True)
    ours = sample_responses(model, prompts, greedy, 24, [255], 0, 256, seeds=[0, 1, 2])[0]
    theirs = generate_with_vllm(
        str(tmp_path / "target"), prompts, greedy, 24, [255], [0, 1, 2], tmp_path / "work",
        engine={"dtype": "float32", "skip_tokenizer_init": True, "gpu_memory_utilization": 0.3},
    )  # fmt: skip
    assert theirs == ours


# --- wiring: given responses, settings, the stage --------------------------------------------------------------


def test_given_responses_are_labelled_exactly_as_reused_ones(tmp_path):
    """`run_rollouts(responses=...)` (what the vLLM backend hands over) labels those responses with the teacher-forced
    passes: the same dataset as reusing them from a finished rollout; a resume with other responses is refused."""
    from specdistill.rollout import load_rollouts
    from tests.test_rollout import PROMPTS, _run

    pair = tiny_lm(0, hidden=32), tiny_lm(1, hidden=16)
    sampled = _run(pair, tmp_path / "sampled")
    responses = [list(r) for r in sampled["response_ids"]]
    given = _run(pair, tmp_path / "given", responses=responses)
    reused = load_rollouts(tmp_path / "sampled")
    assert given["response_ids"] == reused["response_ids"] and given["draft_tokens"] == reused["draft_tokens"]
    for row, expected in zip(
        given["labels"], reused["labels"], strict=True
    ):  # teacher-forced vs generation logits
        assert row == pytest.approx(expected, abs=1e-5)
    other = [r[:1] for r in responses]
    with pytest.raises(ValueError, match="responses"):
        _run(pair, tmp_path / "given", responses=other)
    with pytest.raises(ValueError, match="one per prompt"):
        _run(pair, tmp_path / "short", responses=responses[: len(PROMPTS) - 1])


def _rollout_config(*overrides: str):
    from tests.test_rollout_ranks import _rollout_config as compose_rollout

    return compose_rollout(*overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.backend=sglang"], r"rollout.backend='sglang' is not one of hf, vllm"),
        (["rollout.backend=vllm"], r"loads the target by hub id or directory.*models.target.pretrained"),
        (
            [
                "rollout.backend=vllm",
                "++models.target.pretrained_model_name_or_path=some/model",
                "rollout.devices=2",
            ],
            r"rollout.devices=1 and rollout.num_nodes=1",
        ),
    ],
)
def test_backend_settings_are_checked_before_anything_runs(overrides, message):
    from specdistill.errors import ConfigError
    from specdistill.validation import check_rollout_backend

    with pytest.raises(ConfigError, match=message):
        check_rollout_backend(_rollout_config(*overrides), "rollout")


def test_vllm_is_refused_on_the_ranks_of_a_running_process_group():
    from specdistill.errors import ConfigError
    from specdistill.rollout.ranks import Ranks
    from specdistill.stages.rollout import check_single_process_for_vllm

    check_single_process_for_vllm(Ranks())
    with pytest.raises(ConfigError, match="runs in one process, but these rollouts run on 2 ranks"):
        check_single_process_for_vllm(Ranks(rank=1, world_size=2))


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vLLM is missing")
def test_the_stage_asks_vllm_for_the_responses_before_loading_models(tmp_path):
    """`rollout.backend=vllm` on a saved pair: the stage builds the prompts and calls vLLM first (here missing)."""
    from specdistill.stages import rollout as rollout_stage
    from tests.test_local_models import SMALL_TASK, save_pair

    target, draft = save_pair(tmp_path)
    cfg = _rollout_config("models=local", f"models.target_path={target}", f"models.draft_path={draft}", *SMALL_TASK,
                          "rollout.num_prompts=4", "rollout.backend=vllm")  # fmt: skip
    with pytest.raises(ImportError, match=r"specdistill\[vllm\]"):
        rollout_stage.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "rollouts" / "draft").exists()  # nothing labelled without responses
