"""SpecDec++ acceptance head: predicts, from the draft's last hidden state, whether the target accepts a token.

docs/METHODS.md section 4: D residual blocks `x + SiLU(W x)` (each block with its own weights; the public code reuses one
block D times by accident) followed by a linear layer to one logit.

Two inputs (`AcceptanceHead.input`):

- `"candidate"` (SpecDec++): the hidden state whose *input* token is the candidate being judged. The draft must read
  a candidate before it can be scored, so the public stopping rule always leaves the newest candidate unscored.
- `"proposer"`: the hidden state that *proposed* the candidate (the one whose next-token distribution q it was drawn
  from) plus `q(candidate)` (`draft_features`). Every candidate is scored as soon as it is drafted, at no extra draft
  pass. Trained on teacher-forced target responses, whose contexts are the ones decoding meets (accepted tokens
  follow the target's distribution), so no mixing is needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specdistill.errors import InputFileError
from specdistill.export.hf import umask_modes
from specdistill.models.draft_identity import draft_fingerprint
from specdistill.models.output_rows import OutputHead, final_hidden_states

CONFIG_NAME = "head_config.json"
HEAD_INPUTS = ("candidate", "proposer")
NUM_DRAFT_FEATURES = 1
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """`x + SiLU(W x)`, width preserved.

    `W` starts at zero (as in Medusa, whose block the public SpecDec++ code copies) so that an untrained stack is the
    identity and the final linear layer sees the draft's hidden state unchanged. This is our choice: the public
    SpecDec++ code has the zero init commented out (`specdec_pp/wrap_model.py`), so its blocks start from PyTorch's
    default `nn.Linear` init.
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
        input: `"candidate"` (SpecDec++) or `"proposer"` (see the module docstring); the blocks' width is
            `input_size`, the hidden size plus `NUM_DRAFT_FEATURES` for a proposer head.
    """

    def __init__(self, hidden_size: int, num_blocks: int = 3, input: str = "candidate") -> None:  # noqa: A002
        super().__init__()
        if hidden_size < 1:
            raise ValueError(
                f"hidden_size={hidden_size} must be positive: use the draft's config.hidden_size."
            )
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0 (SpecDec++ uses 3).")
        if input not in HEAD_INPUTS:
            raise ValueError(f"input={input!r} is not a head input; use one of {list(HEAD_INPUTS)}.")
        self.hidden_size = int(hidden_size)
        self.num_blocks = int(num_blocks)
        self.input = input
        self.input_size = self.hidden_size + (NUM_DRAFT_FEATURES if self.uses_proposer else 0)
        self.blocks = nn.Sequential(*(ResidualBlock(self.input_size) for _ in range(self.num_blocks)))
        self.out = nn.Linear(self.input_size, 1)
        self._cache_parameters()
        # load_state_dict(assign=True) swaps Parameter objects: refresh what `score` holds
        self.register_load_state_dict_post_hook(lambda module, _: module._cache_parameters())

    def _cache_parameters(self) -> None:
        """Keep direct references for `score` (module attribute lookups cost more than its arithmetic)."""
        self._block_params = [(block.linear.weight, block.linear.bias) for block in self.blocks]
        self._out_params = (self.out.weight, self.out.bias)

    def _apply(self, fn, recurse=True):  # .to(), .half(), .cuda() may replace Parameter objects
        module = super()._apply(fn, recurse)
        self._cache_parameters()
        return module

    @property
    def uses_proposer(self) -> bool:
        return self.input == "proposer"

    def head_input(
        self, hidden: torch.Tensor, probs: torch.Tensor | None = None, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The head's input vector `(..., input_size)` for `(..., H)` hidden states.

        A proposer head also needs the proposing distribution `probs (..., V)` (what the engine's policies see: warped,
        or the plain softmax in greedy mode) and the candidates `tokens (...)` drawn from it.
        """
        return build_head_input(self.input, hidden, probs, tokens)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Acceptance logits.

        Args:
            inputs: `(..., input_size)` head inputs (`head_input`; for a candidate head, the draft's hidden states),
                any float dtype (cast to the head's dtype).

        Returns:
            `(...)` logits; `sigmoid(logit)` is the predicted probability that the target accepts the token.
        """
        if inputs.shape[-1] != self.input_size:
            raise ValueError(
                f"head inputs have width {inputs.shape[-1]} but this {self.input} head expects {self.input_size}: "
                "the head was trained for a draft with a different hidden_size, or for the other head input."
            )
        x = inputs.to(self.out.weight.dtype)
        return self.out(self.blocks(x)).squeeze(-1)

    @torch.no_grad()
    def acceptance_probability(self, inputs: torch.Tensor) -> torch.Tensor:
        """`(...)` predicted acceptance probabilities in fp32 for `(..., input_size)` head inputs."""
        return torch.sigmoid(self.forward(inputs).float())

    @torch.inference_mode()
    def score(
        self, hidden: torch.Tensor, probs: torch.Tensor | None = None, token: int | None = None
    ) -> float:
        """Predicted acceptance of one candidate: `acceptance_probability(head_input(...))` as a float.

        The decoding-time path, called once per drafted candidate: the same arithmetic as `forward` written with
        functional ops on one vector, which costs about a third of the module call on a CPU.

        Args:
            hidden: `(H,)` draft hidden state.
            probs: `(V,)` proposing distribution (proposer heads).
            token: the candidate's id (proposer heads).
        """
        # Every tensor op here costs microseconds next to a draft step on small models: keep them few.
        x = hidden if hidden.dim() == 1 else hidden.reshape(-1)
        if self.uses_proposer:
            if probs is None or token is None:
                raise ValueError("a proposer head needs the draft's distribution and the candidate token.")
            x = torch.cat((x, probs[token : token + 1].to(x.dtype)))
        out_weight, out_bias = self._out_params
        if x.dtype != out_weight.dtype:
            x = x.to(out_weight.dtype)
        if x.shape[0] != self.input_size:
            raise ValueError(
                f"head inputs have width {x.shape[0]} but this {self.input} head expects {self.input_size}: "
                "the head was trained for a draft with a different hidden_size."
            )
        for weight, bias in self._block_params:
            x = x + F.silu(torch.addmv(bias, weight, x))
        logit = float(torch.addmv(out_bias, out_weight, x))
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))

    def config(self) -> dict[str, int | str]:
        """The constructor's arguments (what `load` rebuilds the head from)."""
        return {"hidden_size": self.hidden_size, "num_blocks": self.num_blocks, "input": self.input}

    def input_definition(self) -> dict[str, Any]:
        """What the head reads, in words and widths, for anyone using an export without this code."""
        position = (
            "the position whose input token is the candidate (the draft must read the candidate first)"
            if self.input == "candidate"
            else "the position that proposed the candidate (its next-token distribution q drew it)"
        )
        features = [
            "q(candidate): the draft's probability of the candidate, from the distribution it was drawn from"
        ]
        return {
            "hidden_state": "the draft's last hidden state after its final norm (base_model(...).last_hidden_state)",
            "position": position,
            "features": features if self.uses_proposer else [],
            "width": self.input_size,
            "order": "hidden state, then the features, concatenated",
        }

    def save(self, directory: str | Path, draft: Mapping[str, Any] | None = None) -> Path:
        """Write `head_config.json` and `model.safetensors` into `directory` (created if needed); return it.

        `head_config.json` holds the constructor's arguments, the input definition and `draft`: the draft the head
        was trained on (`specdistill.models.draft_identity.describe_draft`), checked again by `load`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {**self.config(), "inputs": self.input_definition(), "draft": dict(draft) if draft else None}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME))
        umask_modes(directory)
        return directory

    @staticmethod
    def read_config(directory: str | Path) -> dict[str, Any]:
        """`head_config.json` of a saved head: arguments, `inputs` and `draft`."""
        directory = Path(directory)
        for path in (directory / CONFIG_NAME, directory / WEIGHTS_NAME):
            if not path.is_file():
                raise InputFileError(
                    f"No acceptance head at {directory}: {path.name} is missing. Point to the directory written by "
                    "AcceptanceHead.save (the acceptance_head stage's export)."
                )
        try:
            return json.loads((directory / CONFIG_NAME).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise InputFileError(_unreadable(directory / CONFIG_NAME, error)) from error

    @classmethod
    def load(
        cls, directory: str | Path, device: torch.device | str = "cpu", draft: nn.Module | None = None
    ) -> AcceptanceHead:
        """Rebuild a head written by `save` (safetensors only; no pickle is ever read).

        With `draft`, refuse a head that was trained on another draft (its recorded fingerprint differs).
        """
        config = cls.read_config(directory)
        arguments = head_arguments(Path(directory) / CONFIG_NAME, config)
        if draft is not None:
            check_head_draft(directory, config.get("draft"), draft)
        head = cls(**arguments)
        weights = Path(directory) / WEIGHTS_NAME
        try:
            state = load_file(str(weights), device=str(device))
        except SafetensorError as error:
            raise InputFileError(_unreadable(weights, error)) from error
        head.load_state_dict(state, strict=True)
        return head.to(device)


def head_arguments(path: Path, config: Any) -> dict[str, Any]:
    """The constructor arguments `head_config.json` (`path`, parsed as `config`) records, each checked to be a plain
    value in range: the file is data, and a wrong value is one line naming it, not an error deep inside torch.

    Raises:
        InputFileError: `config` is not an object, or a value is missing, of another type or out of range.
    """
    if not isinstance(config, dict):
        raise InputFileError(f"{path} holds {type(config).__name__}, not a head config: re-export the head")
    checks = {
        "hidden_size": (lambda v: _is_int(v) and v >= 1, "a positive integer (the draft's hidden size)"),
        "num_blocks": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        "input": (lambda v: isinstance(v, str) and v in HEAD_INPUTS, f"one of {list(HEAD_INPUTS)}"),
    }
    for key, (ok, expected) in checks.items():
        if key not in config or not ok(config[key]):
            found = repr(config[key])[:80] if key in config else "nothing"
            raise InputFileError(
                f"{path}: {key} holds {found}, expected {expected}: re-export the head with stage=acceptance_head"
            )
    return {key: config[key] for key in checks}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unreadable(path: Path, error: Exception) -> str:
    """The message for a head file that exists but cannot be read (cut short while copying or writing)."""
    return (
        f"{path} is not a readable acceptance-head file ({error}); it was probably cut short while copying or "
        "writing. Copy the head folder again, or re-run the acceptance_head stage to write it anew."
    )


def check_head_draft(directory: str | Path, recorded: Mapping[str, Any] | None, draft: nn.Module) -> None:
    """Refuse to pair the head saved in `directory` with a draft other than the one it was trained on."""
    if not recorded or "fingerprint" not in recorded:
        raise ValueError(
            f"The acceptance head in {directory} records no draft (saved by an older specdistill, or without "
            "`draft=`), so it cannot be checked against the draft it is paired with: retrain it with "
            "stage=acceptance_head."
        )
    found = draft_fingerprint(draft)
    if found != recorded["fingerprint"]:
        source = recorded.get("source") or "(built from a config)"
        raise ValueError(
            f"The acceptance head in {directory} was trained on the draft {source} (fingerprint "
            f"{recorded['fingerprint'][:12]}), but it is paired with a draft whose weights differ (fingerprint "
            f"{found[:12]}). Pair each head with its own draft (evaluate.heads.<name> and evaluate.drafts.<name>), "
            "or train a head for this draft with stage=acceptance_head."
        )


def build_head_input(
    input: str,  # noqa: A002
    hidden: torch.Tensor,
    probs: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Head inputs for head input mode `input` (see `AcceptanceHead.head_input`)."""
    if input not in HEAD_INPUTS:
        raise ValueError(f"input={input!r} is not a head input; use one of {list(HEAD_INPUTS)}.")
    if input == "candidate":
        return hidden
    if probs is None or tokens is None:
        raise ValueError("a proposer head needs the draft's distribution and the candidate tokens.")
    return torch.cat([hidden.float(), draft_features(probs, tokens)], dim=-1)


def draft_features(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`(..., 1)` feature of the proposing distribution: `q(token)`, the draft's probability of its candidate.

    The hidden state already carries the draft's confidence (measured: adding the entropy or the top-2 margin moved
    AUROC by under 0.005); `q(token)` tells the head which token was drawn when decoding samples.

    Args:
        probs: `(..., V)` draft probabilities the candidate was drawn from.
        tokens: `(...)` candidate ids.
    """
    return probs.float().gather(-1, tokens.long().unsqueeze(-1))


def draft_logits(draft: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The draft's logits `(..., V')` for final-norm hidden states `(..., H)`, over every output row (`OutputHead`).

    Its LM head, then Gemma-2's soft cap if any; padded rows are kept (callers slice to the real vocabulary).
    """
    return OutputHead(draft)(hidden)


def draft_hidden_states(
    draft: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The head's input: the draft's last hidden state after its final norm, `(B, T, H)`.

    Runs the draft's base model (`model.base_model`), which equals `output_hidden_states=True`'s last entry without
    computing the `(B, T, V)` logits (`specdistill.models.output_rows.final_hidden_states`, the one body pass). The
    state at position t is the one whose *input* token is `input_ids[:, t]`.
    """
    return final_hidden_states(draft, {"input_ids": input_ids, "attention_mask": attention_mask})
