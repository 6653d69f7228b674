"""EAGLE-3 draft head: one Llama-style decoder layer on the frozen target's fused hidden states.

The head of Li et al. 2025 (EAGLE-3) as SafeAILab/EAGLE, SGLang and vLLM load it (`LlamaForCausalLMEagle3`):

- input of EAGLE position `t`: `fc([g_low; g_mid; g_high])` `(3 H_t -> H)` of the target's hidden states of
  sequence position `t` at the three `aux_layer_ids` (or, further down a draft chain, the head's own pre-norm output
  of position `t - 1`), and the embedding of token `t + 1` (the target's input embeddings, frozen, not part of the
  head);
- `midlayer`: `residual = hidden` (`hidden_norm(hidden)` when `norm_before_residual`), the attention and MLP input is
  `[input_layernorm(embed); hidden_norm(hidden)]` (2H, so q/k/v take 2H inputs), then the usual Llama residual MLP;
- `norm`, then `lm_head` over the draft vocabulary (`draft_vocab_size` tokens); the logits of EAGLE position `t`
  score sequence position `t + 2`. Draft id `i` is target id `i + d2t[i]`; `t2d` marks the target ids in it.

Index convention of `aux_layer_ids`: indices into the target's `output_hidden_states` tuple (0: the embeddings, `i`:
the output of decoder layer `i - 1`, which is the state entering decoder layer `i`). This is exactly vLLM's and
SGLang's `eagle_aux_hidden_state_layer_ids` (they record `hidden_states + residual` before layer `i` runs), so the
ids are exported unchanged; the default `(2, L // 2, L - 3)` is theirs.

Attention (`rope_theta`, no RoPE scaling): decoding (`forward` with an `Eagle3Cache`) attends causally over every
cached position; training-time test (`unroll`) attends, at step `j` and index `p`, to step 0's positions `0..p` and
to steps `1..j` at index `p` (the draft chain a decoder builds from anchor `p`), with RoPE positions `p + j` for the
query and `p + i` for step `i`'s key: the positions a decoder gives the same chain, so the unroll and decoding
compute the same function (tests/test_eagle3.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape (what the export's `config.json` records).

    Attributes:
        hidden_size: the head's width `H` (the target's, as in every public EAGLE-3 head).
        target_hidden_size: the target's width `H_t`; `fc` maps `3 H_t -> H`.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: the decoder layer's shape.
        vocab_size: the target's vocabulary (its embedding rows; `t2d` has this many entries).
        draft_vocab_size: rows of `lm_head`, at most `vocab_size`.
        aux_layer_ids: target `output_hidden_states` indices fused by `fc` (see the module docstring).
        rms_norm_eps, rope_theta, max_position_embeddings, hidden_act: as in a Llama config.
        norm_before_residual: the residual is `hidden_norm(hidden)` instead of `hidden` (SpecForge's option).
        initializer_range: std of the normal initialisation of the linear layers.
    """

    # what an acceptance head records of the draft it reads (`specdistill.models.draft_identity.describe_draft`)
    model_type: ClassVar[str] = "eagle3"

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must lie in [1, vocab_size={self.vocab_size}]"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got aux_layer_ids={self.aux_layer_ids}")

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["aux_layer_ids"] = list(self.aux_layer_ids)
        return values


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """`(2, L // 2, L - 3)`, vLLM's and SGLang's default for a target of `L` decoder layers."""
    return 2, num_layers // 2, num_layers - 3


def check_aux_layer_ids(aux_layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Three strictly increasing ids of states entering decoder layers, `0 <= id < L`.

    vLLM cannot take the last state (after the final norm), and it collects the states in layer order, once per
    layer: repeated or unordered ids would fuse other features there than here.
    """
    ids = tuple(aux_layer_ids)
    in_range = all(0 <= i < num_layers for i in ids)
    if len(ids) != 3 or not in_range or list(ids) != sorted(set(ids)):
        raise ValueError(
            f"draft.aux_layer_ids={list(ids)} is not valid for this target of {num_layers} layers: EAGLE-3 fuses "
            f"three states entering decoder layers, three strictly increasing ids in [0, {num_layers - 1}] (the "
            f"default {list(default_aux_layer_ids(num_layers))} is valid from 7 layers on; set e.g. "
            "draft.aux_layer_ids=[1,2,3])"
        )
    return ids


# ---------------------------------------------------------------------------------------------- draft vocabulary


@dataclass(frozen=True)
class DraftVocabulary:
    """The draft vocabulary: `ids` `(N,)` ascending target ids, `d2t` `(N,)` = `ids - arange(N)`, `t2d` `(V,)` bool."""

    ids: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor


def draft_vocabulary(counts: torch.Tensor, size: int) -> DraftVocabulary:
    """The `size` most frequent tokens of `counts` (`(V,)` occurrences per target id), ties broken by smaller id.

    Tokens that never occur fill the vocabulary too (by id), so it always has `size` entries, as `lm_head` does.
    """
    counts = torch.as_tensor(counts).flatten()
    vocab = counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab:
        raise ValueError(
            f"the draft vocabulary size must be an int in [1, {vocab}] (the target's), got {size!r}"
        )
    # a stable sort by descending count keeps equal counts in ascending id order
    order = torch.sort(counts.to(torch.float64), descending=True, stable=True).indices
    ids = torch.sort(order[:size]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return DraftVocabulary(ids, ids - torch.arange(size), t2d)


def answer_token_counts(labels: list[list[int]], vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """`(V,)` int64 occurrences of each token among the answer labels (`labels[i] != ignore_index`)."""
    flat = torch.tensor([t for row in labels for t in row if t != ignore_index], dtype=torch.long)
    if flat.numel() and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"answer labels hold ids outside [0, {vocab_size}): the tokenizer does not match")
    return torch.bincount(flat, minlength=vocab_size)


# ---------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in fp32, weight applied in the input dtype)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of `x` `(B, heads, T, d)` at `positions` `(B, T)` (or `(T,)`)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    if emb.dim() == 2:
        emb = emb[None]
    cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read the 2H concatenation `[embed; hidden]`."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(B, T, 2H)` -> rotated q `(B, heads, T, d)`, rotated k and v `(B, kv_heads, T, d)`."""
        return (self.query(x, positions), *self.keys_values(x, positions))

    def query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`(B, T, 2H)` -> rotated q `(B, heads, T, d)`."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        return rope(q, positions, self.theta)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, T, 2H)` -> rotated k and v `(B, kv_heads, T, d)`."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, positions, self.theta), v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Repeat `(B, kv_heads, T, d)` keys or values to `(B, heads, T, d)` (grouped-query attention)."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """`(B, heads, T, d)` -> `(B, T, H)`."""
        b, _, t, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The midlayer (weights `midlayer.*`): norms, the 2H attention input, the residual MLP."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(2H input (B, T, 2H), residual (B, T, H))` of embeddings and hidden states, both `(B, T, H)`."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual MLP after the attention: the layer's pre-norm output `(B, T, H)`."""
        hidden = residual + attention_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ---------------------------------------------------------------------------------------------- cache


class Eagle3Cache:
    """The head's KV cache for decoding: keys and values `(1, heads, L, d)` of every EAGLE position so far, in
    chain order, cropped from the end (`crop`)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `(1, heads, t, d)` keys and values; returns the whole cache's."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop an EAGLE-3 cache of {len(self)} positions to {length}")
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]


# ---------------------------------------------------------------------------------------------- the head


class Eagle3Output:
    """`hidden` `(B, T, H)`: the pre-norm layer output (fed back down a draft chain); `normed` `(B, T, H)`: after
    the final norm (what `lm_head` reads and an acceptance head scores); `logits` `(B, T, draft_vocab_size)`,
    projected on first use (training projects only the rows it scores)."""

    def __init__(self, hidden: torch.Tensor, normed: torch.Tensor, lm_head: nn.Module) -> None:
        self.hidden, self.normed, self._lm_head = hidden, normed, lm_head

    @functools.cached_property
    def logits(self) -> torch.Tensor:
        return self._lm_head(self.normed)


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (weights `fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`, `t2d`; no embeddings).

    The target's input embeddings are attached with `attach_embeddings` and kept out of the head's parameters and
    state dict (frozen, shared with the target): `embed(ids)` looks tokens up through them.

    Args:
        config: the head's shape.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        ids = torch.arange(config.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros_like(ids))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self._embeddings: tuple[nn.Module, ...] = ()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    # -- the draft vocabulary

    @torch.no_grad()
    def set_vocabulary(self, vocabulary: DraftVocabulary) -> None:
        """Use `vocabulary` (`draft_vocabulary`) as the draft vocabulary (its size must be `draft_vocab_size`)."""
        if vocabulary.d2t.shape != self.d2t.shape or vocabulary.t2d.shape != self.t2d.shape:
            raise ValueError(
                f"a draft vocabulary of {vocabulary.d2t.numel()} of {vocabulary.t2d.numel()} tokens does not fit "
                f"this head ({self.config.draft_vocab_size} of {self.config.vocab_size})"
            )
        self.d2t.copy_(vocabulary.d2t)
        self.t2d.copy_(vocabulary.t2d)

    @property
    def target_ids(self) -> torch.Tensor:
        """`(draft_vocab_size,)` the target id of each draft id, `i + d2t[i]`."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # -- embeddings

    def attach_embeddings(self, embeddings: nn.Module) -> None:
        """Look tokens up through `embeddings` (the target's `get_input_embeddings()`, frozen, not registered)."""
        rows = getattr(embeddings, "weight", None)
        if rows is not None and tuple(rows.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"the attached embeddings have shape {tuple(rows.shape)}, the head needs "
                f"({self.config.vocab_size}, {self.config.hidden_size}): attach the target's own input embeddings"
            )
        self._embeddings = (embeddings,)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`(B, T)` ids -> `(B, T, H)` target embeddings (no gradient: they are the frozen target's)."""
        if not self._embeddings:
            raise ValueError(
                "this EAGLE-3 head has no embeddings: it uses the target's, attach them with "
                "head.attach_embeddings(target.get_input_embeddings())"
            )
        with torch.no_grad():
            return self._embeddings[0](ids).to(self.fc.weight.dtype)

    # -- the protocol of a head on the target's states (`specdistill.drafts.target_heads.head.TargetStateHead`)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target states the head fuses, its `aux_layer_ids`."""
        return self.config.aux_layer_ids

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self) -> Eagle3Cache:
        return Eagle3Cache()

    def step(
        self, tokens: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor, cache: Eagle3Cache
    ) -> Eagle3Output:
        """Decoding: `forward` on the embeddings of `tokens` (`(1, t)`); the other arguments are `forward`'s."""
        return self(self.embed(tokens), inputs, positions, cache)

    # -- forward passes

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """`(B, T, 3 H_t)` concatenated target states -> `(B, T, H)` head inputs."""
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> Eagle3Output:
        return Eagle3Output(hidden, self.norm(hidden), self.lm_head)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: Eagle3Cache
    ) -> Eagle3Output:
        """Decoding: `t` new EAGLE positions after the `len(cache)` cached ones, causal over all of them.

        Args:
            embeds: `(1, t, H)` embeddings of the tokens the positions read (`embed`).
            hidden: `(1, t, H)` head inputs (`fuse`d target states, or the previous position's `hidden`).
            positions: `(t,)` RoPE positions.
            cache: the head's cache; the new positions are appended to it.
        """
        attn = self.midlayer.self_attn
        x, residual = self.midlayer.attention_input(embeds, hidden)
        q, k, v = attn.project(x, positions)
        past = len(cache)
        keys, values = cache.append(k, v)
        t = q.shape[-2]
        allowed = (
            torch.arange(past + t, device=q.device)[None] <= past + torch.arange(t, device=q.device)[:, None]
        )
        attended = F.scaled_dot_product_attention(
            q, attn.expand(keys), attn.expand(values), attn_mask=allowed
        )
        return self.logits(self.midlayer.finish(attn.output(attended), residual))

    def unroll(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        steps: int,
        start: int = 0,
        segment_ids: torch.Tensor | None = None,
    ) -> list[Eagle3Output]:
        """Training-time test: the head run on its own outputs for `steps` steps over whole sequences.

        Step `j` at index `p` is EAGLE position `p + j` of the chain anchored at `p`: it reads token `p + 1 + j`
        and (step 0) the fused target states of position `p` or (step `j > 0`) step `j - 1`'s output at index `p`,
        and its logits score sequence position `p + j + 2` (the target's row `p + j + 1`).

        Args:
            features: `(B, T, 3 H_t)` the target's states at `aux_layer_ids`, concatenated.
            input_ids: `(B, T)` tokens (right-padded).
            attention_mask: `(B, T)` 1 on real tokens.
            steps: how many steps (>= 1).
            start: the first anchor computed: every position is still attended to (step 0's keys and values over
                the whole sequence), but queries, the MLP and the outputs cover anchors `start..T-1` only (a
                training batch whose answers begin late skips the prompt's anchors, which no loss row reads).
            segment_ids: `(B, T)` for packed rows (`specdistill.data.packing`): a position attends only to its own
                example's (RoPE scores depend on relative positions only, so row indices serve as positions). Step
                `j`'s rows at anchors within `j + 1` tokens of their example's end read the next example's tokens:
                the caller leaves them out, as it does rows past the end.

        Returns:
            One `Eagle3Output` `(B, T - start, .)` per step, index `i` being anchor `start + i`; rows whose token
            index `p + 1 + j` lies past the end read a pad embedding and must be masked by the caller.
        """
        attn = self.midlayer.self_attn
        b, t = input_ids.shape
        if not 0 <= start < t:
            raise ValueError(f"unroll start {start} must lie in [0, {t}) for sequences of {t} tokens")
        embeds = self.embed(input_ids)
        index = torch.arange(t, device=input_ids.device)
        anchors = index[start:]
        # step 0's keys: causal over real tokens, and always the query's own position, so that no row (a pad
        # query of a left-padded row) has nothing to attend to and turns NaN, which its gradient would spread
        causal = (index[None, :] <= anchors[:, None])[None, None] & (
            attention_mask.bool()[:, None, None, :] | (index[None, :] == anchors[:, None])[None, None]
        )
        if segment_ids is not None:  # packed rows: never across examples
            causal = causal & (segment_ids[:, start:, None] == segment_ids[:, None, :])[:, None]
        scale = 1.0 / math.sqrt(attn.head_dim)
        hidden = self.fuse(features)
        outputs: list[Eagle3Output] = []
        chain_keys: list[torch.Tensor] = []
        chain_values: list[torch.Tensor] = []
        for step in range(steps):
            shifted = torch.zeros_like(embeds)
            shifted[:, : t - 1 - step] = embeds[:, 1 + step :]
            if step == 0:
                x, residual = self.midlayer.attention_input(shifted, hidden)
                k, v = attn.keys_values(x, index)
                context_keys, context_values = attn.expand(k), attn.expand(v)
                x, residual = x[:, start:], residual[:, start:]
                q = attn.query(x, anchors)
            else:
                x, residual = self.midlayer.attention_input(shifted[:, start:], hidden)
                q, k, v = attn.project(x, anchors + step)
                chain_keys.append(attn.expand(k))
                chain_values.append(attn.expand(v))
            scores = (q @ context_keys.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in chain_keys]
            probs = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1).to(q.dtype)
            attended = probs[..., :t] @ context_values
            for i, value in enumerate(chain_values):
                attended = attended + probs[..., t + i : t + i + 1] * value
            out = self.logits(self.midlayer.finish(attn.output(attended), residual))
            outputs.append(out)
            hidden = out.hidden
        return outputs


def eagle3_config_for(
    target_config: Any, vocab_size: int, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None
) -> Eagle3Config:
    """The head's shape for a target (any architecture transformers returns hidden states of): its width, heads,
    MLP width, RoPE base and norm epsilon where it has them, Llama's defaults where it does not.

    Args:
        target_config: the target's (text) config.
        vocab_size: the target's embedding rows.
        draft_vocab_size: the draft vocabulary's size (at most `vocab_size`).
        aux_layer_ids: fused target states (`output_hidden_states` indices); None for `default_aux_layer_ids`.
    """
    config = target_config.get_text_config(decoder=True)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    ids = default_aux_layer_ids(layers) if aux_layer_ids is None else tuple(aux_layer_ids)
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    theta = rope_parameters.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-6
    return Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=hidden // heads,
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=check_aux_layer_ids(ids, layers),
        rms_norm_eps=float(eps),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048) or 2048),
    )
