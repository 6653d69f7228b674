"""The automatic chunk of the loss path: chosen from a memory budget, equal to the unchunked values, and a tiny-pair
batch stays one chunk (the same operations as without chunking)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose
from hydra.utils import instantiate
from test_distill_module import VOCAB, make_batches, make_examples, tiny_lm

from specdistill.losses import JSD, ForwardKL, forward_kl
from specdistill.losses.answers import answer_logits, answer_mask
from specdistill.losses.chunked import DEFAULT_CHUNK_BUDGET_MB, auto_chunk_size, rowwise
from specdistill.losses.rows import answer_rows
from specdistill.utils.tensor_sizes import LargestTensor
from tests.helpers import hydra_conf

TINY_VOCAB = 512  # conf/models/tiny.yaml


def test_budget_sets_the_rows_per_chunk():
    mib = 2**20
    assert auto_chunk_size(10, 1000, None) is None
    assert auto_chunk_size(262, 1000, 1.0) is None  # 262 * 1000 * 4 bytes fit in 1 MiB
    assert auto_chunk_size(263, 1000, 1.0) == mib // 4000
    assert auto_chunk_size(10**6, 10**7, 1.0) == 1  # never zero rows
    assert ForwardKL().rows_per_chunk(16 * 512, 49152) == DEFAULT_CHUNK_BUDGET_MB * mib // (49152 * 4) == 106
    assert ForwardKL(chunk_size=9).rows_per_chunk(10**6, 49152) == 9  # an explicit chunk wins
    assert ForwardKL(chunk_budget_mb=None).rows_per_chunk(10**6, 49152) is None
    with pytest.raises(ValueError, match="chunk_budget_mb"):
        ForwardKL(chunk_budget_mb=0)
    with pytest.raises(ValueError, match="chunk_budget_mb"):
        auto_chunk_size(5, 5, -1.0)


def test_budget_is_neither_in_the_repr_nor_in_equality():
    """The reference scores' cache key is the divergence's repr: a budget (memory only) leaves it unchanged."""
    assert (
        repr(ForwardKL(chunk_budget_mb=1.0))
        == repr(ForwardKL())
        == "ForwardKL(chunk_size=None, kernel='torch')"
    )
    assert ForwardKL(chunk_budget_mb=1.0) == ForwardKL()


@pytest.mark.parametrize("stage", ["distill", "adaspec"])
def test_the_tiny_default_batches_stay_one_chunk(stage):
    """Training and validation batches of the embedded default (every position an answer row at most) fit the
    budget, so their loss is one projection, as before the budget existed."""
    with hydra_conf():
        cfg = compose("train", overrides=[f"stage={stage}"])
    divergence = instantiate(cfg.divergence)
    assert cfg.models.tokenizer.vocab_size == TINY_VOCAB
    settings = cfg[stage]
    for batch_size in (settings.batch_size, settings.eval_batch_size, 40):
        rows = batch_size * settings.max_length
        assert divergence.rows_per_chunk(rows, TINY_VOCAB) is None, (batch_size, rows)


@pytest.mark.parametrize(
    "divergence", [ForwardKL(chunk_budget_mb=0.001), JSD(beta=0.3, chunk_budget_mb=0.001)]
)
def test_automatic_chunks_equal_full_logits(divergence):
    """A budget of 1 KB (4 rows of 64 logits): values and gradients equal the full logits', and no tensor holds more
    than a chunk of logits."""
    target, draft = tiny_lm(2), tiny_lm(1, hidden=16)
    batch = make_batches(make_examples(6), 6, 1)[0]
    keep = answer_mask(batch["labels"])
    assert divergence.rows_per_chunk(int(keep.sum()), VOCAB) == 4
    with torch.no_grad():
        full_target = answer_logits(target, batch, keep, VOCAB)
    full = divergence.per_token(full_target, answer_logits(draft, batch, keep, VOCAB))
    full.sum().backward()
    full_grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad(set_to_none=True)
    with torch.no_grad():
        target_rows = answer_rows(target, batch, keep, VOCAB)
    draft_rows = answer_rows(draft, batch, keep, VOCAB)
    with LargestTensor(last_dim=VOCAB) as sizes:
        values = divergence.rows(target_rows, draft_rows)
        values.sum().backward()
    assert sizes.shape == (4, VOCAB)
    torch.testing.assert_close(values, full, rtol=1e-5, atol=1e-6)
    for name, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_within_budget_is_bit_identical_to_no_budget():
    target, draft = tiny_lm(2), tiny_lm(1, hidden=16)
    batch = make_batches(make_examples(6), 6, 1)[0]
    keep = answer_mask(batch["labels"])
    with torch.no_grad():
        t, d = answer_rows(target, batch, keep, VOCAB), answer_rows(draft, batch, keep, VOCAB)
        assert torch.equal(ForwardKL().rows(t, d), ForwardKL(chunk_budget_mb=None).rows(t, d))
        (chunked,) = rowwise([forward_kl], t, d, budget_mb=0.001)
        torch.testing.assert_close(chunked, ForwardKL(chunk_budget_mb=None).rows(t, d), rtol=1e-5, atol=1e-6)
