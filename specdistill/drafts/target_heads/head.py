"""The protocol of a draft head on the target's hidden states (`TargetStateHead`), what `TargetHeadProposer` drafts
with.

Such a head drafts one token per position, autoregressively. Position `t` reads two things: an input of width `H`,
either the target's states of sequence position `t` at `target_layers` (`fuse`) or, further down a draft
chain, its own `hidden` output of position `t - 1`; and the token `t + 1`. Its logits score token `t + 2`, over its
draft vocabulary, whose id `i` is the target's id `target_ids[i]`. Positions attend to the earlier ones through the
head's cache, which keeps one entry per position and is cropped from the end. EAGLE-1/2/3 heads and MTP modules
have this shape (`specdistill.drafts.eagle3.model.Eagle3Head` implements it).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class HeadCache(Protocol):
    """A head's state over the positions run so far (a KV cache), one entry per position."""

    def __len__(self) -> int:
        """Positions cached."""
        ...

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        ...


class HeadOutput(Protocol):
    """What one `TargetStateHead.step` computes for its `t` positions.

    Attributes:
        hidden: `(1, t, H)` the output a draft chain's next position reads as its input.
        normed: `(1, t, H)` the state `logits` are projected from (after the head's final norm): what an acceptance
            head reads.
        logits: `(1, t, D)` over the draft vocabulary (`D` = `len(target_ids)`).
    """

    hidden: torch.Tensor
    normed: torch.Tensor
    logits: torch.Tensor


@runtime_checkable
class TargetStateHead(Protocol):
    """A draft head on the target's hidden states (see the module docstring)."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Indices into the target's `output_hidden_states` whose states the head reads, in the order `fuse`
        takes them concatenated."""
        ...

    @property
    def hidden_size(self) -> int:
        """`H`: the width of `HeadOutput.hidden` and `HeadOutput.normed`."""
        ...

    @property
    def target_ids(self) -> torch.Tensor:
        """`(D,)` long: the target id of each draft-vocabulary id."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the head computes."""
        ...

    def new_cache(self) -> HeadCache:
        """An empty cache for a new sequence."""
        ...

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """`(1, t, sum of the target layers' widths)` the target's states at `target_layers`, concatenated in that
        order -> `(1, t, H)` inputs of `step`."""
        ...

    def step(
        self, tokens: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor, cache: HeadCache
    ) -> HeadOutput:
        """Run `t` new positions after the `len(cache)` cached ones, appending them to `cache`.

        Args:
            tokens: `(1, t)` the token each position reads (token `p + 1` at position `p`).
            inputs: `(1, t, H)` their inputs (`fuse`'s, or a chain's previous `HeadOutput.hidden`).
            positions: `(t,)` their positions (`len(cache)` onwards).
            cache: the head's cache (`new_cache`).
        """
        ...
