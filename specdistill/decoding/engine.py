"""Lossless speculative decoding (batch size 1) and the autoregressive baseline it is measured against.

One round: the proposer (`specdistill/decoding/proposers/`; a plain draft LM by default) proposes candidates
d_1..d_k in blocks (one token per block for an autoregressive draft or a block drafter, whose candidates all come
from one pass, a copied span for prompt lookup), each with the distribution q_i it was drawn from; the target scores
`[pending tokens, d_1..d_k]` in one forward pass, candidates are tested left to right and the round emits the
accepted prefix plus one target token (the residual sample at the first rejection, or the bonus token when all are
accepted). Sampling mode accepts d_i with probability min(1, p(d_i) / q(d_i)) and
resamples from norm(max(0, p - q)); greedy mode accepts iff d_i is the target's argmax. Both are exact: the output
has the target's (warped) distribution, token for token equal to the target's own greedy output in greedy mode.

Draft length: the engine alone enforces the bounds. It asks the `DraftPolicy` "stop?" after every candidate and ends
drafting after candidate `index` when `index >= policy.min_draft_length` and the policy says stop, when `index`
reaches its cap `min(max_draft_length, remaining budget - 1)` (a round emits at most k + 1 tokens), or when the
candidate is EOS.

Cache invariant: at the start of a round the target's KV cache and the proposer's state cover a prefix of the
sequence that is at most `n - 1` tokens long (`n` = prompt + generated), so the tokens they have not seen are fed
next; after verification both are cropped to the accepted prefix (`Proposer.rollback`), never recomputed, and never
below the previous crop. The first round therefore prefills the prompt. The caches come from
`specdistill.models.cache.new_cache` (`cache_implementation`: dynamic or static), which can roll back sliding-window
and hybrid layouts too (Mistral, Qwen2, Gemma-2).

Drafting is the proposer's (`specdistill/decoding/proposers/base.py` states the contract); everything else is the
engine's. A proposer that sets `target_hidden_layers` gets the target's hidden states of the verified positions
from the verification pass itself (run with `output_hidden_states=True` only then). For one that drafts from those
states alone (`drafts_after_prefill`: an EAGLE head) the first round sends no candidates: the target prefills the
prompt and emits its next token, since before that pass there are no states to draft from.

Oracle policies (`needs_oracle`) get `DraftStep.will_accept` from a target probe that runs on the real target
cache and is cropped away before the real verification; its time and forward passes are excluded from the
statistics. The probe uses the acceptance uniforms that the real verification will use, so the two agree (up to
floating point differences between incremental and batched forwards, which can only cost a rejection: the
output stays lossless because the real verification alone decides what is emitted). See `Oracle`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from specdistill.decoding.forward import forward_keep_last, model_device
from specdistill.decoding.policies import DraftPolicy, DraftStep
from specdistill.decoding.proposers import (
    BlockProposer,
    BlockRequest,
    ChainProposer,
    DraftBlock,
    Drafter,
    DraftLMProposer,
    Proposer,
    TargetHidden,
)
from specdistill.decoding.proposers.base import check_vocab_size
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.models.cache import CACHE_IMPLEMENTATIONS, crop_cache, new_cache
from specdistill.models.loading import is_placed_across_devices
from specdistill.models.vocab import check_model_covers_vocab


@dataclass
class DecodeState:
    """Where a generation ended, for tests and debugging (`generate(..., keep_state=True)`).

    Attributes:
        tokens: `(1, n)` prompt followed by the generated tokens.
        target_cache / draft_cache: the target's KV cache and the proposer's (`Proposer.cache`, None for a
            proposer without one), covering `target_length` / `draft_length` leading tokens.
    """

    tokens: torch.Tensor
    target_cache: Cache | None
    target_length: int
    draft_cache: Cache | None = None
    draft_length: int = 0


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded, EOS included when emitted) and the run's statistics."""

    tokens: list[int]
    stats: DecodingStats
    state: DecodeState | None = None


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to resample after the target rejects a candidate drawn from q.

    Args:
        p: `(V,)` warped target probabilities.  q: `(V,)` warped draft probabilities.

    Returns:
        `(V,)` probabilities. A rejection implies p(v) > q(v) somewhere, so the mass is positive; if float rounding
        makes it 0 (p and q equal to within rounding, where a rejection has probability ~1e-7) p is returned.
    """
    residual = (p - q).clamp_min_(0.0)
    mass = residual.sum()
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously; the clock must wait for them or timings land in the wrong bucket.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(
            f"eos_token_id must be a non-negative int, a list of them or None, got {eos_token_id!r}"
        )
    return frozenset(ids)


def _prompt_tensor(
    prompt_ids: Sequence[int] | torch.Tensor, device: torch.device, vocab_size: int
) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"batch size 1 only: prompt_ids has shape {tuple(ids.shape)}; pass one prompt (1, T)."
            )
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty list of ids or a (1, T) tensor, got {tuple(ids.shape)}"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"prompt_ids must lie in [0, {vocab_size}); check the tokenizer matches the models.")
    return ids.to(device)


def _check_generator(
    generator: torch.Generator | None, sampling: SamplingConfig, device: torch.device
) -> None:
    if generator is None:
        if not sampling.is_greedy:
            raise ValueError("sampling mode needs a torch.Generator (seeded) so runs are reproducible.")
        return
    if torch.device(generator.device).type != device.type:
        raise ValueError(
            f"the generator lives on {generator.device} but the models on {device}: "
            f"create it with torch.Generator(device='{device.type}')."
        )


def _is_int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if not _is_int_at_least(max_new_tokens, 0):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")


def _check_cache_implementation(implementation: str) -> None:
    if implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {implementation!r}"
        )


class _Sequence:
    """Mutable state of one generation: token buffer, length, target cache, counters."""

    def __init__(self, prompt: torch.Tensor, capacity: int, target_cache: Cache) -> None:
        self.buf = torch.empty(1, capacity, dtype=torch.long, device=prompt.device)
        self.buf[0, : prompt.numel()] = prompt
        self.prompt_length = prompt.numel()
        self.n = prompt.numel()
        self.target_cache = target_cache
        self.target_length = 0
        self.finished = False
        self.stats = DecodingStats(sequences=1)

    def result(self, keep_state: bool, proposer: Drafter | None = None) -> GenerationResult:
        tokens = self.buf[0, self.prompt_length : self.n].tolist()
        self.stats.generated_tokens = len(tokens)
        state = None
        if keep_state:
            state = DecodeState(self.buf[:, : self.n].clone(), self.target_cache, self.target_length)
            if proposer is not None:
                state.draft_cache, state.draft_length = proposer.cache, proposer.length
        return GenerationResult(tokens, self.stats, state)


@torch.inference_mode()
def autoregressive(
    target: torch.nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_id: int | Sequence[int] | None,
    vocab_size: int,
    generator: torch.Generator | None = None,
    cache_implementation: str = "dynamic",
) -> GenerationResult:
    """Plain target decoding with the engine's sampling and statistics: the baseline of `speedup`.

    Args:
        target: causal LM (HF `PreTrainedModel`), in eval mode.
        prompt_ids: list of ids or `(1, T)` tensor.
        max_new_tokens: most tokens to generate; generation also stops after EOS.
        sampling: warping shared with the speculative engine.
        eos_token_id: id (or ids) that end generation; None for none.
        vocab_size: the tokenizer's real vocabulary; logits beyond it (padding rows) are dropped.
        generator: seeded generator on the model's device (required unless greedy).
        cache_implementation: `"dynamic"` or `"static"` KV cache (`specdistill.models.cache.new_cache`).
    """
    check_model_covers_vocab("target", target, vocab_size)
    _check_max_new_tokens(max_new_tokens)
    _check_cache_implementation(cache_implementation)
    device = model_device(target)
    _check_generator(generator, sampling, device)
    eos = _eos_set(eos_token_id)
    prompt = _prompt_tensor(prompt_ids, device, vocab_size)
    capacity = prompt.numel() + max_new_tokens
    seq = _Sequence(prompt, capacity, new_cache(target, cache_implementation, capacity))
    greedy = sampling.is_greedy
    start = time.perf_counter()
    while seq.n - seq.prompt_length < max_new_tokens and not seq.finished:
        out, seq.target_cache = forward_keep_last(
            target, seq.buf[:, seq.target_length : seq.n], seq.target_cache, 1
        )
        seq.target_length = seq.n
        crop_cache(seq.target_cache, seq.target_length)  # keeps sliding-window layers at their window
        seq.stats.target_forwards += 1
        logits = out.logits[0, -1, :vocab_size]
        if greedy:
            token = logits.argmax()
        else:
            token = torch.multinomial(sampling.warp_probs(logits), 1, generator=generator)[0]
        seq.buf[0, seq.n] = token
        seq.n += 1
        seq.finished = int(token) in eos
    _sync(device)
    seq.stats.wall_time_s = time.perf_counter() - start
    seq.stats.target_time_s = seq.stats.wall_time_s
    return seq.result(keep_state=False)


def _as_proposer(draft: Drafter | torch.nn.Module, vocab_size: int) -> Drafter:
    """`draft` itself if it is a proposer (`Proposer` or `BlockProposer`), a `DraftLMProposer` around it if it is a
    causal LM."""
    if isinstance(draft, Proposer | BlockProposer):
        if draft.vocab_size != vocab_size:
            raise ValueError(
                f"{type(draft).__name__}.vocab_size is {draft.vocab_size!r} but the engine's vocab_size is "
                f"{vocab_size}: build the proposer with the tokenizer's len(tokenizer)."
            )
        return draft
    if isinstance(draft, torch.nn.Module):
        return DraftLMProposer(draft, vocab_size)
    raise ValueError(
        f"draft must be a causal LM (torch.nn.Module), a BlockProposer or a Proposer "
        "(specdistill.decoding.proposers), "
        f"got {type(draft).__name__}"
    )


def _check_target_hidden_layers(proposer: Drafter, target: torch.nn.Module) -> tuple[int, ...] | None:
    """The proposer's `target_hidden_layers`, checked against the target's `output_hidden_states` tuple."""
    layers = proposer.target_hidden_layers
    if layers is None:
        return None
    count = target.config.get_text_config(decoder=True).num_hidden_layers + 1  # embeddings, then every layer
    if (
        not isinstance(layers, tuple)
        or not layers
        or any(not _is_int_at_least(i, -count) or i >= count for i in layers)
    ):
        raise ValueError(
            f"{type(proposer).__name__}.target_hidden_layers must be None or a non-empty tuple of ints in "
            f"[-{count}, {count - 1}] (indices into the target's {count} output_hidden_states), got {layers!r}"
        )
    return layers


def _check_block(block: DraftBlock, request: BlockRequest, vocab_size: int, name: str) -> int:
    """The block's size, after checking it keeps the contract (`DraftBlock`): a wrong shape is the proposer's bug."""
    size = len(block) if isinstance(block, DraftBlock) and block.tokens.dim() == 1 else -1
    if not 0 <= size <= request.max_length:
        raise ValueError(
            f"{name}.propose_block must return a DraftBlock of at most {request.max_length} tokens (a 1-D tensor), "
            f"got {block!r}"
        )
    if block.q is not None and tuple(block.q.shape) != (size, vocab_size):
        raise ValueError(
            f"{name}.propose_block returned q of shape {tuple(block.q.shape)}, expected {(size, vocab_size)}"
        )
    if request.with_hidden and size and (block.hidden is None or block.hidden.shape[0] != size):
        raise ValueError(
            f"{name}.propose_block was asked for hidden states and must return one row per token"
        )
    return size


def _point_mass(token: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The distribution of a token chosen deterministically (`DraftBlock.q is None`): 1 on it, 0 elsewhere."""
    probs = torch.zeros(vocab_size, device=device)
    probs[token] = 1.0
    return probs


class SpeculativeDecoder:
    """Speculative decoding of one sequence at a time with a draft-length policy.

    Args:
        target: the large causal LM whose distribution is reproduced exactly.
        draft: what proposes the candidates (same tokenizer): a `BlockProposer`, a `Proposer` (drafted through a
            `ChainProposer`), or a small causal LM, which the engine drafts with through a `DraftLMProposer`.
        policy: decides within each round when the draft stops proposing (see `DraftPolicy`).
        sampling: warping applied identically to draft and target; greedy or temperature 0 for argmax decoding.
        eos_token_id: id (or ids) that end generation; None for none.
        vocab_size: the tokenizer's real vocabulary: logits are compared on `[..., :vocab_size]` only.
        max_draft_length: most candidates per round (20 as in SpecDec++), further capped by the remaining token
            budget; must be >= the policy's `min_draft_length`. The only upper bound on the draft length.
        cache_implementation: `"dynamic"` (default) or `"static"` KV caches for the target and the proposer
            (`specdistill.models.cache.new_cache`).

    Attributes:
        proposer: the proposer that drafts (`draft` itself, or the `DraftLMProposer` around it).
        blocks: the `BlockProposer` the engine drafts through: `proposer` itself, or the `ChainProposer` around it.
        device: the proposer's device, where the sequence, the generator and (unless placed with a device_map) the
            target live.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: Drafter | torch.nn.Module,
        policy: DraftPolicy,
        sampling: SamplingConfig,
        eos_token_id: int | Sequence[int] | None,
        vocab_size: int,
        *,
        max_draft_length: int = 20,
        cache_implementation: str = "dynamic",
    ) -> None:
        check_vocab_size(vocab_size)
        check_model_covers_vocab("target", target, vocab_size)
        self.proposer = _as_proposer(draft, vocab_size)
        self.blocks = (
            self.proposer if isinstance(self.proposer, BlockProposer) else ChainProposer(self.proposer)
        )
        self._target_hidden_layers = _check_target_hidden_layers(self.proposer, target)
        # A target placed across devices (device_map) takes its inputs anywhere and returns its logits there.
        self.device = self.proposer.device
        if not is_placed_across_devices(target) and model_device(target) != self.device:
            raise ValueError(
                f"the draft is on {self.device} but the target on {model_device(target)}: put both on one device "
                "(or load the target with a device_map)."
            )
        if not isinstance(policy, DraftPolicy):
            raise ValueError(f"policy must be a DraftPolicy, got {type(policy).__name__}")
        if not _is_int_at_least(max_draft_length, 1):
            raise ValueError(f"max_draft_length must be an int >= 1, got {max_draft_length!r}")
        min_length = policy.min_draft_length
        if not _is_int_at_least(min_length, 1) or min_length > max_draft_length:
            raise ValueError(
                f"{type(policy).__name__}.min_draft_length must be an int in [1, max_draft_length = "
                f"{max_draft_length}], got {min_length!r}"
            )
        _check_cache_implementation(cache_implementation)
        self.cache_implementation = cache_implementation
        self.max_draft_length = max_draft_length
        self.target = target
        self.policy = policy
        self.sampling = sampling
        self.eos = _eos_set(eos_token_id)
        self.vocab_size = vocab_size

    # ------------------------------------------------------------------ public

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
        keep_state: bool = False,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stops after EOS).

        Args:
            prompt_ids: list of ids or `(1, T)` tensor.
            max_new_tokens: most tokens to generate.
            generator: seeded generator on the models' device (required unless greedy).
            keep_state: return the final token buffer and caches in `result.state` (tests, debugging).
        """
        _check_max_new_tokens(max_new_tokens)
        _check_generator(generator, self.sampling, self.device)
        prompt = _prompt_tensor(prompt_ids, self.device, self.vocab_size)
        max_k = self.max_draft_length
        capacity = prompt.numel() + max_new_tokens + max_k + 2
        seq = _Sequence(prompt, capacity, new_cache(self.target, self.cache_implementation, capacity))
        self.blocks.start(seq.buf[:, : seq.prompt_length], capacity, self.cache_implementation)
        self.policy.reset(max_k)
        start = time.perf_counter()
        excluded = 0.0
        # A proposer that drafts from the target's hidden states has none before the target has read the prompt:
        # its first round only prefills (no candidates: the target's next token), as vLLM's EAGLE does.
        prefill = self.blocks.drafts_after_prefill
        while seq.n - seq.prompt_length < max_new_tokens and not seq.finished:
            remaining = max_new_tokens - (seq.n - seq.prompt_length)
            # Never draft more than can be emitted: a round emits at most k + 1 tokens.
            excluded += self._round(seq, 0 if prefill else min(max_k, remaining - 1), generator)
            prefill = False
        _sync(self.device)
        seq.stats.wall_time_s = time.perf_counter() - start - excluded
        seq.stats.oracle_probe_time_s = excluded
        seq.stats.draft_forwards = self.blocks.forwards
        return seq.result(keep_state, self.proposer)

    # ------------------------------------------------------------------ one round

    def _round(self, seq: _Sequence, k_cap: int, generator: torch.Generator | None) -> float:
        """Draft, verify, emit, crop. Returns the seconds spent probing for an oracle (excluded from timings)."""
        policy, proposer = self.policy, self.blocks
        policy.begin_round()
        greedy = self.sampling.is_greedy
        n = seq.n
        uniforms = None
        if not greedy and k_cap > 0:
            uniforms = torch.rand(k_cap, generator=generator, device=self.device)

        t0 = time.perf_counter()
        num_candidates, withdrawn, q_rows, probe_s, probe_length = self._draft(
            seq, k_cap, uniforms, generator
        )
        if probe_length is not None:  # drop the oracle's probe before the real verification
            crop_cache(seq.target_cache, seq.target_length)
        _sync(self.device)
        t1 = time.perf_counter()
        seq.stats.draft_time_s += t1 - t0 - probe_s

        k = num_candidates - int(withdrawn)  # candidates sent to the target
        verified_start = seq.target_length
        layers = self._target_hidden_layers
        # The hidden states are asked for only when the proposer reads them: the usual forward stays as it was.
        out, seq.target_cache = forward_keep_last(
            self.target,
            seq.buf[:, verified_start : n + k],
            seq.target_cache,
            k + 1,
            hidden=layers is not None,
        )
        seq.stats.target_forwards += 1
        seq.target_length = n + k
        logits = out.logits[0, -(k + 1) :, : self.vocab_size]  # (k + 1, V): row j scores candidate j + 1

        if greedy:
            accepted, extra = self._verify_greedy(seq, logits, num_candidates, k)
        else:
            accepted, extra = self._verify_sampling(
                seq, logits, num_candidates, k, q_rows, uniforms, generator
            )

        # Withdrawn candidates are not counted as drafted unless the real verification accepts them.
        drafted = k + int(withdrawn and accepted == num_candidates)
        rejected = accepted < k
        seq.stats.record_round(drafted, accepted, rejected)
        policy.end_round(drafted, accepted)

        emitted = accepted + int(extra is not None)
        if extra is not None:
            seq.buf[0, n + accepted] = extra
        if self.eos:
            # Nothing is emitted past EOS (a bonus token after an accepted EOS candidate is dropped).
            for j, token in enumerate(seq.buf[0, n : n + emitted].tolist()):
                if token in self.eos:
                    emitted = j + 1
                    seq.finished = True
                    break
        seq.n = n + emitted
        # Keep only what both models saw of the accepted prefix; caches must stay shorter than the sequence.
        seq.target_length = min(seq.target_length, n + min(accepted, k), seq.n - 1)
        crop_cache(seq.target_cache, seq.target_length)
        observe_s = 0.0
        if layers is not None:  # the proposer's reading of the target states is drafting work: timed as such
            t2 = time.perf_counter()
            states = tuple(out.hidden_states[i][0] for i in layers)
            proposer.observe_target(TargetHidden(verified_start, states, k, accepted, seq.target_length))
            _sync(self.device)
            observe_s = time.perf_counter() - t2
            seq.stats.draft_time_s += observe_s
        proposer.rollback(min(proposer.length, n + accepted, seq.n - 1))
        _sync(self.device)
        seq.stats.target_time_s += time.perf_counter() - t1 - observe_s
        return probe_s

    def _draft(
        self, seq: _Sequence, k_cap: int, uniforms: torch.Tensor | None, generator: torch.Generator | None
    ):
        """Draft up to `k_cap` candidates into `seq.buf[n:]` block by block, asking the policy after each candidate
        (see the module docstring).

        Returns:
            (number of candidates, whether the last one is withdrawn, draft distributions `(V,)` per candidate in
            sampling mode, seconds spent probing, probe length or None).
        """
        if k_cap <= 0:
            return 0, False, [], 0.0, None
        policy, greedy, n = self.policy, self.sampling.is_greedy, seq.n
        oracle = policy.needs_oracle
        q_rows: list[torch.Tensor] = []
        probe_s = 0.0
        probe_length = seq.target_length if oracle else None

        def draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self._draw(logits, generator)

        index = 0
        while True:
            request = BlockRequest(k_cap - index, policy.needs_hidden_states, policy.feed_newest, draw)
            block = self.blocks.propose_block(seq.buf[:, : n + index], request)
            size = _check_block(block, request, self.vocab_size, type(self.proposer).__name__)
            if size == 0:  # nothing to propose: verify what the round holds
                return index, False, q_rows, probe_s, probe_length
            for i in range(size):
                index += 1
                token_t = block.tokens[i]
                seq.buf[0, n + index - 1] = token_t
                token = int(token_t)
                probs = (
                    block.q[i] if block.q is not None else _point_mass(token, self.vocab_size, self.device)
                )
                if not greedy:
                    q_rows.append(probs)
                will_accept = None
                if oracle:
                    p0 = time.perf_counter()
                    will_accept, probe_length = self._probe(seq, index, token, probs, uniforms, probe_length)
                    probe_s += time.perf_counter() - p0
                hidden = None if block.hidden is None else block.hidden[i]
                # asked after every candidate (a policy may need all of them); a stop before the minimum is ignored
                policy_stop = policy.should_stop(DraftStep(index, token, probs, hidden, will_accept))
                policy_stop = policy_stop and index >= policy.min_draft_length
                withdrawn = policy_stop and policy.withdraws_stop
                if policy_stop or index >= k_cap or token in self.eos:
                    return index, withdrawn, q_rows, probe_s, probe_length
            if not self.blocks.chained:  # one block per round
                return index, False, q_rows, probe_s, probe_length

    def _draw(
        self, logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`BlockRequest.draw`: tokens and the distributions they were drawn from, for logits `(..., V)`."""
        probs = self.sampling.policy_probs(logits)
        if self.sampling.is_greedy:
            return logits.argmax(-1), probs
        if probs.dim() == 1:
            return torch.multinomial(probs, 1, generator=generator)[0], probs
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1]), probs

    # ------------------------------------------------------------------ verification

    def _verify_greedy(self, seq: _Sequence, logits: torch.Tensor, num_candidates: int, k: int):
        """Accepted prefix length and the extra target token (None when a withdrawn candidate was accepted)."""
        n = seq.n
        best = logits.argmax(-1)  # (k + 1,)
        tested = min(num_candidates, k + 1)
        if tested == 0:
            return 0, best[0]
        matches = seq.buf[0, n : n + tested] == best[:tested]
        accepted = int(matches.cumprod(0).sum())
        if (
            accepted == k + 1
        ):  # a withdrawn candidate that the target accepts after all: no row left for a bonus
            return accepted, None
        return accepted, best[accepted]

    def _verify_sampling(
        self,
        seq: _Sequence,
        logits: torch.Tensor,
        num_candidates: int,
        k: int,
        q_rows: list[torch.Tensor],
        uniforms: torch.Tensor | None,
        generator: torch.Generator | None,
    ):
        """Speculative sampling: accept d_j iff u_j * q(d_j) < p(d_j); resample the first rejection from the residual."""
        n = seq.n
        p = self.sampling.warp_probs(logits)  # (k + 1, V)
        if num_candidates == 0:
            return 0, torch.multinomial(p[0], 1, generator=generator)[0]
        cand = seq.buf[0, n : n + num_candidates]
        q = torch.stack(q_rows)  # (num_candidates, V)
        rows = torch.arange(num_candidates, device=p.device)
        p_tok = p[rows, cand]
        q_tok = q[rows, cand]
        keep = uniforms[:num_candidates] * q_tok < p_tok
        accepted = int(keep.cumprod(0).sum())
        if accepted < num_candidates:
            residual = residual_distribution(p[accepted], q[accepted])
            return accepted, torch.multinomial(residual, 1, generator=generator)[0]
        if accepted == k:
            return accepted, torch.multinomial(p[k], 1, generator=generator)[0]  # bonus token
        return accepted, None  # withdrawn candidate accepted after all: no row left for a bonus

    # ------------------------------------------------------------------ oracle probe

    def _probe(
        self,
        seq: _Sequence,
        index: int,
        token: int,
        probs: torch.Tensor,
        uniforms: torch.Tensor | None,
        probe_length: int,
    ) -> tuple[bool, int]:
        """Whether the target will accept candidate `index`, from the target fed up to the candidate before it.

        Runs on the real target cache (cropped back by the caller); nothing here is counted or timed.
        """
        end = seq.n + index - 1
        out, seq.target_cache = forward_keep_last(
            self.target, seq.buf[:, probe_length:end], seq.target_cache, 1
        )
        logits = out.logits[0, -1, : self.vocab_size]
        if self.sampling.is_greedy:
            return int(logits.argmax()) == token, end
        p_tok = self.sampling.warp_probs(logits)[token]
        return bool(uniforms[index - 1] * probs[token] < p_tok), end
