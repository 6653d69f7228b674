"""A model's output rows at chosen positions (`specdistill.models.output_rows`) equal its own forward, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.models.acceptance_head import draft_logits
from specdistill.models.output_rows import (
    MIN_PROJECTED_ROWS,
    OutputHead,
    final_hidden_states,
    logits_at,
    unwrap_engine,
)
from specdistill.utils.frozen_sharding import is_deepspeed_engine
from tests.architectures import ARCHITECTURES

VOCAB = 64  # the tokenizer's; every model carries 6 padded output rows more
SOFTCAP = 0.1  # small enough that Gemma-2's cap changes every logit of these models


def _model(arch: str, **overrides) -> nn.Module:
    kwargs = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(kwargs.pop("model_type"), vocab_size=VOCAB + 6, **kwargs, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def _batch(batch_size: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch_size * length)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[0, length - length // 3 :] = 0  # right padding in one row
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, length), generator=gen), "attention_mask": mask}


def _positions(batch_size: int, length: int, count: int) -> torch.Tensor:
    chosen = torch.randperm(batch_size * length, generator=torch.Generator().manual_seed(count))[:count]
    positions = torch.zeros(batch_size * length, dtype=torch.bool)
    positions[chosen] = True
    return positions.view(batch_size, length)


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thread")
def threads(request):
    """MKL picks its kernels by rows per thread, so the rounding is checked at one and at two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# a small batch (projected whole), a large one with few chosen rows (filler rows added) and with many
SHAPES = [(2, 9, 5), (3, 60, 1), (3, 60, 3), (3, 60, 11), (3, 60, 150)]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize(("batch_size", "length", "count"), SHAPES)
def test_logits_at_chosen_positions_are_the_forwards_bits(arch, batch_size, length, count, threads):
    model = _model(arch, **({"final_logit_softcapping": SOFTCAP} if arch == "gemma2" else {}))
    batch, positions = _batch(batch_size, length), _positions(batch_size, length, count)
    with torch.no_grad():
        expected = model(**batch).logits[positions][:, :VOCAB]
        got = logits_at(model, batch, positions, VOCAB)
    assert got.shape == (count, VOCAB)
    assert torch.equal(got, expected)


def test_gemma2_soft_cap_and_padded_rows_are_applied():
    """The cap changes the logits (so the test above checks it) and the padded rows are dropped."""
    model = _model("gemma2", final_logit_softcapping=SOFTCAP)
    batch = _batch(2, 9)
    with torch.no_grad():
        hidden = final_hidden_states(model, batch)
        raw = model.get_output_embeddings()(hidden)
        capped = OutputHead(model, VOCAB)(hidden)
    assert raw.shape[-1] == VOCAB + 6 and capped.shape[-1] == VOCAB
    assert capped.abs().max() < SOFTCAP < raw.abs().max()
    assert torch.equal(capped, torch.tanh(raw[..., :VOCAB] / SOFTCAP) * SOFTCAP)


def test_no_chosen_position_gives_no_rows():
    model = _model("llama")
    with torch.no_grad():
        got = logits_at(model, _batch(3, 60), torch.zeros(3, 60, dtype=torch.bool), VOCAB)
    assert got.shape == (0, VOCAB)


@pytest.mark.parametrize("arch", ["gpt_neox", "gemma2"])
def test_draft_logits_is_the_output_head_over_every_row(arch):
    """What the engine drafts with: the model's own logits at its newest position (the product over that one row),
    padded rows included."""
    model = _model(arch, **({"final_logit_softcapping": SOFTCAP} if arch == "gemma2" else {}))
    batch = _batch(1, 12)
    with torch.no_grad():
        hidden = final_hidden_states(model, batch)[0, -1]
        expected = model(**batch, logits_to_keep=1).logits[0, -1]
        got = draft_logits(model, hidden)
    assert got.shape == (VOCAB + 6,)
    assert torch.equal(got, expected)
    assert torch.equal(got, OutputHead(model)(hidden))


def test_bad_models_are_refused_with_the_fix():
    model = _model("llama")
    with pytest.raises(ValueError, match="gives 70 logits but the tokenizer has 71"):
        OutputHead(model, VOCAB + 7)
    with pytest.raises(ValueError, match="no separate body"):
        final_hidden_states(model.base_model, _batch(1, 4))


def test_a_deepspeed_engine_is_unwrapped_and_a_look_alike_is_not():
    """A real `DeepSpeedEngine` instance (its class, without the distributed setup its __init__ needs) is unwrapped;
    a wrapper that only shares its class name and `module` attribute is not an engine."""
    deepspeed = pytest.importorskip("deepspeed")
    model = _model("gpt_neox")
    engine = deepspeed.DeepSpeedEngine.__new__(deepspeed.DeepSpeedEngine)
    nn.Module.__init__(engine)
    engine.module = model  # where DeepSpeedEngine.__init__ keeps the wrapped model

    class DeepSpeedEngine(nn.Module):  # noqa: N801  (a look-alike named like the real class)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert is_deepspeed_engine(engine) and unwrap_engine(engine) is model
    assert not is_deepspeed_engine(DeepSpeedEngine(model)) and not is_deepspeed_engine(model)
    assert unwrap_engine(model) is model
    assert OutputHead(engine, VOCAB).layer is model.get_output_embeddings()
    batch, positions = _batch(2, 9), _positions(2, 9, 7)
    with torch.no_grad():
        assert torch.equal(
            logits_at(engine, batch, positions, VOCAB), logits_at(model, batch, positions, VOCAB)
        )
    with pytest.raises(ValueError, match="no separate body"):
        final_hidden_states(DeepSpeedEngine(model), batch)  # not unwrapped: the look-alike has no base_model


def test_min_projected_rows_exceeds_the_shapes_above():
    """The large-batch shapes above exercise both sides of `MIN_PROJECTED_ROWS`."""
    assert (
        min(c for b, t, c in SHAPES if b * t > MIN_PROJECTED_ROWS)
        < MIN_PROJECTED_ROWS
        < max(c for *_, c in SHAPES)
    )
