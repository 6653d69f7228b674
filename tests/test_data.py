"""Tokenisation, prompt masking, truncation, collation, window token counts and TaskDataModule with real Lightning."""

from __future__ import annotations

import copy
import json
import logging
import math

import lightning as L
import pytest
import torch
from tokenizers import processors

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.data.collate import Collator
from specdistill.data.datamodule import TaskDataModule
from specdistill.data.formatting import render_prompt
from specdistill.data.sampler import WindowedSampler
from specdistill.data.tokenize import (
    IGNORE_INDEX,
    drop_long,
    encode_pair,
    special_prefix,
    truncate_prompt_left,
)
from specdistill.errors import DataError
from specdistill.tasks.arith import Arith
from specdistill.tasks.base import Task

EOS = 99


@pytest.fixture(scope="module")
def tok():
    return arith_tokenizer()


def with_chat_template(tokenizer):
    """A copy of `tokenizer` with a minimal chat template: `<role>content` lines, then `<assistant>`."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return chat


def small_arith(**limits) -> Arith:
    return Arith(sizes={"train": 40, "validation": 10, "test": 10}, **limits)


class Plain(Task):
    """A test task over JSONL records {"p": prompt, "a": answer}."""

    name = "plain"
    required_columns = ("p", "a")

    def prompt(self, record):
        return record["p"]

    def answer(self, record):
        return record["a"]


def plain_task(tmp_path, records) -> Plain:
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return Plain(data_files={"train": str(path)})


# ---------------------------------------------------------------- encoding and truncation (pure functions)
def test_encode_pair_masks_the_prompt_token_by_token():
    enc = encode_pair([1, 2, 3], [7, 8], EOS, 10, truncate_prompt_left)
    assert enc.input_ids == [1, 2, 3, 7, 8, EOS]
    assert enc.labels == [IGNORE_INDEX] * 3 + [7, 8, EOS]
    assert enc.prompt_length == 3 and enc.answer_tokens == 3


def test_prompt_left_truncation_order():
    prompt, answer = list(range(10)), [50, 51, 52, EOS]
    assert truncate_prompt_left(prompt, answer, 14) == (prompt, answer)  # fits: untouched
    assert truncate_prompt_left(prompt, answer, 9) == (
        [5, 6, 7, 8, 9],
        answer,
    )  # the prompt's start goes first
    # answer alone too long: one prompt token stays (the first answer token is still predicted), the end of the
    # answer goes, EOS first
    assert truncate_prompt_left(prompt, answer, 3) == ([9], [50, 51])
    enc = encode_pair(prompt, answer[:-1], EOS, 3, truncate_prompt_left)
    assert enc.input_ids == [9, 50, 51] and enc.labels == [IGNORE_INDEX, 50, 51]


def test_examples_without_answer_tokens_are_dropped():
    assert encode_pair([], [], EOS, 8, truncate_prompt_left) is None  # only EOS, never predicted (position 0)
    assert encode_pair([1, 2], [3], EOS, 8, truncate_prompt_left).answer_tokens == 2
    assert drop_long([1, 2, 3], [4, EOS], 4) is None and drop_long([1], [4, EOS], 4) == ([1], [4, EOS])


def test_special_prefix_finds_a_leading_bos(tok):
    assert special_prefix(tok) == []
    with_bos = copy.deepcopy(tok)
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", tok.eos_token_id)]
    )
    assert special_prefix(with_bos) == [
        tok.eos_token_id
    ]  # the leading one only; trailing EOS is not a prefix


# ---------------------------------------------------------------- datamodule
def test_datamodule_masking_matches_separate_tokenisation(tok):
    task = small_arith()
    dm = TaskDataModule(task, tok, max_length=256, batch_size=4)
    ds = dm.tokenized("train")
    assert ds.column_names == ["input_ids", "labels", "example_id"]
    assert dm.dropped["train"] == 0 and len(ds) == 40
    for example_id, record in enumerate(task.load_split("train").select(range(5))):
        prompt = tok(task.prompt(record))["input_ids"]
        answer = tok(task.answer(record))["input_ids"] + [tok.eos_token_id]
        row = ds[example_id]
        assert row["input_ids"] == prompt + answer
        assert row["labels"] == [IGNORE_INDEX] * len(prompt) + answer
        assert row["example_id"] == example_id
    first = dm.prompts("train")[0]
    assert first["example_id"] == 0 and first["record"] == task.load_split("train")[0]
    assert first["prompt_ids"] == tok(task.prompt(first["record"]))["input_ids"]


def test_datamodule_adds_a_leading_bos_to_plain_prompts(tok):
    with_bos = copy.deepcopy(tok)
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.eos_token_id)]
    )
    task = small_arith()
    row = TaskDataModule(task, with_bos, max_length=256).tokenized("validation")[0]
    record = task.load_split("validation")[0]
    assert row["input_ids"][0] == tok.eos_token_id
    assert row["input_ids"][1:] == tok(task.prompt(record))["input_ids"] + tok(task.answer(record))[
        "input_ids"
    ] + [tok.eos_token_id]


def test_datamodule_truncates_the_prompt_start(tok):
    task = small_arith()
    full = TaskDataModule(task, tok, max_length=512).tokenized("test")
    cut = TaskDataModule(task, tok, max_length=50).tokenized("test")
    cases = set()
    for a, b in zip(full, cut, strict=True):
        n_answer = sum(label != IGNORE_INDEX for label in a["labels"])
        assert len(b["input_ids"]) <= 50
        if n_answer < 50:  # the prompt's start was dropped, the answer kept whole (with EOS)
            assert b["input_ids"] == a["input_ids"][-50:] and b["labels"] == a["labels"][-50:]
            cases.add("prompt cut")
        else:  # one prompt token left, the answer's end cut (no EOS)
            assert b["labels"][0] == IGNORE_INDEX and b["labels"][1:] == a["labels"][-n_answer:][:49]
            assert b["input_ids"][-1] != tok.eos_token_id
            cases.add("answer cut")
    assert cases == {"prompt cut", "answer cut"}


def test_dropped_examples_are_counted_and_logged(tmp_path, tok, caplog):
    records = [{"p": "Q: one", "a": "one"}, {"p": "", "a": ""}, {"p": "Q: " + "x " * 40, "a": "long"}]
    task = plain_task(tmp_path, records)
    with caplog.at_level(logging.WARNING):
        dm = TaskDataModule(task, tok, max_length=16, truncation="drop")
        ds = dm.tokenized("train")
    assert len(ds) == 1 and dm.dropped["train"] == 2
    assert "dropped 2 of 3" in caplog.text
    assert dm.prompts("train")[0]["record"] == records[0]  # example ids map back to the right records
    only_bad = plain_task(tmp_path, records[1:])
    with pytest.raises(ValueError, match="empty after tokenisation"):
        TaskDataModule(only_bad, tok, max_length=16, truncation="drop").tokenized("train")


def test_datamodule_rejects_bad_settings(tok):
    with pytest.raises(ValueError, match="not a policy"):
        TaskDataModule(small_arith(), tok, truncation="middle")
    with pytest.raises(ValueError, match="max_length"):
        TaskDataModule(small_arith(), tok, max_length=1)
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="pad token"):
        TaskDataModule(small_arith(), no_pad)


def _answer_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("accumulate", [1, 3])
def test_window_answer_tokens_sum_the_accumulation_window(tok, accumulate):
    dm = TaskDataModule(small_arith(), tok, max_length=128, batch_size=3, accumulate_grad_batches=accumulate)
    batches = list(dm.train_dataloader())
    assert len(batches) == math.ceil(40 / 3)
    for start in range(0, len(batches), accumulate):
        window = batches[start : start + accumulate]  # the last window may be shorter
        total = sum(_answer_tokens(b) for b in window)
        assert all(int(b["window_answer_tokens"]) == total for b in window)
        assert all(b["window_answer_tokens"].shape == () for b in window)
    seen = torch.cat([b["example_id"] for b in batches]).tolist()
    assert sorted(seen) == list(range(40)) and seen != list(range(40))  # each example once, shuffled
    val = list(dm.val_dataloader())
    assert torch.cat([b["example_id"] for b in val]).tolist() == list(range(10))  # evaluation keeps the order
    assert all(int(b["window_answer_tokens"]) == _answer_tokens(b) for b in val)


def test_sampler_shards_ranks_and_sums_global_windows():
    counts = list(range(1, 12))  # 11 examples, answer tokens 1..11
    ranks = [WindowedSampler(counts, 2, 2, seed=5, num_replicas=2, rank=r) for r in range(2)]
    keys = [list(s) for s in ranks]
    assert len(keys[0]) == len(keys[1]) == 6 == len(ranks[0])  # padded by wrapping to 12
    assert set(k[0] for k in keys[0] + keys[1]) == set(range(11))
    for r in range(2):
        for w in range(0, 6, 4):
            window = keys[r][w : w + 4]
            assert all(k[1] == sum(counts[i] for i, _, _ in window) for k in window)
    assert keys[0][0][2] == keys[0][0][1] + keys[1][0][1]


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_sampler_resume_skips_the_done_micro_batches_of_that_epoch_only(num_replicas):
    counts = list(range(1, 24))  # 23 examples; batch_size 2, 3 micro-batches per window

    def sampler(rank, resume_at=None, epoch=1):
        s = WindowedSampler(counts, 2, 3, seed=4, num_replicas=num_replicas, rank=rank, resume_at=resume_at)
        s.set_epoch(epoch)
        return s

    for rank in range(num_replicas):
        full = list(sampler(rank))
        n_batches = math.ceil(len(full) / 2)
        assert len(full) == math.ceil(23 / num_replicas)
        for done in (0, 1, 3, 4, n_batches - 1):
            resumed = sampler(rank, resume_at=(1, done))
            # exactly the done micro-batches go; the window totals stay those of the full windows
            assert list(resumed) == full[done * 2 :]
            assert len(resumed) == len(full)  # Lightning sizes the epoch from the full length
            assert list(resumed) == full  # consumed: the next iteration is complete
            resumed.set_epoch(2)
            assert list(resumed) == list(sampler(rank, epoch=2))
        other_epoch = sampler(rank, resume_at=(0, 3))
        assert list(other_epoch) == full  # a resume point of another epoch skips nothing
        assert other_epoch.resume_at is None
        assert list(sampler(rank, resume_at=(1, n_batches))) == []  # saved after the epoch's last micro-batch
        with pytest.raises(ValueError, match="batch size"):
            list(sampler(rank, resume_at=(1, n_batches + 1)))


def test_shuffling_is_seeded_per_epoch_and_resumable(tok):
    def order(dm):
        return torch.cat([b["example_id"] for b in dm.train_dataloader()]).tolist()

    dm = TaskDataModule(small_arith(), tok, batch_size=4, seed=1)
    epoch0 = order(dm)
    assert order(TaskDataModule(small_arith(), tok, batch_size=4, seed=1)) == epoch0
    assert order(TaskDataModule(small_arith(), tok, batch_size=4, seed=2)) != epoch0
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)  # what Lightning does at each epoch start
    epoch1 = torch.cat([b["example_id"] for b in loader]).tolist()
    assert epoch1 != epoch0
    state = dm.state_dict()
    assert state == {"epoch": 1, "seed": 1, "batches_done": 0}  # no trainer: nothing trained yet
    resumed = TaskDataModule(small_arith(), tok, batch_size=4, seed=1)
    resumed.load_state_dict(state)
    assert order(resumed) == epoch1


def test_attached_columns_are_padded_with_zeros(tok):
    dm = TaskDataModule(small_arith(), tok, max_length=256, eval_batch_size=5)
    ids = dm.tokenized("validation")["input_ids"]
    values = [[float(i + 1)] * (len(x) - 1) for i, x in enumerate(ids)]
    dm.attach_column("validation", "ref_divergence", values)
    batch = next(iter(dm.val_dataloader()))
    width = batch["input_ids"].shape[1]
    assert batch["ref_divergence"].shape == (5, width - 1) and batch["ref_divergence"].dtype == torch.float32
    for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        assert torch.all(batch["ref_divergence"][row, : n - 1] == row + 1)
        assert torch.all(batch["ref_divergence"][row, n - 1 :] == 0.0)
    dm.attach_column("validation", "ref_divergence", [[0.0] * (len(x) - 1) for x in ids])  # replacing is fine
    assert float(next(iter(dm.val_dataloader()))["ref_divergence"].sum()) == 0.0
    with pytest.raises(ValueError, match="len\\(input_ids\\) - 1"):
        dm.attach_column("validation", "bad", [[0.0] * len(x) for x in ids])
    with pytest.raises(ValueError, match="NaN"):
        dm.attach_column("validation", "bad", [[math.nan] * (len(x) - 1) for x in ids])
    with pytest.raises(ValueError, match="reserved"):
        dm.attach_column("validation", "labels", values)
    with pytest.raises(ValueError, match="rows given"):
        dm.attach_column("validation", "bad", values[:-1])


def test_collate_uses_lengths_when_pad_equals_eos():
    collate = Collator(pad_token_id=EOS, pad_to_multiple_of=4)
    batch = collate(
        [
            {
                "input_ids": [1, 2, EOS],
                "labels": [IGNORE_INDEX, 2, EOS],
                "example_id": 0,
                "window_answer_tokens": 3,
            },
            {
                "input_ids": [1, EOS],
                "labels": [IGNORE_INDEX, EOS],
                "example_id": 1,
                "window_answer_tokens": 3,
            },
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 2, EOS, EOS], [1, EOS, EOS, EOS]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]  # the real EOS is attended
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 2, EOS, IGNORE_INDEX],
        [IGNORE_INDEX, EOS] + [IGNORE_INDEX] * 2,
    ]
    assert batch["window_answer_tokens"].item() == 3


def test_render_prompt_chat_template(tok):
    chat = with_chat_template(tok)
    task = small_arith(chat_template=True)
    record = {"question": "Q?", "answer": "#### 1"}
    expected = "<user>Q?\nAnswer the above question. First think step by step and then answer the final number.\n\n<assistant>"
    assert render_prompt(task, record, chat) == expected
    with pytest.raises(ValueError, match="has none"):
        render_prompt(task, record, tok)


class _Recorder(L.LightningModule):
    """Records what Lightning feeds it; a single weight so that the optimizer has something to step."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, list[int], int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(
            (self.current_epoch, batch["example_id"].tolist(), int(batch["window_answer_tokens"]))
        )
        return (self.w - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_sets_epochs_and_checkpoints_the_data_state(tok, tmp_path):
    dm = TaskDataModule(small_arith(), tok, max_length=128, batch_size=8, accumulate_grad_batches=2, seed=3)
    module = _Recorder()
    trainer = L.Trainer(
        max_epochs=2, accumulate_grad_batches=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    for epoch in (0, 1):
        sampler = WindowedSampler(dm.answer_tokens("train"), 8, 2, seed=3)
        sampler.set_epoch(epoch)
        expected = [i for i, _, _ in sampler]
        got = [i for e, ids, _ in module.seen if e == epoch for i in ids]
        assert got == expected
    assert module.seen[0][2] == module.seen[1][2]  # first two micro-batches share one window
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert ckpt["TaskDataModule"] == {"epoch": 1, "seed": 3, "batches_done": 5}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_run_resumed_mid_epoch_sees_the_uninterrupted_batches(tok, tmp_path, accumulate):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Scheduled(_Recorder):
        def configure_optimizers(self):
            # like the stages' schedulers: builds the training loader before the loops are restored
            assert self.trainer.estimated_stepping_batches > 0
            return super().configure_optimizers()

    def run(root, max_steps, ckpt_path=None, callbacks=()):
        dm = TaskDataModule(
            small_arith(), tok, max_length=128, batch_size=4, accumulate_grad_batches=accumulate
        )
        module = Scheduled()
        trainer = L.Trainer(
            max_epochs=2, max_steps=max_steps, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
            callbacks=list(callbacks), enable_checkpointing=bool(callbacks), enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module.seen, module.w.detach().clone()

    reference, weight = run(tmp_path / "ref", -1)
    per_epoch = 10 // accumulate  # 40 examples / 4 = 10 micro-batches
    stop = per_epoch // 2 + 1  # optimizer steps before the interruption: mid-epoch 0
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1)
    # saved in on_train_batch_end of optimizer step `stop`, mid-epoch 0
    first, _ = run(tmp_path / "run", stop, callbacks=[checkpoint])
    (ckpt,) = (tmp_path / "ckpt").iterdir()
    state = torch.load(ckpt, weights_only=False)["TaskDataModule"]
    assert state == {"epoch": 0, "seed": 0, "batches_done": stop * accumulate}
    second, resumed_weight = run(tmp_path / "run", -1, ckpt_path=ckpt)
    assert first + second == reference  # same examples, order and window totals; nothing skipped or repeated
    torch.testing.assert_close(resumed_weight, weight, rtol=0, atol=0)


def test_resume_state_reaches_a_training_loader_built_before_it(tok):
    def ids(loader):
        return torch.cat([b["example_id"] for b in loader]).tolist()

    full = ids(TaskDataModule(small_arith(), tok, batch_size=4, seed=1).train_dataloader())
    dm = TaskDataModule(small_arith(), tok, batch_size=4, seed=1)
    loader = dm.train_dataloader()  # e.g. built by estimated_stepping_batches before DeepSpeed restores
    dm.load_state_dict({"epoch": 0, "seed": 1, "batches_done": 3})
    assert ids(loader) == full[12:]
    assert ids(loader) == full  # the next pass over the loader is a whole epoch
    later = TaskDataModule(small_arith(), tok, batch_size=4, seed=1)
    later.load_state_dict({"epoch": 0, "seed": 1, "batches_done": 3})
    assert ids(later.train_dataloader()) == full[12:]
    assert ids(later.train_dataloader()) == full  # handed to one training loader only


def test_chat_task_end_to_end(tok):
    from pathlib import Path

    from specdistill.tasks.sharegpt import ShareGPT

    chat = with_chat_template(tok)
    fixture = Path(__file__).parent / "fixtures" / "sharegpt" / "train.jsonl"
    task = ShareGPT(data_files=str(fixture), holdout={}, all_turns=False)
    dm = TaskDataModule(task, chat, max_length=256)
    row = dm.tokenized("train")[0]
    prompt = chat("<user>What is the capital of France?\n<assistant>")["input_ids"]
    answer = chat("The capital of France is Paris.")["input_ids"] + [chat.eos_token_id]
    assert row["input_ids"] == prompt + answer
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + answer
    with pytest.raises(ValueError, match="chat_template is false"):
        render_prompt(ShareGPT(data_files=str(fixture), chat_template=False), {"conversations": [
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, chat)  # fmt: skip


def test_every_assistant_turn_of_a_chat_is_a_loss_row(tok):
    """`all_turns` (ShareGPT's default): one example per chat, labels on every assistant turn as the chat template
    writes it and -100 on the system, user and header text; the prompt is the chat before its last turn."""
    from pathlib import Path

    from specdistill.tasks.sharegpt import ShareGPT

    chat = with_chat_template(tok)
    fixture = Path(__file__).parent / "fixtures" / "sharegpt" / "train.jsonl"
    dm = TaskDataModule(ShareGPT(data_files=str(fixture), holdout={}), chat, max_length=256)
    ids = lambda text: chat(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = dm.tokenized("train")[1]  # system, user, "Hi.", user, "Bye." (the unanswered "Thanks!" dropped)
    context = ids("<system>You are terse.\n<user>Say hi.\n<assistant>")
    middle = ids("<user>Now say bye.\n<assistant>")
    assert row["input_ids"] == context + ids("Hi.\n") + middle + ids("Bye.\n")
    masked = [IGNORE_INDEX] * len(context) + ids("Hi.\n") + [IGNORE_INDEX] * len(middle) + ids("Bye.\n")
    assert row["labels"] == masked
    assert dm.prompts("train")[1]["prompt_ids"] == context + ids("Hi.\n") + middle
    assert dm.answer_tokens("train")[1] == len(ids("Hi.\n")) + len(ids("Bye.\n"))
    # cut inside the second reply: the first turn stays a loss row and becomes the prompt's answer
    short = TaskDataModule(ShareGPT(data_files=str(fixture), holdout={}), chat, max_length=len(context) + 6)
    cut = short.tokenized("train")[1]
    assert cut["input_ids"] == (context + ids("Hi.\n") + middle + ids("Bye.\n"))[: len(context) + 6]
    assert short.prompts("train")[1]["prompt_ids"] == context
    # a template that rewrites earlier turns cannot be masked turn by turn: a clear error
    rewriting = copy.deepcopy(chat)
    rewriting.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if loop.last or m['role'] != 'assistant' "
        "else '...' }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(DataError, match="all_turns=false"):
        TaskDataModule(ShareGPT(data_files=str(fixture), holdout={}), rewriting, max_length=256).tokenized(
            "train"
        )
