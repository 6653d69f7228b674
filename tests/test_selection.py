"""Token selection: exact top-k with ties, scopes, AdaSPEC through the callback, online vs cached, end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_distill_module import VOCAB, loader, make_batches, make_examples, make_module, make_trainer, tiny_lm

from specdistill.callbacks.token_selection import TokenSelection
from specdistill.losses import forward_kl
from specdistill.selection import SelectionInput
from specdistill.selection.scoring import pad_scores, score_reference
from specdistill.selection.selectors import (
    AdaSpecSelector,
    DraftLossSelector,
    NoSelector,
    RandomSelector,
)
from specdistill.selection.topk import (
    keep_count,
    top_fraction,
    top_fraction_across_devices,
    top_fraction_global,
    top_fraction_per_group,
)

# -- pure top-k --


def test_keep_count_rounds_half_up_and_k_is_validated():
    assert [keep_count(n, 0.4) for n in (1, 2, 5, 10, 11)] == [0, 1, 2, 4, 4]
    assert keep_count(5, 0.5) == 3 and keep_count(7, 1.0) == 7 and keep_count(0, 0.4) == 0
    assert keep_count(10, 0.3) == 3  # 0.3 * 10 = 2.9999999999999996 in floating point
    for k in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            top_fraction(torch.ones(4), k)
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            AdaSpecSelector(k=k)
    with pytest.raises(ValueError, match="scope"):
        AdaSpecSelector(scope="batch")
    with pytest.raises(ValueError, match="normalise"):
        AdaSpecSelector(normalise="tokens")


def test_ties_never_change_the_count_and_go_to_the_lower_index():
    scores = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    keep = top_fraction(scores, 0.4)
    assert keep.tolist() == [False, True, True, False, False]
    # the authors' quantile rule keeps every tied token: 3 instead of round(0.4 * 5) = 2
    assert int((scores >= torch.quantile(scores, 0.6)).sum()) == 3
    flat = top_fraction(torch.zeros(10), 0.4)
    assert flat.tolist() == [True] * 4 + [False] * 6
    with pytest.raises(ValueError, match="NaN"):
        top_fraction(torch.tensor([1.0, float("nan")]), 0.5)


def test_per_group_selection_equals_selection_within_each_group():
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 2, 0, 2, 2, 0, 0, 2, 3, 3, 3, 0])
    scores = torch.randint(0, 3, (12,), generator=gen).float()  # many ties
    keep = top_fraction_per_group(scores, groups, 0.5)
    for g in groups.unique():
        idx = (groups == g).nonzero().squeeze(1)
        assert keep[idx].tolist() == top_fraction(scores[idx], 0.5).tolist()
        assert int(keep[idx].sum()) == keep_count(idx.numel(), 0.5)


def test_global_scope_over_two_devices_equals_the_whole_batch_on_one():
    gen = torch.Generator().manual_seed(1)
    device0, device1 = torch.randn(7, generator=gen), torch.randn(12, generator=gen)
    device1[3] = device0[2]  # a tie across devices
    parts = top_fraction_global([device0, device1], 0.4)
    whole = top_fraction(torch.cat([device0, device1]), 0.4)
    assert torch.cat(parts).tolist() == whole.tolist()
    assert int(torch.cat(parts).sum()) == keep_count(19, 0.4)
    # without a process group the global scope is the micro-batch
    assert top_fraction_across_devices(device0, 0.4).tolist() == top_fraction(device0, 0.4).tolist()


_WORKER = """
import json, sys
import torch, torch.distributed as dist
from specdistill.selection.topk import top_fraction_across_devices
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
scores = torch.arange(5.0) if rank == 0 else torch.arange(9.0) * 0.7
keep = top_fraction_across_devices(scores, 0.4)
dist.destroy_process_group()
json.dump(keep.tolist(), open(out, "w"))
"""


@pytest.mark.slow  # two fresh Python processes importing torch: seconds, more on a loaded machine
def test_global_scope_with_a_real_two_process_group(tmp_path):
    """Two gloo processes with unequal token counts (5 and 9) gather and select like one device would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(r), str(port), str(outs[r])], env=env)
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    expected = top_fraction_global([torch.arange(5.0), torch.arange(9.0) * 0.7], 0.4)
    assert [json.loads(o.read_text()) for o in outs] == [e.tolist() for e in expected]


# -- selectors on a SelectionInput --


def _input(draft_div: torch.Tensor, ref_div: torch.Tensor | None = None, normaliser: float = 20.0):
    n = draft_div.numel()
    logits = torch.zeros(n, 4)
    return SelectionInput(
        target_logits=logits,
        draft_logits=logits,
        draft_divergence=draft_div,
        divergence=None,
        sequence_index=torch.arange(n) // 5,
        token_ids=torch.arange(n) % 4,
        answer_mask=torch.ones(1, n, dtype=torch.bool),
        batch={},
        normaliser=torch.tensor(normaliser),
        ref_divergence=ref_div,
    )


def test_selectors_rank_by_their_score_and_normalise_as_documented():
    draft = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1])
    ref = torch.tensor([4.9, 0.0, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    gap_pick = AdaSpecSelector(k=0.3).select(_input(draft, ref))
    assert gap_pick.keep.nonzero().squeeze(1).tolist() == [1, 3, 5]  # large gap, not large draft loss
    torch.testing.assert_close(gap_pick.scores, draft - ref)
    assert gap_pick.normaliser.item() == 20.0
    loss_pick = DraftLossSelector(k=0.3, normalise="selected_tokens").select(_input(draft))
    assert loss_pick.keep.nonzero().squeeze(1).tolist() == [0, 1, 2]
    assert loss_pick.normaliser.item() == pytest.approx(6.0)  # k * window answer tokens
    seq = AdaSpecSelector(k=0.4, scope="sequence").select(_input(draft, ref))
    assert seq.keep.nonzero().squeeze(1).tolist() == [1, 3, 5, 6]  # 2 per sequence of 5
    none = NoSelector().select(_input(draft))
    assert none.keep.all() and none.normaliser.item() == 20.0
    with pytest.raises(ValueError, match="reference divergence"):
        AdaSpecSelector().select(_input(draft))


def test_random_selector_is_seeded_and_exact():
    draft = torch.zeros(50)
    a = RandomSelector(k=0.4, seed=3).select(_input(draft)).keep
    b = RandomSelector(k=0.4, seed=3).select(_input(draft)).keep
    c = RandomSelector(k=0.4, seed=4).select(_input(draft)).keep
    assert a.equal(b) and not a.equal(c) and int(a.sum()) == int(c.sum()) == 20
    selector = RandomSelector(k=0.4, seed=3)
    assert not selector.select(_input(draft)).keep.equal(
        selector.select(_input(draft)).keep
    )  # fresh each step


# -- AdaSPEC through the module and the callback --


def _module_with(selector, reference=None, accumulate: int = 1):
    module = make_module(accumulate=accumulate)
    callback = TokenSelection(selector, reference=reference)
    callback.attach(module)
    return module, callback


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None}


def test_k_equal_one_is_plain_distillation_loss_and_gradients():
    batch = make_batches(make_examples(4), 4, 1)[0]
    plain = make_module()
    plain_loss = plain.training_step(batch, 0)
    plain_loss.backward()
    adaspec, _ = _module_with(AdaSpecSelector(k=1.0), reference=tiny_lm(3, hidden=16))
    ada_loss = adaspec.training_step(batch, 0)
    ada_loss.backward()
    assert torch.equal(ada_loss, plain_loss)
    plain_grads, ada_grads = _grads(plain), _grads(adaspec)
    assert plain_grads.keys() == ada_grads.keys()
    for name in plain_grads:
        assert torch.equal(ada_grads[name], plain_grads[name]), name


def test_gradients_reach_the_draft_only_through_selected_tokens():
    batch = make_batches(make_examples(4), 4, 1)[0]
    module, callback = _module_with(AdaSpecSelector(k=0.4), reference=tiny_lm(3, hidden=16))
    module.training_step(batch, 0).backward()
    selected_grads = _grads(module)
    keep = callback.last_selection.keep
    assert 0 < keep.sum() < keep.numel()
    # the same loss written by hand on the kept positions only
    module.draft.zero_grad()
    mask = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        t = module.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[
            :, :-1
        ][mask]
    d = module.draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][
        mask
    ]
    manual = forward_kl(t[keep], d[keep]).sum() / batch["window_answer_tokens"]
    manual.backward()
    for name, grad in _grads(module).items():
        torch.testing.assert_close(selected_grads[name], grad, rtol=1e-5, atol=1e-7)
    # and it is not the plain gradient (the test can fail)
    module.draft.zero_grad()
    plain = forward_kl(t, module.draft(input_ids=batch["input_ids"]).logits[:, :-1][mask]).sum()
    plain.backward()
    name = next(iter(selected_grads))
    assert not torch.allclose(selected_grads[name], module.draft.get_parameter(name).grad)


def _count_calls(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_online_and_cached_scores_select_the_same_tokens_and_the_target_runs_once():
    reference = tiny_lm(3, hidden=16)
    batches = make_batches(make_examples(8), 4, 1)
    module, online = _module_with(AdaSpecSelector(k=0.4), reference=reference)
    target_calls, reference_calls = _count_calls(module.target), _count_calls(reference)
    online_keeps, online_losses = [], []
    for batch in batches:
        online_losses.append(module.training_step(batch, 0).detach())
        online_keeps.append(online.last_selection.keep)
    assert target_calls[0] == len(batches) and reference_calls[0] == len(batches)

    scores = score_reference(module.target, reference, loader(batches), module.divergence, VOCAB)
    assert sorted(scores) == list(range(8))
    cached_module, cached = _module_with(AdaSpecSelector(k=0.4), reference=None)
    cached_module.draft.load_state_dict(module.draft.state_dict())
    reference_calls[0] = 0
    for batch, keep, loss in zip(batches, online_keeps, online_losses, strict=True):
        rows = [scores[int(i)] for i in batch["example_id"]]
        cached_batch = {**batch, "ref_divergence": pad_scores(rows, batch["input_ids"].shape[1] - 1)}
        assert torch.equal(cached_module.training_step(cached_batch, 0).detach(), loss)
        assert cached.last_selection.keep.equal(keep)
    assert reference_calls[0] == 0  # cached scores replace the reference forward


def test_missing_or_mismatched_reference_is_refused():
    batch = make_batches(make_examples(2), 2, 1)[0]
    module, _ = _module_with(AdaSpecSelector(), reference=None)
    with pytest.raises(ValueError, match="ref_divergence"):
        module.training_step(batch, 0)
    bad_shape = {**batch, "ref_divergence": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="score stage"):
        module.training_step(bad_shape, 0)
    with pytest.raises(ValueError, match="vocab_size 32"):
        TokenSelection(AdaSpecSelector(), reference=tiny_lm(3, hidden=16, vocab=32)).attach(make_module())
    with pytest.raises(ValueError, match="vocab_size 32"):
        trainer = make_trainer(max_steps=1)
        callback = TokenSelection(AdaSpecSelector(), reference=tiny_lm(3, hidden=16, vocab=32))
        trainer.callbacks.append(callback)
        trainer.fit(make_module(), loader([batch]))
    with pytest.raises(ValueError, match="too long|positions"):
        pad_scores([[0.0] * 5], 4)


class _Tokenizer:
    """The one method the report needs, on a real id -> text table."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_callback_end_to_end_writes_report_plot_and_logs(tmp_path):
    module = make_module()
    callback = TokenSelection(
        AdaSpecSelector(k=0.4),
        reference=tiny_lm(3, hidden=16),
        tokenizer=_Tokenizer(),
        histogram_every_n_steps=1,
    )
    batches = make_batches(make_examples(8), 4, 1)
    trainer = make_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[callback], log_every_n_steps=1)
    trainer.fit(module, loader(batches))
    assert module.token_selector is callback
    assert 0.3 < float(trainer.callback_metrics["selection/kept_fraction"]) < 0.5
    assert trainer.callback_metrics["selection/gap_kept"] > trainer.callback_metrics["selection/gap_dropped"]
    report = json.loads((tmp_path / "selection_tokens.json").read_text())
    answer_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert report["answer_tokens"] == answer_tokens
    assert report["kept_tokens"] == sum(
        keep_count(int((b["labels"][:, 1:] != -100).sum()), 0.4) for b in batches
    )
    top = report["most_dropped"][0]
    assert top["dropped"] >= report["most_dropped"][-1]["dropped"] and len(top["token"]) == 1
    assert (tmp_path / "gap_histogram.png").stat().st_size > 1000
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert all(k.startswith("draft.") for k in checkpoint["state_dict"])
    state = next(v for k, v in checkpoint["callbacks"].items() if "TokenSelection" in k)
    assert int(state["kept_counts"].sum()) == report["kept_tokens"]


@pytest.mark.parametrize("name", ["adaspec", "random", "draft_loss", "none"])
def test_selector_configs_build_the_callback(name):
    root = Path(__file__).resolve().parents[1] / "conf"
    # selectors read k from the adaspec stage settings (`k: ${adaspec.k}`), as in the composed config
    composed = OmegaConf.create(
        {"adaspec": {"k": 0.4}, "selector": OmegaConf.load(root / "selector" / f"{name}.yaml")}
    )
    callback = instantiate(composed.selector)
    assert isinstance(callback, TokenSelection)
    assert callback.needs_reference == (name == "adaspec")
    for divergence in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        built = instantiate(OmegaConf.load(root / "divergence" / f"{divergence}.yaml"))
        assert built(torch.zeros(2, 4), torch.zeros(2, 4)).shape == (2,)
