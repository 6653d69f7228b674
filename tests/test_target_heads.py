"""Heads on the target's hidden states share one proposer and one export: a head of another architecture than
EAGLE-3 (test-only, below) implements `TargetStateHead` and drafts through `TargetHeadProposer` in the engine,
losslessly; EAGLE-3's head implements the same protocol; a kind is resolved against its target without changing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specdistill.decoding.engine import SpeculativeDecoder, autoregressive
from specdistill.decoding.toy import toy_pair
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.eagle3.proposer import Eagle3Proposer
from specdistill.drafts.target_heads import TargetHeadProposer, TargetStateHead
from specdistill.drafts.target_heads.export import speculators_record, verifier_of, write_checkpoint
from specdistill.errors import ConfigError
from tests.test_eagle3 import tiny_head, tiny_target
from tests.test_engine import GREEDY, V, _all_policies, _prompts
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

HIDDEN = 16


# ---------------------------------------------------------------------------------------------- a test-only head


class _Cache:
    """One state per position; position `t` reads the mean of the earlier ones."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.states)

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop a cache of {len(self)} positions to {length}")
        del self.states[length:]


@dataclass
class _Output:
    hidden: torch.Tensor
    normed: torch.Tensor
    logits: torch.Tensor


class _RecurrentHead(nn.Module):
    """Not EAGLE-3: no attention, no RoPE, two target layers read, its own embeddings. Position `t` is
    `tanh(fuse(states) + embed(token t + 1) + mean of the earlier positions' outputs)`, and it drafts every other
    target id (draft id `i` is target id `2 i`)."""

    def __init__(
        self, target: nn.Module, vocab: int, layers: tuple[int, ...] = (1, 2), seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        width = target.config.hidden_size
        self.layers = layers
        self.fc = nn.Linear(len(layers) * width, HIDDEN)
        self.embedding = nn.Embedding(vocab, HIDDEN)
        self.out = nn.Linear(HIDDEN, (vocab + 1) // 2)
        self.register_buffer("ids", torch.arange(0, vocab, 2))
        self.eval().requires_grad_(False)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.layers

    @property
    def hidden_size(self) -> int:
        return HIDDEN

    @property
    def target_ids(self) -> torch.Tensor:
        return self.ids

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self) -> _Cache:
        return _Cache()

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        return self.fc(states)

    def step(
        self, tokens: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor, cache: _Cache
    ) -> _Output:
        assert positions.tolist() == list(range(len(cache), len(cache) + tokens.shape[1]))
        outputs = []
        for i in range(tokens.shape[1]):
            context = torch.stack(cache.states).mean(0) if cache.states else torch.zeros(1, HIDDEN)
            state = torch.tanh(inputs[:, i] + self.embedding(tokens[:, i]) + context)
            cache.states.append(state)
            outputs.append(state)
        hidden = torch.stack(outputs, dim=1)
        normed = hidden / hidden.norm(dim=-1, keepdim=True)
        return _Output(hidden, normed, self.out(normed))


@pytest.fixture(scope="module")
def target():
    return toy_pair(V)[0]


def test_a_new_head_drafts_through_the_generic_proposer_losslessly_for_every_policy(target):
    """Greedy output equals the target's for every policy, those reading the head's states included; the head's
    states are the target's (its chain is recomputed from them after every verification)."""
    head = _RecurrentHead(target, V)
    assert isinstance(head, TargetStateHead)
    proposer = TargetHeadProposer(head, V)
    assert proposer.target_hidden_layers == (1, 2) and proposer.drafts_after_prefill
    prompts = _prompts(4)
    references = [autoregressive(target, p, 24, GREEDY, None, V).tokens for p in prompts]
    accepted = rejected = forwards = 0
    for name, (policy, bound) in _all_policies(
        SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN))
    ).items():
        decoder = SpeculativeDecoder(target, proposer, policy, GREEDY, None, V, max_draft_length=bound)
        assert decoder.proposer is proposer
        for prompt, reference in zip(prompts, references, strict=True):
            result = decoder.generate(prompt, 24)
            assert result.tokens == reference, (
                f"the test head with {name} diverged from the target's greedy output"
            )
            accepted += result.stats.accepted_tokens
            rejected += result.stats.rejected_tokens
            forwards += result.stats.draft_forwards
    assert accepted > 0 and rejected > 0 and forwards > 0  # both the acceptance and the rollback paths ran


def test_the_generic_proposer_refuses_a_draft_vocabulary_outside_the_tokenizer(target):
    with pytest.raises(ValueError, match="_RecurrentHead's draft vocabulary names target ids up to 46"):
        TargetHeadProposer(_RecurrentHead(target, V), 40)


def test_the_eagle3_head_is_such_a_head_and_its_proposer_the_generic_one():
    target = tiny_target("llama")
    head = tiny_head(target)
    assert isinstance(head, TargetStateHead) and head.target_layers == head.config.aux_layer_ids
    assert issubclass(Eagle3Proposer, TargetHeadProposer)


# ---------------------------------------------------------------------------------------------- export


def test_a_heads_checkpoint_and_speculators_record_are_written_whatever_the_head(target, tmp_path: Path):
    head = _RecurrentHead(target, V)
    out = write_checkpoint(tmp_path / "head", head.state_dict(), {"layers": list(head.target_layers)})
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == head.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in head.state_dict().items())
    assert json.loads((out / "config.json").read_text()) == {"layers": [1, 2]}
    record = speculators_record(
        "recurrent", "RecurrentSpeculator", {"width": HIDDEN}, *verifier_of(target), 4
    )
    assert list(record) == [
        "architectures", "speculators_model_type", "speculators_version", "width", "speculators_config",
    ]  # fmt: skip
    assert record["speculators_config"]["algorithm"] == "recurrent"
    assert record["speculators_config"]["verifier"] == {"name_or_path": None, "architectures": []}
    assert record["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


# ---------------------------------------------------------------------------------------------- resolving a kind


def test_a_kind_is_resolved_against_its_target_into_a_new_kind_and_never_changed():
    target = tiny_target("llama", num_hidden_layers=8)
    kind = Eagle3(draft_vocab_size=16, ttt_steps=2)
    before = (kind.settings(), kind.target_layers, kind.verifier)
    resolved = kind.resolve(target)
    assert resolved is not kind and resolved.aux_layer_ids == (2, 4, 5)  # vLLM's default for 8 layers
    assert resolved.target_layers == (2, 4, 5) and resolved.verifier == verifier_of(target)
    assert resolved.settings() == {**kind.settings(), "aux_layer_ids": [2, 4, 5]}
    assert resolved.resolve(target).settings() == resolved.settings()
    head = kind.build(target, vocab_size=V)
    assert head.config.aux_layer_ids == (2, 4, 5)
    assert kind.loaded_kind(head, target).settings() == resolved.settings()
    assert (
        kind.settings(),
        kind.target_layers,
        kind.verifier,
    ) == before  # build and resolve left it as it was
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        Eagle3(aux_layer_ids=[1, 2, 8]).resolve(target)
