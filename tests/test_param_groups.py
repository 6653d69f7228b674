"""Weight decay skips biases and normalisation parameters, as the Hugging Face Trainer the papers used does."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.modules.sft import SFTModule
from specdistill.utils.param_groups import no_decay_parameter_names, weight_decay_groups

CONFIGS = {
    "gpt_neox": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
    "llama": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
}


def tiny_model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=40, **CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_biases_and_norm_weights_get_no_decay(model_type):
    model = tiny_model(model_type)
    skip = no_decay_parameter_names(model)
    for name, _ in model.named_parameters():
        expected = name.endswith(".bias") or "norm" in name.lower()
        assert (name in skip) == expected, name
    assert any("norm" in n for n in skip)  # every architecture has normalisation weights


def test_frozen_parameters_are_left_out():
    model = tiny_model("gpt_neox")
    model.gpt_neox.embed_in.requires_grad_(False)
    grouped = {id(p) for group in weight_decay_groups(model) for p in group["params"]}
    assert id(model.gpt_neox.embed_in.weight) not in grouped
    assert len(grouped) == sum(p.requires_grad for p in model.parameters())


def test_one_adamw_step_decays_weights_but_not_biases_or_norms():
    """With zero gradients AdamW only decays: weights shrink by lr * wd, biases and norm weights stay put."""
    model = tiny_model("gpt_neox")
    for p in model.parameters():  # non-zero norm weights and biases, so that decay would show
        torch.nn.init.normal_(p, mean=1.0, std=0.1)
    module = SFTModule(model, optimizer=functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.5))
    optimizer = module.configure_optimizers()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    skip = no_decay_parameter_names(model)
    for name, p in model.named_parameters():
        expected = before[name] if name in skip else before[name] * (1 - 0.1 * 0.5)
        torch.testing.assert_close(p.detach(), expected, msg=name)
