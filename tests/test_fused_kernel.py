"""`divergence.kernel=liger`: the settings it accepts and refuses (CPU), and on a GPU with Liger Kernel installed the
same loss and gradients as the pure-PyTorch path, AdaSPEC selection included."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.losses import JSD, TVD, ForwardKL, ReverseKL
from specdistill.losses.fused import fused_divergence_sum, liger_beta
from specdistill.losses.rows import HiddenRows, OutputHead, answer_rows
from specdistill.modules import DistillModule
from specdistill.selection.reference import OnlineReference
from specdistill.selection.selectors import AdaSpecSelector
from tests.test_distill_module import VOCAB, attach_trainer, make_batches, make_examples, tiny_lm

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


def test_kernel_is_checked_and_changes_nothing_the_reference_compares():
    with pytest.raises(ValueError, match="kernel must be one of torch, liger"):
        ForwardKL(kernel="triton")
    assert [liger_beta(d) for d in (ForwardKL(), ReverseKL(), JSD(beta=0.3))] == [0.0, 1.0, 0.3]
    with pytest.raises(ValueError, match="not TVD"):
        liger_beta(TVD())
    # a reference scored with the torch path serves a run that trains with the kernel (same values)
    DistillModule(
        tiny_lm(1, hidden=16), tiny_lm(2), VOCAB, ForwardKL(kernel="liger", chunk_size=8),
        functools.partial(torch.optim.AdamW, lr=1e-3), selector=AdaSpecSelector(k=0.4),
        reference=OnlineReference(tiny_lm(3, hidden=16), ForwardKL(), VOCAB),
    )  # fmt: skip


def _rows(model, batch) -> HiddenRows:
    keep = batch["labels"][:, 1:] != -100
    return answer_rows(model, batch, keep, VOCAB)


def test_output_layers_the_kernel_cannot_fuse_are_refused_with_the_fix():
    batch = make_batches(make_examples(2), 2, 1)[0]
    target, draft = _rows(tiny_lm(2), batch), _rows(tiny_lm(1, hidden=16), batch)
    with pytest.raises(ValueError, match="CUDA only"):
        fused_divergence_sum(ForwardKL(kernel="liger"), target, draft, None)
    biased = dataclasses.replace(draft, head=OutputHead(_phi(), VOCAB))  # Phi's output layer has a bias
    with pytest.raises(ValueError, match="draft's has a bias.*kernel=torch"):
        fused_divergence_sum(ForwardKL(kernel="liger"), target, biased, None)
    capped = dataclasses.replace(target, head=OutputHead(_phi(), VOCAB))
    capped.head.softcap, capped.head.layer.bias = 30.0, None  # as Gemma-2's final_logit_softcapping
    with pytest.raises(ValueError, match="target's soft-caps its logits"):
        fused_divergence_sum(ForwardKL(kernel="liger"), capped, draft, None)


def _phi():
    config = AutoConfig.for_model("phi", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=64)  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def test_a_cached_target_cannot_use_the_kernel(tmp_path):
    from specdistill.data.target_cache import CachedTarget

    cache = CachedTarget.__new__(CachedTarget)  # only its type and vocabulary are read by the check
    cache.vocab_size = VOCAB
    with pytest.raises(ValueError, match="cannot train from cached target distributions"):
        DistillModule(tiny_lm(1, hidden=16), cache, VOCAB, ForwardKL(kernel="liger"),
                      functools.partial(torch.optim.AdamW, lr=1e-3))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_LIGER, reason="needs Liger Kernel (pip install 'specdistill[liger]')")
@pytest.mark.parametrize("divergence", [ForwardKL(), ReverseKL(), JSD(beta=0.5)], ids=["fkl", "rkl", "jsd"])
def test_the_kernel_gives_the_torch_paths_loss_and_gradients_on_cuda(divergence):
    batches = make_batches(make_examples(8), 4, 2)
    results = {}
    for kernel in ("torch", "liger"):
        torch.manual_seed(0)
        reference = OnlineReference(tiny_lm(3, hidden=16).cuda(), dataclasses.replace(divergence), VOCAB)
        module = DistillModule(
            tiny_lm(1, hidden=16), tiny_lm(2), VOCAB, dataclasses.replace(divergence, kernel=kernel),
            functools.partial(torch.optim.AdamW, lr=1e-3), selector=AdaSpecSelector(k=0.4), reference=reference,
        ).cuda()  # fmt: skip
        module.target.cuda()
        attach_trainer(module, accumulate=2)
        losses = []
        for batch in batches:
            loss = module.training_step({k: v.cuda() for k, v in batch.items()}, 0)
            loss.backward()
            losses.append(loss.detach())
        grads = {n: p.grad.detach().clone() for n, p in module.draft.named_parameters() if p.grad is not None}
        results[kernel] = torch.stack(losses), grads
    (loss_t, grad_t), (loss_l, grad_l) = results["torch"], results["liger"]
    torch.testing.assert_close(loss_l, loss_t, rtol=1e-4, atol=1e-6)
    assert grad_l.keys() == grad_t.keys()
    for name, grad in grad_t.items():
        torch.testing.assert_close(grad_l[name], grad, rtol=1e-3, atol=1e-6, msg=name)
