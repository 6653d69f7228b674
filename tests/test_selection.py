"""Token selection: exact top-k with ties, scopes, selectors as pure functions, AdaSPEC wired into the module."""

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
from test_distill_module import VOCAB, loader, make_batches, make_examples, make_module, tiny_lm

from specdistill.losses import ForwardKL, forward_kl
from specdistill.selection.reference import CachedReferenceScores, OnlineReference
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


# -- selectors as pure functions of per-token scores (no Lightning, no model) --


def _select(selector, draft: torch.Tensor, ref: torch.Tensor | None = None, normaliser: float = 20.0):
    """Call a selector on N tokens in sequences of 5 (`sequence_index = arange(N) // 5`)."""
    return selector.select(draft, ref, torch.arange(draft.numel()) // 5, torch.tensor(normaliser))


def test_selectors_rank_by_their_score_and_normalise_as_documented():
    draft = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1])
    ref = torch.tensor([4.9, 0.0, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    gap_pick = _select(AdaSpecSelector(k=0.3), draft, ref)
    assert gap_pick.keep.nonzero().squeeze(1).tolist() == [1, 3, 5]  # large gap, not large draft loss
    torch.testing.assert_close(gap_pick.scores, draft - ref)
    assert gap_pick.normaliser.item() == 20.0
    loss_pick = _select(DraftLossSelector(k=0.3, normalise="selected_tokens"), draft, ref)
    assert loss_pick.keep.nonzero().squeeze(1).tolist() == [0, 1, 2]  # the reference is not read
    assert loss_pick.normaliser.item() == pytest.approx(6.0)  # k * window answer tokens
    seq = _select(AdaSpecSelector(k=0.4, scope="sequence"), draft, ref)
    assert seq.keep.nonzero().squeeze(1).tolist() == [1, 3, 5, 6]  # 2 per sequence of 5
    none = _select(NoSelector(), draft)
    assert none.keep.all() and none.normaliser.item() == 20.0 and none.scores is None
    with pytest.raises(ValueError, match="reference divergence"):
        _select(AdaSpecSelector(), draft)
    assert [
        s.needs_reference for s in (AdaSpecSelector(), DraftLossSelector(), RandomSelector(), NoSelector())
    ] == [
        True,
        False,
        False,
        False,
    ]


def test_every_selector_takes_k_and_none_only_k_one():
    """The stage passes the one key adaspec.k to whichever selector is configured."""
    draft = torch.arange(10.0)
    for cls in (AdaSpecSelector, DraftLossSelector, RandomSelector, NoSelector):
        assert cls(k=1.0).k == 1.0
        assert _select(cls(k=1.0), draft, torch.zeros(10)).keep.all()  # k = 1 keeps every token
    for k in (0.4, 0.0, 2.0):
        with pytest.raises(ValueError, match="selector=none keeps every answer token; set adaspec.k=1"):
            NoSelector(k=k)


def test_random_selector_is_seeded_and_exact():
    draft = torch.zeros(50)
    a = _select(RandomSelector(k=0.4, seed=3), draft).keep
    b = _select(RandomSelector(k=0.4, seed=3), draft).keep
    c = _select(RandomSelector(k=0.4, seed=4), draft).keep
    assert a.equal(b) and not a.equal(c) and int(a.sum()) == int(c.sum()) == 20
    selector = RandomSelector(k=0.4, seed=3)
    assert not _select(selector, draft).keep.equal(_select(selector, draft).keep)  # fresh each step
    state = torch.random.get_rng_state()
    _select(RandomSelector(k=0.4, seed=5), draft)
    assert torch.equal(torch.random.get_rng_state(), state)  # its own generator: the global RNG is untouched


# -- AdaSPEC wired into the module (selector and reference given to the constructor) --


def _online(reference=None) -> OnlineReference:
    return OnlineReference(reference if reference is not None else tiny_lm(3, hidden=16), ForwardKL(), VOCAB)


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None}


def _rows(model, batch, mask) -> torch.Tensor:
    """`(N, V)` logits of `model` at the answer positions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[:, :-1][mask]


def test_k_equal_one_is_plain_distillation_loss_and_gradients():
    batch = make_batches(make_examples(4), 4, 1)[0]
    plain = make_module()
    plain_loss = plain.training_step(batch, 0)
    plain_loss.backward()
    adaspec = make_module(selector=AdaSpecSelector(k=1.0), reference=_online())
    ada_loss = adaspec.training_step(batch, 0)
    ada_loss.backward()
    assert torch.equal(ada_loss, plain_loss)
    plain_grads, ada_grads = _grads(plain), _grads(adaspec)
    assert plain_grads.keys() == ada_grads.keys()
    for name in plain_grads:
        assert torch.equal(ada_grads[name], plain_grads[name]), name


def test_module_keeps_what_the_pure_selector_keeps_on_the_gap():
    """DistillModule(selector=AdaSpecSelector(k=0.4), reference=OnlineReference) = the selector on D(p,q) - D(p,r)."""
    reference = tiny_lm(3, hidden=16)
    module = make_module(selector=AdaSpecSelector(k=0.4), reference=_online(reference))
    batch = make_batches(make_examples(4), 4, 1)[0]
    module.training_step(batch, 0)
    mask = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        t, d, r = (_rows(m, batch, mask) for m in (module.target, module.draft, reference))
    sequence_index = torch.arange(4)[:, None].expand_as(mask)[mask]
    direct = AdaSpecSelector(k=0.4).select(
        forward_kl(t, d), forward_kl(t, r), sequence_index, batch["window_answer_tokens"].float()
    )
    record = module.last_selection
    assert record.keep.equal(direct.keep) and 0 < int(direct.keep.sum()) < direct.keep.numel()
    torch.testing.assert_close(record.scores, direct.scores)
    torch.testing.assert_close(record.reference_divergence, forward_kl(t, r))
    torch.testing.assert_close(record.gap, direct.scores)


def test_gradients_reach_the_draft_only_through_selected_tokens():
    batch = make_batches(make_examples(4), 4, 1)[0]
    module = make_module(selector=AdaSpecSelector(k=0.4), reference=_online())
    module.training_step(batch, 0).backward()
    selected_grads = _grads(module)
    keep = module.last_selection.keep
    assert 0 < keep.sum() < keep.numel()
    # the same loss written by hand on the kept positions only
    module.draft.zero_grad()
    mask = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        t = _rows(module.target, batch, mask)
    d = _rows(module.draft, batch, mask)
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
    """Forward passes of the model's body (the loss path runs the body and projects answer rows itself)."""
    calls = [0]
    model.base_model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_online_and_cached_scores_select_the_same_tokens_and_the_target_runs_once():
    reference = tiny_lm(3, hidden=16)
    batches = make_batches(make_examples(8), 4, 1)
    module = make_module(selector=AdaSpecSelector(k=0.4), reference=_online(reference))
    target_calls, reference_calls = _count_calls(module.target), _count_calls(reference)
    online_keeps, online_losses = [], []
    for batch in batches:
        online_losses.append(module.training_step(batch, 0).detach())
        online_keeps.append(module.last_selection.keep)
    assert target_calls[0] == len(batches) and reference_calls[0] == len(batches)

    scores = score_reference(module.target, reference, loader(batches), module.divergence, VOCAB)
    assert sorted(scores) == list(range(8))
    cached_module = make_module(selector=AdaSpecSelector(k=0.4), reference=CachedReferenceScores())
    cached_module.draft.load_state_dict(module.draft.state_dict())
    reference_calls[0] = 0
    for batch, keep, loss in zip(batches, online_keeps, online_losses, strict=True):
        rows = [scores[int(i)] for i in batch["example_id"]]
        cached_batch = {**batch, "ref_divergence": pad_scores(rows, batch["input_ids"].shape[1] - 1)}
        assert torch.equal(cached_module.training_step(cached_batch, 0).detach(), loss)
        assert cached_module.last_selection.keep.equal(keep)
    assert reference_calls[0] == 0  # cached scores replace the reference forward


def test_a_reference_is_never_run_for_a_selector_that_does_not_need_it():
    reference = tiny_lm(3, hidden=16)
    calls = _count_calls(reference)
    module = make_module(selector=DraftLossSelector(k=0.4), reference=_online(reference))
    module.training_step(make_batches(make_examples(4), 4, 1)[0], 0)
    assert calls[0] == 0 and module.last_selection.reference_divergence is None


def test_missing_or_mismatched_reference_is_refused():
    batch = make_batches(make_examples(2), 2, 1)[0]
    with pytest.raises(ValueError, match="needs the reference divergence"):
        make_module(selector=AdaSpecSelector(), reference=None)
    module = make_module(selector=AdaSpecSelector(), reference=CachedReferenceScores())
    with pytest.raises(ValueError, match="ref_divergence"):
        module.training_step(batch, 0)
    bad_shape = {**batch, "ref_divergence": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="score stage"):
        module.training_step(bad_shape, 0)
    with pytest.raises(ValueError, match="vocab_size 32"):
        OnlineReference(tiny_lm(3, hidden=16, vocab=32), ForwardKL(), VOCAB)
    with pytest.raises(ValueError, match="too long|positions"):
        pad_scores([[0.0] * 5], 4)


@pytest.mark.parametrize("name", ["adaspec", "random", "draft_loss", "none"])
def test_selector_configs_build_selectors(name):
    root = Path(__file__).resolve().parents[1] / "conf"
    # the stage passes the one key adaspec.k to whichever selector is configured
    composed = OmegaConf.create({"seed": 0, "selector": OmegaConf.load(root / "selector" / f"{name}.yaml")})
    selector = instantiate(composed.selector, k=1.0)
    assert selector.needs_reference == (name == "adaspec")
    assert _select(selector, torch.arange(10.0), torch.zeros(10)).keep.all()
    if name != "none":
        assert instantiate(composed.selector, k=0.4).k == 0.4
    for divergence in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        built = instantiate(OmegaConf.load(root / "divergence" / f"{divergence}.yaml"))
        assert built(torch.zeros(2, 4), torch.zeros(2, 4)).shape == (2,)
