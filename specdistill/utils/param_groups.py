"""Optimizer parameter groups: weight decay on weights, none on biases and normalisation parameters.

The papers' authors trained with the Hugging Face `Trainer`, whose AdamW decays every parameter except biases and
the weights of normalisation layers (`Trainer.get_decay_parameter_names`). The same rule here, so that a preset's
`weight_decay` means what it meant in the papers.
"""

from __future__ import annotations

import re

from torch import nn

# Hugging Face Trainer's name patterns (matched on the lower-cased parameter name).
NO_DECAY_NAME_PATTERNS = tuple(
    re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def _is_norm_layer(module: nn.Module) -> bool:
    # nn.LayerNorm / nn.RMSNorm and the models' own norm classes (LlamaRMSNorm, Gemma2RMSNorm, ...).
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith("Norm")


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get no weight decay: biases and parameters of normalisation layers."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if _is_norm_layer(module) or any(p.search(full.lower()) for p in NO_DECAY_NAME_PATTERNS):
                names.add(full)
    return names


def weight_decay_groups(model: nn.Module) -> list[dict]:
    """The trainable parameters of `model` as optimizer groups: decayed, then undecayed (`weight_decay=0`).

    The first group (`name` "decay") takes the optimizer's own `weight_decay`; empty groups are left out. The names
    label Lightning's learning-rate log (`lr-AdamW/decay`).
    """
    skip = no_decay_parameter_names(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [p for name, p in trainable if name not in skip]
    no_decay = [p for name, p in trainable if name in skip]
    groups = [{"params": decay, "name": "decay"}] if decay else []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups
