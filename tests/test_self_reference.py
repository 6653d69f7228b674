"""A draft that is its own reference (`selector=adaspec_lagged|adaspec_ema`): the weights that score are always
earlier ones, never the current draft's; the copies survive a checkpoint; train.py runs AdaSPEC without a reference."""

from __future__ import annotations

import functools

import pytest
import torch
from test_distill_module import VOCAB, loader, make_batches, make_examples, make_trainer, tiny_lm
from torch import nn

from specdistill.errors import ConfigError
from specdistill.losses import ForwardKL
from specdistill.modules.distill import DistillModule
from specdistill.selection.reference import OnlineReference
from specdistill.selection.selectors import SelfReferenceSelector
from specdistill.selection.self_reference import SelfReference
from tests.helpers import TINY, check_ok, run_train, stage_overrides


def _online(model: nn.Module) -> OnlineReference:
    return OnlineReference(model, ForwardKL(), VOCAB)


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_lagged_reference_holds_the_snapshot_from_n_to_2n_steps_earlier():
    draft = nn.Linear(3, 2)
    reference = SelfReference(draft, _online, mode="lagged", every=3)
    history, scored = {}, []
    for step in range(14):
        history[step] = _weights(draft)
        if reference.scores_step(step):
            held = _weights(reference.model)
            torch.testing.assert_close(held, history[reference.reference_step], rtol=0, atol=0)
            assert 3 <= step - reference.reference_step <= 6
            assert not torch.equal(held, history[step])
            scored.append(step)
        reference.before_optimizer_step(draft, step)
        with torch.no_grad():  # the optimizer's step: every weight moves
            for parameter in draft.parameters():
                parameter.add_(1.0)
    assert scored == list(range(3, 14))
    assert not any(p.requires_grad for p in reference.model.parameters())


def test_ema_reference_averages_only_the_weights_steps_started_from():
    draft = nn.Linear(2, 1)
    reference = SelfReference(draft, _online, mode="ema", decay=0.5, warmup_steps=2)
    expected = _weights(draft)
    for step in range(6):
        assert reference.scores_step(step) == (step >= 2)
        torch.testing.assert_close(_weights(reference.model), expected)
        if step:
            assert not torch.equal(_weights(reference.model), _weights(draft))
        reference.before_optimizer_step(draft, step)
        expected = 0.5 * expected + 0.5 * _weights(draft)
        with torch.no_grad():
            for parameter in draft.parameters():
                parameter.mul_(2.0).add_(1.0)


def test_training_never_scores_with_the_current_weights():
    """Each time the self-reference runs inside Lightning's loop, its weights differ from the draft's at that moment
    and equal the draft's from an earlier step; before it is old enough every token is kept."""
    draft = tiny_lm(1, hidden=16)
    every = 2
    reference = SelfReference(draft, _online, mode="lagged", every=every)
    module = DistillModule(
        draft=draft,
        target=tiny_lm(2),
        vocab_size=VOCAB,
        divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-2),
        selector=SelfReferenceSelector(k=0.5, self_reference="lagged", every=every),
        reference=reference,
    )
    history: dict[int, torch.Tensor] = {}
    calls: list[tuple[int, bool, bool]] = []
    kept_all: dict[int, bool] = {}

    def on_scoring(*_):
        step = module.global_step
        held = _weights(reference.model)
        earlier = history.get(reference.reference_step)
        calls.append(
            (
                step,
                torch.equal(held, _weights(module.draft)),
                earlier is not None and torch.equal(held, earlier),
            )
        )

    reference.model.base_model.register_forward_pre_hook(on_scoring)

    class Watch(__import__("lightning").pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            history[trainer.global_step] = _weights(pl_module.draft)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kept_all[trainer.global_step - 1] = bool(pl_module.last_selection.keep.all())

    make_trainer(max_steps=7, callbacks=[Watch()]).fit(module, loader(make_batches(make_examples(14), 2, 1)))
    assert [step for step, _, _ in calls] == list(range(every, 7))
    assert not any(current for _, current, _ in calls), calls
    assert all(from_history for _, _, from_history in calls), calls
    assert all(kept_all[step] for step in range(every)) and not any(kept_all[s] for s in range(every, 7))


def test_the_copies_travel_in_the_checkpoint():
    draft = nn.Linear(3, 2)
    reference = SelfReference(draft, _online, mode="lagged", every=2)
    for step in range(5):
        reference.before_optimizer_step(draft, step)
        with torch.no_grad():
            draft.weight.add_(1.0)
    state = reference.state_dict()
    resumed = SelfReference(nn.Linear(3, 2), _online, mode="lagged", every=2)
    resumed.load_state_dict(state)
    assert resumed.reference_step == reference.reference_step == 2
    torch.testing.assert_close(_weights(resumed.model), _weights(reference.model))
    torch.testing.assert_close(resumed._pending["weight"], reference._pending["weight"])
    with pytest.raises(ValueError, match="resume with the selector"):
        SelfReference(nn.Linear(3, 2), _online, mode="ema").load_state_dict(state)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"self_reference": "frozen"}, "must be one of"),
        ({"self_reference": "lagged", "every": 0}, "every"),
        ({"self_reference": "ema", "decay": 1.0}, "decay"),
        ({"self_reference": "ema", "warmup_steps": 0}, "warmup_steps"),
    ],
)
def test_out_of_range_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SelfReferenceSelector(k=0.4, **options)


@pytest.mark.slow
@pytest.mark.parametrize(
    "selector",
    [["selector=adaspec_lagged", "selector.every=1"], ["selector=adaspec_ema", "selector.warmup_steps=1"]],
)
def test_train_py_runs_adaspec_with_a_self_reference_and_no_reference_stage(tmp_path, selector):
    proc = run_train(
        ["stage=adaspec", *TINY, *selector,
         *stage_overrides("adaspec", 3), f"hydra.run.dir={tmp_path}"]
    )  # fmt: skip
    check_ok(proc)
    assert "self-reference: no reference model is loaded" in proc.stdout + proc.stderr
    assert (tmp_path / "export" / "config.json").is_file()
    assert not (tmp_path / "reference_scores").exists()


@pytest.mark.parametrize(
    ("mode", "options", "trainer"),
    [
        (
            "lagged",
            {"every": 8},
            {"max_epochs": 1},
        ),  # 14 examples, batch 2: 7 optimizer steps, known from the data
        ("ema", {"warmup_steps": 3}, {"max_steps": 3}),
    ],
)
def test_a_run_that_ends_before_the_reference_scores_is_refused_at_fit_start(mode, options, trainer):
    """The planned steps (epochs x batches, or max_steps) end before the self-reference is old enough to score: the
    run would be plain distillation exported as AdaSPEC, so it stops before the first optimizer step."""
    draft = tiny_lm(1, hidden=16)
    before = _weights(draft)
    module = DistillModule(
        draft=draft, target=tiny_lm(2), vocab_size=VOCAB, divergence=ForwardKL(),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-2),
        selector=SelfReferenceSelector(k=0.5, self_reference=mode, **options),
        reference=SelfReference(draft, _online, mode=mode, **options),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"first scores at optimizer step \d+, but the run has \d+"):
        make_trainer(**trainer).fit(module, loader(make_batches(make_examples(14), 2, 1)))
    assert torch.equal(_weights(draft), before)  # not one step trained
