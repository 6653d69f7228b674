"""DFlash block drafter: a few Qwen3-style layers that draft a whole block from one forward pass.

The drafter of Chen et al. 2026 (DFlash, block diffusion for speculative decoding) as its authors' checkpoints and
vLLM's `qwen3_dflash` define it:

- context: the target's hidden states of the verified positions at `target_layer_ids`, concatenated and fused by
  `fc` (`n H_t -> H`, no bias), then `hidden_norm`; every draft layer projects the fused context with its own
  `k_proj` / `v_proj` (then `k_norm` and RoPE at the context's positions), so the context is keys and values only;
- block: `block_size` positions after the context, the first holding the newest token (verified, not yet run by
  the target), the others `mask_token_id`; their inputs are the target's input embeddings (frozen, not part of the
  drafter); queries, keys and values of the block come from the layer's input (`input_layernorm`), with per-head
  `q_norm` / `k_norm` as in Qwen3;
- attention: each block position sees the whole context and every position of its own block (bidirectional within
  the block); then the Llama residual MLP; a final `norm`, and the target's own output layer scores block position
  `j >= 1` as the token `j` places after the block's first;
- so one pass proposes `block_size - 1` tokens, whatever their number: drafting cost does not grow with the length.

Index convention of `target_layer_ids`: indices into the target's `output_hidden_states` (0: the embeddings, `i`:
the output of decoder layer `i - 1`), as our EAGLE-3 heads count; DFlash's own checkpoints count decoder layers
(`hidden_states[i + 1]`), so the export writes `i - 1` (`specdistill.drafts.dflash.export`).

Training (`DFlashDrafter.blocks`) runs many blocks of a sequence in one pass: each block, anchored at position `a`,
sees the context positions `< a` and its own positions; decoding (`DFlashCache`) keeps the context's keys and values
and runs one block after them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.drafts.eagle3.model import Eagle3MLP, RMSNorm, rope
from specdistill.models.output_rows import OutputHead

BLOCK_SIZES = (2, 4, 8, 16)  # 8 and 16 are the public recipe's; 2 and 4 for tiny tests and short answers


@dataclass(frozen=True)
class DFlashConfig:
    """The drafter's shape (what the export's `config.json` records under `specdistill_dflash`).

    Attributes:
        hidden_size: the drafter's width `H` (the target's: it reads the target's embeddings and output layer).
        target_hidden_size: the target's width `H_t`; `fc` maps `len(target_layer_ids) * H_t -> H`.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers: the layers' shape.
        vocab_size: the target's input embedding rows (`mask_token_id` is one of them).
        target_layer_ids: target `output_hidden_states` indices fused by `fc` (see the module docstring).
        block_size: positions per block (the first holds the newest verified token): `block_size - 1` candidates.
        mask_token_id: the token whose embedding fills the block's unknown positions.
        rms_norm_eps, rope_theta, max_position_embeddings, hidden_act: as in a Qwen3 config.
        initializer_range: std of the normal initialisation of the linear layers.
    """

    # what an acceptance head records of the draft it reads (`specdistill.models.draft_identity.describe_draft`)
    model_type: ClassVar[str] = "dflash"

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size} must be one of {BLOCK_SIZES}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is not a row of the target's {self.vocab_size} embeddings"
            )
        if not self.target_layer_ids or self.num_hidden_layers < 1:
            raise ValueError("a DFlash drafter fuses at least one target layer and has at least one layer")

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["target_layer_ids"] = list(self.target_layer_ids)
        return values


def default_target_layer_ids(num_layers: int, count: int) -> tuple[int, ...]:
    """`count` states spread evenly from the second decoder layer's input to the last's (`output_hidden_states`
    indices in `[1, L - 1]`), as DFlash's recipe spreads its five over the target; fewer when the target is shallow."""
    if num_layers < 2:
        raise ValueError(f"a DFlash drafter reads states between decoder layers: the target has {num_layers}")
    low, high = 1, num_layers - 1
    if count == 1:
        return (high,)
    ids = sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})
    return tuple(ids)


def check_target_layer_ids(ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Strictly increasing states entering decoder layers 1 .. L - 1 (`1 <= id <= L - 1`): vLLM collects the
    states of decoder layers' outputs in layer order, and cannot give the embeddings (DFlash id -1)."""
    ids = tuple(int(i) for i in ids)
    if not ids or list(ids) != sorted(set(ids)) or not all(1 <= i <= num_layers - 1 for i in ids):
        raise ValueError(
            f"draft.target_layer_ids={list(ids)} is not valid for this target of {num_layers} layers: DFlash fuses "
            f"strictly increasing states in [1, {num_layers - 1}] (output_hidden_states indices; e.g. "
            f"{list(default_target_layer_ids(num_layers, min(3, num_layers - 1)))})"
        )
    return ids


# ---------------------------------------------------------------------------------------------- layers


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head `q_norm` / `k_norm`) whose keys and values are the context's and the block's."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, T, H)` -> rotated, normed keys and values `(B, kv_heads, T, d)`."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The block `x` `(B, Q, H)` at `positions` attending to `context` keys and values `(B, kv_heads, C, d)` and
        to itself; `mask` `(B, Q, C + Q)` bool (True: visible), None: all visible."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = rope(q, positions, self.theta)
        k_block, v_block = self.keys_values(x, positions)
        k = torch.cat([context[0], k_block], dim=2)
        v = torch.cat([context[1], v_block], dim=2)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        return self.o_proj(attended.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    """One decoder layer (weights `layers.<i>.*`): pre-norm attention over context and block, residual MLP."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.mlp = Eagle3MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashCache:
    """The context's keys and values for decoding, one `(1, kv_heads, C, d)` pair per layer, cropped from the end."""

    def __init__(self, layers: int) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers

    def __len__(self) -> int:
        first = self.layers[0]
        return 0 if first is None else first[0].shape[2]

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        old = self.layers[layer]
        if old is not None:
            keys, values = torch.cat([old[0], keys], dim=2), torch.cat([old[1], values], dim=2)
        self.layers[layer] = (keys, values)

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop a DFlash cache of {len(self)} positions to {length}")
        self.layers = [
            None if kv is None else (kv[0][:, :, :length], kv[1][:, :, :length]) for kv in self.layers
        ]


# ---------------------------------------------------------------------------------------------- the drafter


class TargetOutputHead(OutputHead):
    """The target's output layer on the drafter's states: the states are cast to the layer's dtype first, as `embed`
    casts the target's embeddings to the drafter's, so an fp32 drafter (as `DFlash.build` makes it) drafts and scores
    on a bfloat16 target outside autocast (decoding, teacher-forced states)."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = getattr(self.layer, "weight", None)
        if weight is not None and weight.dtype != hidden.dtype and weight.dtype.is_floating_point:
            hidden = hidden.to(weight.dtype)
        return super().__call__(hidden)


class DFlashDrafter(nn.Module):
    """The DFlash drafter (weights `fc`, `hidden_norm`, `layers.*`, `norm`; the target's input embeddings and output
    layer are attached, frozen, never part of its state)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        fused = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(fused, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._target: tuple[nn.Module, ...] = ()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    # -- the target's parts

    def attach_target(self, target: nn.Module) -> None:
        """Read token embeddings and score blocks through `target`'s own layers (frozen, not registered)."""
        rows = target.get_input_embeddings().weight
        if tuple(rows.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"the target's input embeddings have shape {tuple(rows.shape)}, the DFlash drafter needs "
                f"({self.config.vocab_size}, {self.config.hidden_size}): attach the target it was built for"
            )
        self._target = (target,)

    @property
    def target(self) -> nn.Module:
        if not self._target:
            raise ValueError(
                "this DFlash drafter has no target attached: it drafts on the target's embeddings and output "
                "layer, attach them with drafter.attach_target(target)"
            )
        return self._target[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`(B, T)` ids -> `(B, T, H)` the target's input embeddings (no gradient)."""
        with torch.no_grad():
            return self.target.get_input_embeddings()(ids).to(self.fc.weight.dtype)

    def output_head(self, vocab_size: int | None) -> OutputHead:
        """The target's output layer, `(..., H) -> (..., vocab_size)` (frozen), on the drafter's states cast to
        the layer's dtype (`TargetOutputHead`)."""
        return TargetOutputHead(self.target, vocab_size)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- forward passes

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """`(B, C, n H_t)` concatenated target states -> `(B, C, H)` the fused context every layer projects."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def run(
        self,
        block: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`(B, Q, H)` block inputs at `positions` -> `(B, Q, H)` states after the final norm, each layer attending
        to its `contexts` entry (keys, values) and the block under `mask` (`DFlashAttention.forward`)."""
        x = block
        for layer, context in zip(self.layers, contexts, strict=True):
            x = layer(x, positions, context, mask)
        return self.norm(x)

    def context_keys_values(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the fused `context` `(B, C, H)` at `positions`."""
        return [layer.self_attn.keys_values(context, positions) for layer in self.layers]

    def new_cache(self) -> DFlashCache:
        return DFlashCache(len(self.layers))

    def extend_cache(self, cache: DFlashCache, features: torch.Tensor) -> None:
        """Append the context positions `len(cache) ..` whose target states are `features` `(1, c, n H_t)`."""
        start = len(cache)
        positions = torch.arange(start, start + features.shape[1], device=self.device)
        for i, (k, v) in enumerate(self.context_keys_values(self.context(features), positions)):
            cache.append(i, k, v)

    def draft(self, cache: DFlashCache, newest: torch.Tensor) -> torch.Tensor:
        """Decoding: one block after the `len(cache)` cached context positions, its first position the token
        `newest` `(1,)`: `(1, block_size, H)` states after the final norm (position `j >= 1` scores the token `j`
        places after `newest`)."""
        size, start = self.config.block_size, len(cache)
        ids = newest.new_full((1, size), self.config.mask_token_id)
        ids[0, 0] = newest
        positions = torch.arange(start, start + size, device=self.device)
        contexts = [kv for kv in cache.layers if kv is not None]
        if len(contexts) != len(self.layers):
            raise ValueError("a DFlash block drafts after the target's states: extend the cache first")
        return self.run(self.embed(ids), positions, contexts, None)

    def blocks(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        anchors: torch.Tensor,
        contexts: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Training: the blocks anchored at `anchors` `(B, n)` (positions, -1: none) of right-padded sequences,
        all in one pass: `(B, n, block_size, H)` states after the final norm.

        Block `(b, i)` anchored at `a` holds token `a` then masks at positions `a .. a + block_size - 1`, and sees
        the fused context of positions `< a` of its own sequence (where `attention_mask` is 1) and its own block.
        `contexts`: every layer's context keys and values of `features` (`context_keys_values` at positions
        `0 .. T - 1`), for a caller that runs several passes over the same sequences; None: computed here.
        """
        b, t = input_ids.shape
        size, n = self.config.block_size, anchors.shape[1]
        device = input_ids.device
        offsets = torch.arange(size, device=device)
        starts = anchors.clamp_min(0)
        ids = torch.full((b, n, size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = input_ids.gather(1, starts)
        positions = (starts[..., None] + offsets).reshape(b, n * size)
        context_positions = torch.arange(t, device=device)
        # (B, n*size, T): context position c < anchor, and a real token
        sees_context = (
            context_positions < anchors.repeat_interleave(size, dim=1)[..., None]
        ) & attention_mask[:, None, :].bool()
        block_of = torch.arange(n, device=device).repeat_interleave(size)
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=-1)
        if contexts is None:
            contexts = self.context_keys_values(self.context(features), context_positions)
        block = self.embed(ids.reshape(b, n * size))
        return self.run(block, positions, contexts, mask).view(b, n, size, -1)


def dflash_config_for(
    target_config: Any,
    vocab_size: int,
    target_layer_ids: tuple[int, ...],
    block_size: int,
    mask_token_id: int,
    num_hidden_layers: int,
) -> DFlashConfig:
    """The drafter's shape for a target: its width, heads, MLP width, RoPE base and norm epsilon where it has them,
    Qwen3's defaults where it does not.

    Args:
        target_config: the target's (text) config.
        vocab_size: the target's input embedding rows.
        target_layer_ids: fused target states (`output_hidden_states` indices, checked).
        block_size, mask_token_id, num_hidden_layers: the drafter's settings.
    """
    config = target_config.get_text_config(decoder=True)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    theta = rope_parameters.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-6
    return DFlashConfig(
        hidden_size=hidden,
        target_hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        target_layer_ids=check_target_layer_ids(target_layer_ids, int(config.num_hidden_layers)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        rms_norm_eps=float(eps),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048) or 2048),
    )
