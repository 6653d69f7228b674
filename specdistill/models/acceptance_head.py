"""SpecDec++ acceptance head: predicts, from the draft's last hidden state, whether the target accepts a token.

METHODS.md section 4: D residual blocks `x + SiLU(W x)` (each block with its own weights; the public code reuses one
block D times by accident) followed by a linear layer to one logit. The head reads the hidden state whose *input*
token is the candidate being judged, so it predicts the acceptance of the token the draft has just read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """`x + SiLU(W x)`, width preserved.

    `W` starts at zero (as in Medusa, whose block the public SpecDec++ code copies) so that an untrained stack is the
    identity and the final linear layer sees the draft's hidden state unchanged.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class AcceptanceHead(nn.Module):
    """Residual MLP on the draft's last hidden state (after its final norm) giving one acceptance logit.

    Args:
        hidden_size: width of the draft's hidden state (`config.hidden_size`).
        num_blocks: number of residual blocks D (3 in SpecDec++); 0 gives a linear probe.
    """

    def __init__(self, hidden_size: int, num_blocks: int = 3) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(
                f"hidden_size={hidden_size} must be positive: use the draft's config.hidden_size."
            )
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0 (SpecDec++ uses 3).")
        self.hidden_size = int(hidden_size)
        self.num_blocks = int(num_blocks)
        self.blocks = nn.Sequential(*(ResidualBlock(self.hidden_size) for _ in range(self.num_blocks)))
        self.out = nn.Linear(self.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Acceptance logits.

        Args:
            hidden: `(..., H)` draft hidden states, any float dtype (cast to the head's dtype).

        Returns:
            `(...)` logits; `sigmoid(logit)` is the predicted probability that the target accepts the token.
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden states have width {hidden.shape[-1]} but the head expects {self.hidden_size}: "
                "the head was trained for a draft with a different hidden_size."
            )
        x = hidden.to(self.out.weight.dtype)
        return self.out(self.blocks(x)).squeeze(-1)

    @torch.no_grad()
    def acceptance_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(...)` predicted acceptance probabilities in fp32 for `(..., H)` hidden states."""
        return torch.sigmoid(self.forward(hidden).float())

    def config(self) -> dict[str, int]:
        return {"hidden_size": self.hidden_size, "num_blocks": self.num_blocks}

    def save(self, directory: str | Path) -> Path:
        """Write `head_config.json` and `model.safetensors` into `directory` (created if needed); return it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.config(), indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME))
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str = "cpu") -> AcceptanceHead:
        """Rebuild a head written by `save` (safetensors only; no pickle is ever read)."""
        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"No acceptance head at {directory}: {path.name} is missing. Point to the directory written by "
                    "AcceptanceHead.save (the acceptance_head stage's export)."
                )
        config = json.loads(config_path.read_text())
        head = cls(**config)
        head.load_state_dict(load_file(str(weights_path), device=str(device)), strict=True)
        return head.to(device)


def draft_hidden_states(
    draft: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The head's input: the draft's last hidden state after its final norm, `(B, T, H)`.

    Runs the draft's base model (`model.base_model`), which equals `output_hidden_states=True`'s last entry without
    computing the `(B, T, V)` logits. The state at position t is the one whose *input* token is `input_ids[:, t]`.
    """
    return draft.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
