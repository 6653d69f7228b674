"""The loss path from hidden states: chunked projections equal full logits (values and gradients), no full logits."""

from __future__ import annotations

import pytest
import torch
from test_distill_module import VOCAB, make_batches, make_examples, tiny_lm

from specdistill.losses import JSD, TVD, ForwardKL, ReverseKL, expected_acceptance, forward_kl
from specdistill.losses.answers import answer_logits, answer_mask
from specdistill.losses.chunked import rowwise
from specdistill.losses.rows import LogitRows, answer_rows
from specdistill.modules import DistillModule
from specdistill.utils.tensor_sizes import LargestTensor

DIVERGENCES = [ForwardKL(), ReverseKL(), JSD(beta=0.3), JSD(beta=0.0), TVD()]


def _batch():
    return make_batches(make_examples(6), 6, 1)[0]


def _draft_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=repr)
@pytest.mark.parametrize("chunk_size", [None, 7, 1000])
def test_chunked_from_hidden_states_equals_full_logits(divergence, chunk_size):
    """Values and gradients (draft output layer and body) of every divergence, odd and oversized chunks."""
    target, draft = tiny_lm(2), tiny_lm(1, hidden=16)
    batch = _batch()
    keep = answer_mask(batch["labels"])
    weights = torch.rand(int(keep.sum()), generator=torch.Generator().manual_seed(0))  # like a selection
    with torch.no_grad():
        full_target = answer_logits(target, batch, keep, VOCAB)
    full = divergence(full_target, answer_logits(draft, batch, keep, VOCAB))
    (full * weights).sum().backward()
    full_grads = _draft_grads(draft)
    draft.zero_grad(set_to_none=True)

    with torch.no_grad():
        target_rows = answer_rows(target, batch, keep, VOCAB)
    chunked = divergence.__class__(**{**vars(divergence), "chunk_size": chunk_size})
    values = chunked.rows(target_rows, answer_rows(draft, batch, keep, VOCAB))
    (values * weights).sum().backward()
    grads = _draft_grads(draft)

    torch.testing.assert_close(values, full, rtol=1e-5, atol=1e-6)
    assert (
        grads.keys() == full_grads.keys() == {n for n, _ in draft.named_parameters()}
    )  # output layer and body
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_one_chunk_from_hidden_states_is_bit_identical_to_full_logits():
    """The default (chunk_size None) keeps the embedded pair's training numbers: same bits as the logits path."""
    target, draft = tiny_lm(2), tiny_lm(1, hidden=16)
    batch = _batch()
    keep = answer_mask(batch["labels"])
    with torch.no_grad():
        full = forward_kl(answer_logits(target, batch, keep, VOCAB), answer_logits(draft, batch, keep, VOCAB))
        rows = ForwardKL().rows(
            answer_rows(target, batch, keep, VOCAB), answer_rows(draft, batch, keep, VOCAB)
        )
    assert torch.equal(rows, full)


def test_validation_metrics_share_one_projection_and_match_full_logits():
    target, draft = tiny_lm(2), tiny_lm(1, hidden=16)
    batch = _batch()
    keep = answer_mask(batch["labels"])
    with torch.no_grad():
        t, d = answer_logits(target, batch, keep, VOCAB), answer_logits(draft, batch, keep, VOCAB)
        kl, acceptance = rowwise(
            [forward_kl, expected_acceptance], answer_rows(target, batch, keep, VOCAB),
            answer_rows(draft, batch, keep, VOCAB), chunk_size=3,
        )  # fmt: skip
    torch.testing.assert_close(kl, forward_kl(t, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acceptance, expected_acceptance(t, d), rtol=1e-5, atol=1e-6)
    # an empty batch gives empty values, and mismatched rows are refused
    assert rowwise([forward_kl], LogitRows(t[:0]), LogitRows(d[:0]))[0].shape == (0,)
    with pytest.raises(ValueError, match="same positions"):
        rowwise([forward_kl], LogitRows(t), LogitRows(d[:-1]))


def _module(chunk_size: int | None) -> DistillModule:
    # vocabulary 67: no other tensor of these models ends in that dimension
    return DistillModule(
        draft=tiny_lm(1, hidden=16, vocab=67), target=tiny_lm(2, vocab=67), vocab_size=67,
        divergence=ForwardKL(chunk_size=chunk_size), optimizer=torch.optim.SGD,
    )  # fmt: skip


def test_training_step_never_builds_full_logits_and_keeps_its_loss():
    """With chunk_size 4 no tensor of the step (forward and backward) holds more than 4 rows of logits."""
    batch = make_batches(make_examples(8), 8, 1)[0]
    answers = int(answer_mask(batch["labels"]).sum())
    plain, chunked = _module(None), _module(4)
    with LargestTensor(last_dim=67) as plain_sizes:
        plain_loss = plain.training_step(batch, 0)
        plain_loss.backward()
    with LargestTensor(last_dim=67) as sizes:
        loss = chunked.training_step(batch, 0)
        loss.backward()
    with LargestTensor(last_dim=67) as model_sizes:
        plain.target(input_ids=batch["input_ids"])
    torch.testing.assert_close(loss, plain_loss)
    assert (
        model_sizes.numel == 8 * 12 * 67
    )  # the model's own forward builds full logits, and this test sees it
    assert plain_sizes.shape == (answers, 67)  # the default: answer rows only, all at once
    assert sizes.shape == (4, 67)
    for name, p in chunked.draft.named_parameters():
        torch.testing.assert_close(
            p.grad, dict(plain.draft.named_parameters())[name].grad, rtol=1e-4, atol=1e-6
        )
