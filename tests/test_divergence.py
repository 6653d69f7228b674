"""Divergences against direct reference computations, JSD limits, chunking, reductions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.losses import (
    JSD,
    TVD,
    ForwardKL,
    ReverseKL,
    chunked_divergence,
    expected_acceptance,
    forward_kl,
    jsd,
    reduce_tokens,
    reverse_kl,
    tvd,
)


@pytest.fixture
def logits() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(13, 37, generator=gen) * 2, torch.randn(13, 37, generator=gen) * 2


def _kl_div_reference(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row with torch's own F.kl_div (input = log q, target = log p)."""
    log_p = F.log_softmax(p_logits.double(), -1)
    log_q = F.log_softmax(q_logits.double(), -1)
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def test_forward_and_reverse_kl_match_kl_div(logits):
    t, d = logits
    torch.testing.assert_close(forward_kl(t, d).double(), _kl_div_reference(t, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reverse_kl(t, d).double(), _kl_div_reference(d, t), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(forward_kl(t, d), reverse_kl(t, d))  # the order really matters


def test_jsd_matches_mixture_definition(logits):
    t, d = logits
    beta = 0.3
    p, q = torch.softmax(t.double(), -1), torch.softmax(d.double(), -1)
    m = beta * p + (1 - beta) * q
    expected = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(jsd(t, d, beta).double(), expected, rtol=1e-5, atol=1e-6)
    # beta = 0.5 is the symmetric JSD, bounded by log 2.
    sym = jsd(t, d, 0.5)
    torch.testing.assert_close(sym, jsd(d, t, 0.5), rtol=1e-5, atol=1e-6)
    assert (sym <= math.log(2) + 1e-6).all() and (sym > 0).all()


def test_jsd_limits_follow_trl(logits):
    t, d = logits
    # trl defines the endpoints as the two KLs ...
    torch.testing.assert_close(jsd(t, d, 0.0).double(), _kl_div_reference(t, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(jsd(t, d, 1.0).double(), _kl_div_reference(d, t), rtol=1e-5, atol=1e-6)
    # ... and the mixture formula approaches them after dividing by beta (resp. 1 - beta).
    # (the correction is O(beta log 1/beta) and fp32 round-off grows as 1/beta, hence eps = 1e-5)
    eps = 1e-5
    torch.testing.assert_close(jsd(t, d, eps) / eps, forward_kl(t, d), rtol=5e-3, atol=1e-3)
    torch.testing.assert_close(jsd(t, d, 1 - eps) / eps, reverse_kl(t, d), rtol=5e-3, atol=1e-3)
    assert not torch.allclose(jsd(t, d, 1e-2) / 1e-2, forward_kl(t, d), rtol=5e-3)  # the limit test can fail


def test_tvd_and_expected_acceptance(logits):
    t, d = logits
    p, q = torch.softmax(t.double(), -1), torch.softmax(d.double(), -1)
    torch.testing.assert_close(tvd(t, d).double(), 0.5 * (p - q).abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_acceptance(t, d), 1 - tvd(t, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_acceptance(t, t), torch.ones(13))
    assert (expected_acceptance(t, d) < 1).all()


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl, tvd, lambda t, d: jsd(t, d, 0.5)])
def test_identical_distributions_give_zero(fn, logits):
    t, _ = logits
    torch.testing.assert_close(fn(t, t + 3.0), torch.zeros(13), atol=1e-5, rtol=0)  # softmax shift-invariant


def test_low_precision_inputs_are_computed_in_fp32(logits):
    t, d = logits
    out = forward_kl(t.bfloat16(), d.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, forward_kl(t.bfloat16().float(), d.bfloat16().float()))


def test_masked_vocabulary_rows_do_not_give_nan(logits):
    t, d = logits
    t = t.clone()
    t[:, -5:] = float("-inf")  # e.g. padded embedding rows blocked in the target
    d = d.clone().requires_grad_(True)
    for fn in (forward_kl, lambda a, b: jsd(a, b, 0.5), tvd):
        out = fn(t, d)
        assert torch.isfinite(out).all()
        (grad,) = torch.autograd.grad(out.sum(), d)
        assert torch.isfinite(grad).all()


def test_bad_shapes_and_beta_are_refused(logits):
    t, d = logits
    with pytest.raises(ValueError, match="same shape"):
        forward_kl(t, d[:, :-1])
    with pytest.raises(ValueError, match="same shape"):
        forward_kl(t[None], d[None])
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="beta"):
            JSD(beta=beta)
        with pytest.raises(ValueError, match="beta"):
            jsd(t, d, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        ForwardKL(chunk_size=0)


@pytest.mark.parametrize("divergence_cls", [ForwardKL, ReverseKL, TVD, lambda **kw: JSD(beta=0.7, **kw)])
def test_chunked_equals_plain_values_and_gradients(divergence_cls, logits):
    t, d = logits
    d1 = d.clone().requires_grad_(True)
    d2 = d.clone().requires_grad_(True)
    plain = divergence_cls()(t, d1)
    chunked = divergence_cls(chunk_size=4)(t, d2)  # 13 rows: chunks of 4, 4, 4, 1
    torch.testing.assert_close(chunked, plain, rtol=0, atol=0)
    weights = torch.linspace(0.5, 2.0, 13)
    (g1,) = torch.autograd.grad((plain * weights).sum(), d1)
    (g2,) = torch.autograd.grad((chunked * weights).sum(), d2)
    torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-7)
    # without recomputation too, and on zero rows
    torch.testing.assert_close(chunked_divergence(forward_kl, t, d, 5, recompute=False), forward_kl(t, d))
    assert chunked_divergence(forward_kl, t[:0], d[:0], 5).shape == (0,)


def test_divergence_objects_compare_by_value():
    assert JSD(beta=0.3) == JSD(0.3) and JSD(beta=0.3) != JSD(beta=0.4)
    assert ForwardKL() == ForwardKL() and ForwardKL() != ReverseKL()


def test_reduce_tokens_sums_kept_over_normaliser():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    keep = torch.tensor([True, False, True, False])
    assert reduce_tokens(values, keep, 10).item() == pytest.approx(0.4)
    assert reduce_tokens(values, keep).item() == pytest.approx(2.0)  # mean over kept
    assert reduce_tokens(values).item() == pytest.approx(2.5)


def test_all_masked_batch_gives_zero_loss_and_zero_gradients():
    values = torch.tensor([1.0, float("nan"), 3.0], requires_grad=True)
    keep = torch.zeros(3, dtype=torch.bool)
    for normaliser in (None, 0, torch.tensor(0), torch.tensor(7)):
        loss = reduce_tokens(values, keep, normaliser)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, values)
        assert torch.equal(grad, torch.zeros(3))
    empty = torch.zeros(0, requires_grad=True)
    assert reduce_tokens(empty, None, 0).item() == 0.0


def test_reduce_tokens_refuses_bad_masks():
    with pytest.raises(ValueError, match="bool mask"):
        reduce_tokens(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"\(N,\)"):
        reduce_tokens(torch.ones(3, 2))
