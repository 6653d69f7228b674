"""SelectionReport: reads the module's last selection, logs, counts and plots it, and never changes training."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from test_distill_module import VOCAB, loader, make_batches, make_examples, make_module, make_trainer, tiny_lm

from specdistill.callbacks.token_selection import SelectionReport
from specdistill.losses import ForwardKL
from specdistill.selection.reference import OnlineReference
from specdistill.selection.selectors import AdaSpecSelector, RandomSelector
from specdistill.selection.topk import keep_count


class _Tokenizer:
    """The one method the report needs, on a real id -> text table."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _adaspec_module(**kwargs):
    reference = OnlineReference(tiny_lm(3, hidden=16), ForwardKL(), VOCAB)
    return make_module(selector=AdaSpecSelector(k=0.4), reference=reference, **kwargs)


def _answer_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def test_report_end_to_end_writes_report_plot_logs_and_checkpoint_state(tmp_path):
    module = _adaspec_module()
    attributes = set(vars(module))
    callback = SelectionReport(tokenizer=_Tokenizer(), histogram_every_n_steps=1)
    batches = make_batches(make_examples(8), 4, 1)
    trainer = make_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[callback], log_every_n_steps=1)
    trainer.fit(module, loader(batches))
    assert set(vars(module)) == attributes  # nothing installed into the module
    assert 0.3 < float(trainer.callback_metrics["selection/kept_fraction"]) < 0.5
    assert trainer.callback_metrics["selection/gap_kept"] > trainer.callback_metrics["selection/gap_dropped"]
    assert "selection/divergence_kept" in trainer.callback_metrics
    report = json.loads((tmp_path / "selection_tokens.json").read_text())
    assert report["answer_tokens"] == sum(_answer_tokens(b) for b in batches)
    assert report["kept_tokens"] == sum(keep_count(_answer_tokens(b), 0.4) for b in batches)
    top = report["most_dropped"][0]
    assert top["dropped"] >= report["most_dropped"][-1]["dropped"] and len(top["token"]) == 1
    assert (tmp_path / "gap_histogram.png").stat().st_size > 1000
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert all(k.startswith("draft.") for k in checkpoint["state_dict"])
    state = next(v for k, v in checkpoint["callbacks"].items() if "SelectionReport" in k)
    assert int(state["kept_counts"].sum()) == report["kept_tokens"]
    resumed = SelectionReport()
    resumed.load_state_dict(state)  # a resumed run keeps counting from here
    assert resumed.kept_counts.equal(state["kept_counts"]) and resumed.dropped_counts.equal(
        state["dropped_counts"]
    )


@pytest.mark.parametrize("selector", ["adaspec", "random"])
def test_report_does_not_change_the_loss_or_the_weights(selector, tmp_path):
    weights, losses = [], []
    for with_report in (False, True):
        optimizer = functools.partial(torch.optim.SGD, lr=0.5)
        if selector == "adaspec":
            module = _adaspec_module(optimizer=optimizer)
        else:
            module = make_module(selector=RandomSelector(k=0.4, seed=1), optimizer=optimizer)
        callbacks = [SelectionReport(histogram_every_n_steps=1)] if with_report else []
        trainer = make_trainer(
            max_steps=2,
            accumulate_grad_batches=2,
            callbacks=callbacks,
            log_every_n_steps=1,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, loader(make_batches(make_examples(8), 2, 2)))
        weights.append({k: v.clone() for k, v in module.draft.state_dict().items()})
        losses.append(float(trainer.callback_metrics["train/loss"]))
    assert losses[0] == losses[1]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_histogram_samples_the_first_micro_batch_of_every_nth_optimizer_step(tmp_path):
    batches = make_batches(make_examples(16), 2, 1)
    callback = SelectionReport(histogram_every_n_steps=2, output_dir=str(tmp_path))
    make_trainer(max_steps=5, callbacks=[callback]).fit(_adaspec_module(), loader(batches))
    stored = sum(v.numel() for side in callback._stored.values() for v in side)
    assert stored == sum(_answer_tokens(batches[i]) for i in (0, 2, 4))  # optimizer steps 0, 2 and 4


def test_report_without_selector_counts_every_token_as_kept(tmp_path):
    batches = make_batches(make_examples(4), 2, 1)
    callback = SelectionReport(output_dir=str(tmp_path))
    trainer = make_trainer(max_steps=2, callbacks=[callback], log_every_n_steps=1)
    trainer.fit(make_module(), loader(batches))
    report = json.loads((tmp_path / "selection_tokens.json").read_text())
    assert report["kept_tokens"] == report["answer_tokens"] == sum(_answer_tokens(b) for b in batches)
    assert float(trainer.callback_metrics["selection/kept_fraction"]) == 1.0
    assert "selection/gap_kept" not in trainer.callback_metrics  # no reference, no gap


def test_report_arguments_are_validated():
    for bad in ({"top_tokens": 0}, {"histogram_every_n_steps": 0}, {"max_stored_scores": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            SelectionReport(**bad)


class _ClassTokenizer:
    """Token `i` decodes to one of four strings of different classes: a digit, a keyword, an identifier, a space."""

    TEXTS = ("7", "if", "x", " ")

    def decode(self, ids: list[int]) -> str:
        return "".join(self.TEXTS[i % 4] for i in ids)


def test_the_case_study_counts_each_token_class_and_marks_the_dropped_tokens_of_examples(tmp_path):
    callback = SelectionReport(tokenizer=_ClassTokenizer(), histogram_every_n_steps=1, examples=2)
    batches = make_batches(make_examples(8), 4, 1)
    trainer = make_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(_adaspec_module(), loader(batches))
    report = json.loads((tmp_path / "selection_tokens.json").read_text())
    by_class = report["by_class"]
    assert set(by_class) <= {"digits_operators", "keyword", "identifier", "whitespace"}
    assert sum(c["kept"] for c in by_class.values()) == report["kept_tokens"]
    assert sum(c["kept"] + c["dropped"] for c in by_class.values()) == report["answer_tokens"]
    kept_by_id, dropped_by_id = callback.kept_counts, callback.dropped_counts
    digits = [i for i in range(len(kept_by_id)) if i % 4 == 0]
    assert by_class["digits_operators"]["kept"] == int(kept_by_id[digits].sum())
    assert by_class["digits_operators"]["dropped"] == int(dropped_by_id[digits].sum())
    # the examples are the last sampled micro-batch's first two sequences, one mark per dropped token
    examples = report["examples"]
    last = batches[-1]
    assert len(examples) == 2
    for row, example in enumerate(examples):
        answer = last["labels"][row, 1:][last["labels"][row, 1:] != -100].tolist()
        assert example["kept"] + example["dropped"] == len(answer)
        assert example["text"].count("[[") == example["dropped"] > 0
        assert example["text"].replace("[[", "").replace("]]", "") == _ClassTokenizer().decode(answer)
    assert (tmp_path / "selection_classes.png").stat().st_size > 5000
    resumed = SelectionReport(examples=2)
    resumed.load_state_dict(callback.state_dict())
    assert resumed.example_sequences == callback.example_sequences


def test_first_rows_marks_each_answer_tokens_first_row():
    from specdistill.callbacks.token_selection import first_rows

    # EAGLE-3-like rows: step 0 over tokens 0..2, step 1 over tokens 1..2
    assert first_rows(torch.tensor([0, 1, 2, 1, 2])).tolist() == [True, True, True, False, False]
    assert first_rows(torch.tensor([2, 0, 2, 0])).tolist() == [True, True, False, False]
