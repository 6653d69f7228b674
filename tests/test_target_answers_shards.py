"""`target_answers` in shards: the default settings write byte for byte what the unsharded greedy step wrote, a
relaunch generates only the missing shards (and refuses shards made with other settings), sampled answers follow
their prompt's seed, and `backend=vllm` (its settings, its resume from the tokens a killed launch left, and vLLM
itself on a tiny saved model, greedy answers equal to transformers')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose
from omegaconf import DictConfig, open_dict
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.decoding.sampling import SamplingConfig
from specdistill.errors import ConfigError
from specdistill.evaluation.generation import greedy_texts
from specdistill.export.hf import export_pretrained
from specdistill.rollout.generate import sample_responses
from specdistill.stages import target_answers as stage
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts
from specdistill.stages.settings import build_settings
from specdistill.tasks.answers import read_answers, write_answers
from specdistill.validation import check_vllm_backend
from tests.helpers import TINY, hydra_conf
from tests.test_local_models import SMALL_TASK, save_pair
from tests.test_vllm_backend import ENGINE, VLLM_PYTHON, needs_vllm

ANSWERS = ["target_answers.max_prompts=10", "target_answers.max_new_tokens=6", "target_answers.batch_size=2"]


def _config(*overrides: str) -> DictConfig:
    with hydra_conf():
        return compose("train", overrides=["stage=target_answers", *overrides])


def _tiny(*overrides: str) -> DictConfig:
    return _config(*TINY, *ANSWERS, *overrides)


def _answers(run: Path, split: str = "train") -> bytes:
    return (run / "answers" / f"{split}.jsonl").read_bytes()


def _unsharded_greedy(cfg: DictConfig, folder: Path) -> None:
    """The step as it was before shards: each split's prompts sorted by length, `greedy_texts` over all of them."""
    settings = build_settings(cfg, "target_answers")
    tokenizer, target, _, _ = load_frozen_target_and_drafts(cfg, {}, torch.device("cpu"))
    datamodule = build_datamodule(cfg, tokenizer, max_length=settings.max_length)
    for split in settings.splits:
        prompts = stage.unique_prompts(datamodule.task, datamodule.prompts(split)[: settings.max_prompts])
        order = sorted(prompts, key=lambda key: len(prompts[key]))
        texts = greedy_texts(
            target,
            tokenizer,
            [prompts[k] for k in order],
            settings.max_new_tokens,
            batch_size=settings.batch_size,
        )
        write_answers(folder, split, sorted(zip(order, texts, strict=True)))


def test_default_settings_write_the_bytes_of_the_unsharded_greedy_step(tmp_path):
    """One shard (the default 256 > 10 prompts) and four (shard_size 4, two batches each) both give the old files."""
    _unsharded_greedy(_tiny(), tmp_path / "old" / "answers")
    stage.run(_tiny(), tmp_path / "one")
    stage.run(_tiny("target_answers.shard_size=4"), tmp_path / "four")
    for split in ("train", "validation"):
        old = _answers(tmp_path / "old", split)
        assert _answers(tmp_path / "one", split) == old and _answers(tmp_path / "four", split) == old
    assert len(list((tmp_path / "four" / "answer_shards" / "train").glob("shard-*.jsonl"))) == 3  # 4 + 4 + 2


def test_a_relaunch_generates_only_the_shards_a_killed_run_left(tmp_path, monkeypatch):
    """Killed while generating the second shard of train; the relaunch generates train's shards 1 and 2 and the
    validation split's, and writes the same files as a run that was never stopped."""
    cfg = _tiny("target_answers.shard_size=4")
    stage.run(cfg, tmp_path / "whole")
    generated: list[list[list[int]]] = []

    def generate(kill_at: int | None):
        def fake(model, tokenizer, prompt_ids, *args, **kwargs):
            if len(generated) == kill_at:
                raise KeyboardInterrupt("killed")
            generated.append([list(p) for p in prompt_ids])
            return greedy_texts(model, tokenizer, prompt_ids, *args, **kwargs)

        monkeypatch.setattr(stage, "greedy_texts", fake)

    generate(kill_at=1)
    with pytest.raises(KeyboardInterrupt):
        stage.run(cfg, tmp_path / "resumed")
    first = generated.pop()
    shards = tmp_path / "resumed" / "answer_shards" / "train"
    assert sorted(p.name for p in shards.glob("shard-*")) == ["shard-00000.jsonl"]
    assert not (tmp_path / "resumed" / "answers").exists()

    generate(kill_at=None)
    stage.run(cfg, tmp_path / "resumed")
    # train's shards 1 and 2, then the validation split's 8 prompts in two shards
    assert [len(g) for g in generated] == [4, 2, 4, 4]
    assert first not in generated
    for split in ("train", "validation"):
        assert _answers(tmp_path / "resumed", split) == _answers(tmp_path / "whole", split)

    generated.clear()
    stage.run(cfg, tmp_path / "resumed")  # every shard there: nothing generated again
    assert generated == []


def test_a_relaunch_with_other_settings_is_refused(tmp_path):
    stage.run(_tiny("target_answers.splits=[validation]"), tmp_path)
    for changed, message in [
        ("target_answers.max_new_tokens=5", r"differing: max_new_tokens"),
        ("target_answers.sampling.greedy=false", r"differing: sampling, seed"),
        ("target_answers.shard_size=3", r"differing: shard_size"),
        ("target_answers.max_prompts=4", r"differing: num_prompts, prompts_sha256"),
    ]:
        with pytest.raises(ConfigError, match=rf"answer_shards/validation holds answers .*{message}.*delete"):
            stage.run(_tiny("target_answers.splits=[validation]", changed), tmp_path)


def _local(target: Path, *overrides: str) -> DictConfig:
    """The tiny saved `target` (fixed weights, whatever the seed) on a few arith prompts of the train split."""
    return _config("models=local", f"models.target_path={target}", f"models.draft_path={target}", *SMALL_TASK,
                   "task.seed=0", "target_answers.splits=[train]", *overrides)  # fmt: skip


def test_sampled_answers_follow_each_prompts_seed_not_its_batch_or_shard(tmp_path):
    target, _ = save_pair(tmp_path)
    sample = [*ANSWERS, "target_answers.sampling.greedy=false"]
    stage.run(_local(target, *sample), tmp_path / "a")
    stage.run(
        _local(target, *sample, "target_answers.batch_size=3", "target_answers.shard_size=3"), tmp_path / "b"
    )
    stage.run(_local(target, *sample, "seed=1"), tmp_path / "other_seed")
    stage.run(_local(target, *ANSWERS), tmp_path / "greedy")
    assert _answers(tmp_path / "a") == _answers(tmp_path / "b")
    assert _answers(tmp_path / "a") != _answers(tmp_path / "other_seed")
    assert _answers(tmp_path / "a") != _answers(tmp_path / "greedy")

    # each answer is the one its seed draws from the target for that prompt alone, at temperature 1
    cfg = _local(target, *sample)
    tokenizer, model, _, vocab_size = load_frozen_target_and_drafts(cfg, {}, torch.device("cpu"))
    datamodule = build_datamodule(cfg, tokenizer, max_length=512)
    prompts = stage.unique_prompts(datamodule.task, datamodule.prompts("train")[:10])
    written = read_answers(tmp_path / "a" / "answers", "train")
    assert sorted(written) == sorted(prompts)
    for key, ids in list(prompts.items())[:4]:
        (response,), _ = sample_responses(
            model, [ids], SamplingConfig(temperature=1.0), 6, tokenizer.eos_token_id, tokenizer.pad_token_id,
            vocab_size, seeds=stage.prompt_seeds(cfg.seed, [key]),
        )  # fmt: skip
        assert written[key] == tokenizer.decode(response, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("shard_size", 0, r"target_answers.shard_size=0 must be an integer >= 1"),
        ("backend", "hf", r"target_answers.backend='hf' is not one of transformers, vllm"),
        ("sampling", {"temperature": -1.0}, r"target_answers.sampling: temperature must be >= 0"),
        ("sampling", {"top_p": 0.0, "greedy": False}, r"target_answers.sampling: top_p must be in \(0, 1\]"),
        ("sampling", {"tempature": 0.6}, r"target_answers.sampling.tempature: .*did you mean .*temperature"),
    ],
)
def test_out_of_range_settings_are_refused_with_the_key(key, value, message):
    cfg = _config()
    with open_dict(cfg):
        if isinstance(value, dict):
            cfg.target_answers[key].update(value)
        else:
            cfg.target_answers[key] = value
    with pytest.raises(ConfigError, match=message):
        build_settings(cfg, "target_answers")


def test_vllm_is_refused_for_a_target_it_cannot_load(tmp_path):
    """Checked by train.py before anything runs: a config-built target, a GGUF target, a missing interpreter."""
    with pytest.raises(
        ConfigError, match=r"target_answers.backend=vllm loads the target by hub id.*backend=transf"
    ):
        check_vllm_backend(_config("target_answers.backend=vllm"), "target_answers")
    gguf = [
        "++models.target.pretrained_model_name_or_path=some/model",
        "++models.target.gguf_file=m.Q4_1.gguf",
    ]
    with pytest.raises(
        ConfigError, match=r"loads safetensors only, but models.target comes from the GGUF file m.Q4"
    ):
        check_vllm_backend(_config("target_answers.backend=vllm", *gguf), "target_answers")
    target, _ = save_pair(tmp_path)
    missing = tmp_path / "no" / "python"
    local = ["models=local", f"models.target_path={target}", f"models.draft_path={target}"]
    cfg = _config(*local, "target_answers.backend=vllm", f"target_answers.vllm_python={missing}")
    with pytest.raises(ConfigError, match=rf"target_answers.vllm_python={missing} does not exist"):
        check_vllm_backend(cfg, "target_answers")
    check_vllm_backend(_config(*local), "target_answers")  # transformers: nothing to check


def test_vllm_answers_resume_from_the_tokens_a_killed_launch_left(tmp_path):
    """The shards whose tokens vLLM wrote before it was killed are decoded on relaunch without starting it again
    (here no interpreter exists); the other shards still need it."""
    target, _ = save_pair(tmp_path)
    cfg = _config("models=local", f"models.target_path={target}", f"models.draft_path={target}", *SMALL_TASK,
                  "target_answers.splits=[train]", "target_answers.max_prompts=5", "target_answers.shard_size=2",
                  "target_answers.backend=vllm", f"target_answers.vllm_python={tmp_path / 'no-python'}")  # fmt: skip
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="target_answers.vllm_python=.*does not exist"):
        stage.run(cfg, run)
    work = run / "answer_shards" / "train" / "vllm"
    work.mkdir()
    tokens = {0: [[5, 6], [7]], 1: [[8], [9, 10]]}
    for index, responses in tokens.items():
        (work / f"shard-{index:05d}.json").write_text(json.dumps(responses))
    with pytest.raises(ConfigError, match="does not exist"):
        stage.run(cfg, run)  # shard 2 has no tokens yet
    shards = run / "answer_shards" / "train"
    assert sorted(p.name for p in shards.glob("shard-*.jsonl")) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    (work / "shard-00002.json").write_text(json.dumps([[11, 12, 13]]))
    stage.run(cfg, run)
    answers = read_answers(run / "answers", "train")
    tokenizer = stage.shared_tokenizer(cfg, {})
    expected = [
        tokenizer.decode(r, skip_special_tokens=True) for r in [[5, 6], [7], [8], [9, 10], [11, 12, 13]]
    ]
    assert sorted(answers.values()) == sorted(expected)


def peaked_target(folder: Path) -> Path:
    """A random Llama with the arith tokenizer whose next-token distributions are peaked (initializer_range 0.3, as
    tests/test_vllm_backend.py's), so float differences between vLLM's kernels and ours cannot flip an argmax; head
    dim 32 (vLLM's CPU attention has no 16)."""
    torch.manual_seed(0)
    tokenizer = arith_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                         initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    return export_pretrained(LlamaForCausalLM(config).eval(), tokenizer, folder)


@pytest.mark.slow
@needs_vllm
def test_vllm_gives_the_greedy_answers_of_transformers(tmp_path, monkeypatch):
    """`target_answers.backend=vllm` on a tiny saved model (vLLM's CPU build, one launch for three shards, each
    shard's tokens written as it is done) writes the answers file transformers' greedy generate writes."""
    # as tests/test_vllm_backend.py: vLLM's engine in its worker's process, a quicker start
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    target = peaked_target(tmp_path / "target")
    common = ["models=local", f"models.target_path={target}", f"models.draft_path={target}", *SMALL_TASK,
              "target_answers.splits=[train]", "target_answers.max_prompts=6", "target_answers.max_new_tokens=12",
              "target_answers.shard_size=2", "target_answers.device=cpu"]  # fmt: skip
    engine = [f"++target_answers.vllm.{key}={json.dumps(value)}" for key, value in ENGINE.items()]
    vllm = _config(
        *common, "target_answers.backend=vllm", f"target_answers.vllm_python={VLLM_PYTHON}", *engine
    )
    stage.run(_config(*common), tmp_path / "transformers")
    stage.run(vllm, tmp_path / "vllm")
    assert _answers(tmp_path / "vllm") == _answers(tmp_path / "transformers")
    work = tmp_path / "vllm" / "answer_shards" / "train" / "vllm"
    assert sorted(p.name for p in work.glob("shard-*.json")) == [f"shard-0000{i}.json" for i in range(3)]
    texts = read_answers(tmp_path / "vllm" / "answers", "train").values()
    assert len(set(texts)) > 1 and all(texts)  # answers, not one repeated text
