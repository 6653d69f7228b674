"""The target's own answers as training text: the `target_answers` stage, the answers files, and `task.answers_from`
(records keep their prompts and the dataset's answers for scoring; training reads the generated ones)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose
from hydra.utils import instantiate
from omegaconf import open_dict

from specdistill.data.tokenize import tokenize_records
from specdistill.errors import ConfigError, DataError, InputFileError
from specdistill.models.tokenizer import ensure_pad_token
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import build_settings
from specdistill.tasks.answers import prompt_key, read_answers, write_answers
from specdistill.tasks.base import TaskDataError
from tests.helpers import TINY, check_ok, hydra_conf, run_train
from tests.test_tasks import compose_task

ARITH = ["sizes.train=12", "sizes.validation=4", "sizes.test=4"]


def _answers_for(task, split: str, n: int, text) -> dict[str, str]:
    """`{prompt key: text(i)}` for the first `n` records of `split`."""
    records = task.load_split(split)
    return {prompt_key(task.prompt(records[i])): text(i) for i in range(n)}


def test_answers_round_trip_by_prompt_and_bad_files_name_the_line(tmp_path):
    pairs = [("def f():\n", "    return 1\n"), ('[{"role": "user"}]', "ok")]
    write_answers(tmp_path, "train", pairs)
    assert read_answers(tmp_path, "train") == dict(pairs)
    assert prompt_key([{"role": "user", "content": "hi"}]) == '[{"content": "hi", "role": "user"}]'
    with pytest.raises(InputFileError, match=r"split 'validation'.*has \['train'\].*target_answers.splits"):
        read_answers(tmp_path, "validation")
    (tmp_path / "validation.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"validation.jsonl, line 2: expected"):
        read_answers(tmp_path, "validation")
    (tmp_path / "test.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "a", "answer": "c"}\n')
    with pytest.raises(DataError, match=r"line 2: a second answer for the same prompt"):
        read_answers(tmp_path, "test")


def test_a_task_with_answers_from_trains_on_them_and_skips_records_without_one(tmp_path):
    plain = compose_task("arith", *ARITH)
    write_answers(tmp_path, "train", _answers_for(plain, "train", 5, lambda i: f"generated {i}").items())
    task = compose_task("arith", *ARITH, f"+answers_from={tmp_path}")
    records = task.load_split("train")
    assert len(records) == 5  # the 7 records without an answer are skipped
    assert [task.training_answer(r) for r in records] == [f"generated {i}" for i in range(5)]
    assert [task.answer(r) for r in records] == [plain.answer(plain.load_split("train")[i]) for i in range(5)]

    with hydra_conf():
        tokenizer = ensure_pad_token(instantiate(compose("train").models.tokenizer))
    encoded, kept = tokenize_records(task, list(records), tokenizer, max_length=256)
    assert kept == list(range(5))
    for i, example in enumerate(encoded):
        answer_ids = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label != -100]
        assert (
            tokenizer.decode(answer_ids[:-1]) == f"generated {i}" and answer_ids[-1] == tokenizer.eos_token_id
        )

    with pytest.raises(InputFileError, match="No generated answers for split 'validation'"):
        task.load_split("validation")
    write_answers(tmp_path, "validation", [("a prompt of another task", "x")])
    with pytest.raises(TaskDataError, match=r"None of the 4 'validation' records .* other prompts"):
        task.load_split("validation")
    with pytest.raises(TaskDataError, match="was not loaded from a split they cover"):
        task.training_answer(plain.load_split("test")[0])


def test_the_stage_writes_the_targets_greedy_answers_and_distill_trains_on_them(tmp_path):
    """stage=target_answers through train.py, then each answer against the target's own `generate` on its prompt
    (one prompt at a time, so no padding), then stage=distill with task.answers_from on them."""
    answers_run, distill_run = tmp_path / "answers", tmp_path / "distill"
    settings = [
        "target_answers.max_prompts=5",
        "target_answers.max_new_tokens=6",
        "target_answers.batch_size=2",
    ]
    check_ok(run_train(["stage=target_answers", *TINY, *settings, f"hydra.run.dir={answers_run}"]))
    result = json.loads((answers_run / "result.json").read_text())
    assert result["answers"] == str(answers_run / "answers")
    assert result["train/answers"] == result["validation/answers"] == 5

    with hydra_conf():
        cfg = compose("train", overrides=["stage=target_answers", *TINY])
    seed_everything(cfg)
    tokenizer, target, _, _ = load_frozen_target_and_drafts(cfg, {}, device=torch.device("cpu"))
    datamodule = build_datamodule(cfg, tokenizer, max_length=512)
    written = read_answers(answers_run / "answers", "train")
    prompts = datamodule.prompts("train")[:5]
    assert sorted(written) == sorted(prompt_key(datamodule.task.prompt(p["record"])) for p in prompts)
    for prompt in prompts:
        ids = torch.tensor([prompt["prompt_ids"]])
        out = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert written[prompt_key(datamodule.task.prompt(prompt["record"]))] == expected

    check_ok(run_train(
        ["stage=distill", *TINY, "trainer.max_steps=1", "distill.batch_size=4",
         f"+task.answers_from={answers_run / 'answers'}", f"hydra.run.dir={distill_run}"]
    ))  # fmt: skip
    log = (distill_run / "train.log").read_text()
    assert "arith/train: training on 5 generated answers" in log
    assert "arith/validation: training on 5 generated answers" in log


def test_out_of_range_settings_are_refused_with_the_key():
    with hydra_conf():
        cfg = compose("train", overrides=["stage=target_answers"])
    for key, value, message in [
        ("splits", ["train", "dev"], r"target_answers.splits=\['train', 'dev'\]"),
        ("splits", [], r"target_answers.splits=\[\]"),
        ("max_new_tokens", 0, "target_answers.max_new_tokens"),
        ("max_prompts", 0, "target_answers.max_prompts"),
    ]:
        broken = cfg.copy()
        with open_dict(broken):
            broken.target_answers[key] = value
        with pytest.raises(ConfigError, match=message):
            build_settings(broken, "target_answers")


def test_a_pipeline_hands_the_answers_to_every_later_step():
    """conf/step/target_answers.yaml: the step's `answers` fills `task.answers_from`; pipeline=pretrained runs it
    first."""
    with hydra_conf():
        cfg = compose("train", overrides=["stage=pipeline", "pipeline=pretrained"])
    assert cfg.pipeline.steps[0] == "target_answers"
    assert dict(cfg.stage.steps.target_answers.outputs) == {"answers": ["task.answers_from"]}


def test_records_that_share_a_prompt_are_answered_once(tmp_path):
    """The standard library defines a few functions twice with the same signature and docstring: one answer each,
    which every record with that prompt then trains on."""
    from specdistill.stages.target_answers import unique_prompts

    plain = compose_task("arith", *ARITH)
    records = list(plain.load_split("train"))[:3]
    prompts = [{"record": r, "prompt_ids": [i]} for i, r in enumerate([*records, records[1]])]
    unique = unique_prompts(plain, prompts)
    assert list(unique) == [prompt_key(plain.prompt(r)) for r in records] and list(unique.values()) == [
        [0],
        [1],
        [2],
    ]
    write_answers(tmp_path, "train", [(key, "same") for key in unique])
    assert len(read_answers(tmp_path, "train")) == 3


def test_a_chat_is_answered_turn_by_turn_in_the_context_of_the_targets_own_replies(tmp_path):
    """A chat trained on every assistant turn: each turn is the target's greedy answer to the chat before it with
    the target's own earlier answers in place of the dataset's; a relaunch generates nothing again; training then
    reads every turn back from the answers file."""
    import functools
    from pathlib import Path

    from specdistill.stages.target_answers import (
        answer_turns,
        chats_of,
        context_ids,
        split_record,
        transformers_writer,
    )
    from specdistill.tasks.sharegpt import ShareGPT
    from specdistill.tasks.turns import assistant_turns, with_replies
    from tests.test_data import with_chat_template

    new_tokens = 4
    with hydra_conf():
        cfg = compose("train", overrides=["stage=target_answers", *TINY, f"target_answers.max_new_tokens={new_tokens}",
                                          "target_answers.batch_size=2", "target_answers.shard_size=2"])  # fmt: skip
    seed_everything(cfg)
    tokenizer, target, _, vocab_size = load_frozen_target_and_drafts(cfg, {}, device=torch.device("cpu"))
    tokenizer = with_chat_template(tokenizer)
    settings = build_settings(cfg, "target_answers")
    fixture = str(Path(__file__).parent / "fixtures" / "sharegpt" / "train.jsonl")
    task = ShareGPT(data_files=fixture, holdout={})
    chats = chats_of(task, task.load_split("train"), None)
    assert [assistant_turns(chat) for chat in chats] == [1, 2, 1, 1]
    writer = transformers_writer(settings, settings.decoding(), cfg.seed, target, tokenizer, vocab_size)
    record = functools.partial(split_record, cfg, settings, settings.decoding())
    shards = tmp_path / "shards"
    answers = dict(answer_turns(chats, tokenizer, shards, record, settings, writer))

    def generate(context) -> str:
        ids = context_ids(context, tokenizer, settings.max_length)
        out = target.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    two = chats[1]  # system, user, "Hi.", user, "Bye."
    first = generate(with_replies(two, []))
    second = generate(with_replies(two, [first]))
    assert answers[prompt_key(with_replies(two, []))] == first
    assert answers[prompt_key(with_replies(two, [first]))] == second
    assert len(answers) == 5 and sorted(p.name for p in shards.iterdir()) == ["turn-0", "turn-1"]

    def generate_nothing(*args):
        raise AssertionError("a relaunch generated a finished round again")

    assert dict(answer_turns(chats, tokenizer, shards, record, settings, generate_nothing)) == answers
    write_answers(tmp_path / "answers", "train", sorted(answers.items()))
    trained = ShareGPT(data_files=fixture, holdout={}, answers_from=str(tmp_path / "answers"))
    replies = [m["content"] for m in trained.training_conversation(trained.load_split("train")[1])]
    assert replies[2] == first and replies[4] == second and replies[1] == "Say hi."
