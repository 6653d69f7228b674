"""DistillModule (and SFTModule's shared normaliser) with real tiny GPT-NeoX models and a real Lightning Trainer."""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from specdistill.losses import ForwardKL, ReverseKL, expected_acceptance, forward_kl
from specdistill.losses.reduction import window_normaliser
from specdistill.modules import DistillModule, SFTModule
from specdistill.selection import Selection
from specdistill.selection.reference import OnlineReference
from specdistill.selection.selectors import AdaSpecSelector, DraftLossSelector

VOCAB = 64
SEQ = 12


def tiny_lm(seed: int, hidden: int = 32, vocab: int = VOCAB) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    return GPTNeoXForCausalLM(config)


def make_examples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Right-padded examples of varying prompt and answer lengths (labels unshifted, -100 on prompt/padding)."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        length = int(torch.randint(6, SEQ + 1, (), generator=gen))
        prompt = int(torch.randint(2, length - 2, (), generator=gen))
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        real = torch.arange(SEQ) < length
        labels = torch.where(real & (torch.arange(SEQ) >= prompt), ids, torch.full_like(ids, -100))
        examples.append(
            {"input_ids": ids, "attention_mask": real.long(), "labels": labels, "example_id": torch.tensor(i)}
        )
    return examples


def make_batches(examples: list[dict], batch_size: int, accumulate: int) -> list[dict[str, torch.Tensor]]:
    """Collate micro-batches and add `window_answer_tokens` over each accumulation window."""
    batches = [
        {k: torch.stack([e[k] for e in examples[i : i + batch_size]]) for k in examples[0]}
        for i in range(0, len(examples), batch_size)
    ]
    for w in range(0, len(batches), accumulate):
        window = batches[w : w + accumulate]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        for b in window:
            b["window_answer_tokens"] = torch.tensor(tokens)
    return batches


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def make_module(target_vocab: int = VOCAB, optimizer=None, selector=None, reference=None) -> DistillModule:
    return DistillModule(
        draft=tiny_lm(1, hidden=16),
        target=tiny_lm(2, vocab=target_vocab),
        vocab_size=VOCAB,
        divergence=ForwardKL(),
        optimizer=optimizer or functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        selector=selector,
        reference=reference,
    )


def attach_trainer(module: L.LightningModule, accumulate: int = 1, world_size: int = 1) -> L.LightningModule:
    """Stand-in for the Trainer attributes a step reads, to call `training_step` directly (logging is skipped)."""
    module.trainer = SimpleNamespace(
        accumulate_grad_batches=accumulate, world_size=world_size, barebones=True
    )
    return module


def loader(batches: list[dict]) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False)


def test_state_dict_and_checkpoint_hold_only_the_draft(tmp_path):
    reference = OnlineReference(tiny_lm(3, hidden=16), ForwardKL(), VOCAB)
    module = make_module(selector=AdaSpecSelector(k=0.4), reference=reference)
    keys = list(module.state_dict())
    assert keys and all(k.startswith("draft.") for k in keys)
    for frozen in (module.target, reference.model):
        assert not any(p is q for p in module.parameters() for q in frozen.parameters())
    trainer = make_trainer(max_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, loader(make_batches(make_examples(4), 4, 1)))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert all(k.startswith("draft.") for k in checkpoint["state_dict"])
    assert checkpoint["hyper_parameters"] == {"vocab_size": VOCAB}  # no selector or model objects
    n_draft = sum(1 for p in module.draft.parameters() if p.requires_grad)
    assert len(checkpoint["optimizer_states"][0]["state"]) == n_draft


def test_training_loss_is_forward_kl_sum_over_window_tokens():
    module = attach_trainer(make_module(), accumulate=2)  # the accumulation comes from the trainer
    batch = make_batches(make_examples(4), 2, 2)[0]
    loss = module.training_step(batch, 0)
    mask = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        t = module.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        d = module.draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = forward_kl(t[:, :-1][mask], d[:, :-1][mask]).sum() / batch["window_answer_tokens"] * 2
    torch.testing.assert_close(loss.detach(), expected)
    # the window holds more tokens than this micro-batch, so the loss is not the micro-batch mean
    assert batch["window_answer_tokens"] > mask.sum()


def test_gradient_accumulation_does_not_change_the_update():
    examples = make_examples(16)
    weights = []
    for batch_size, accumulate in [(8, 1), (2, 4)]:
        # plain SGD: unlike Adam it is not scale-invariant, so a wrong loss scale would show in the weights
        module = make_module(optimizer=functools.partial(torch.optim.SGD, lr=0.5))
        trainer = make_trainer(max_steps=2, accumulate_grad_batches=accumulate)
        trainer.fit(module, loader(make_batches(examples, batch_size, accumulate)))
        assert trainer.global_step == 2
        weights.append({k: v.clone() for k, v in module.draft.state_dict().items()})
    start = tiny_lm(1, hidden=16).state_dict()
    assert any(not torch.allclose(weights[0][k], start[k]) for k in start)  # training moved the weights
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-4, atol=1e-6)


def test_frozen_target_is_untouched_and_accumulation_is_the_trainers():
    module = make_module()
    before = {k: v.clone() for k, v in module.target.state_dict().items()}
    make_trainer(max_steps=2).fit(module, loader(make_batches(make_examples(8), 4, 1)))
    for k, v in module.target.state_dict().items():
        assert torch.equal(v, before[k])
    assert not module.target.training and not any(p.requires_grad for p in module.target.parameters())
    # one source of truth: no constructor argument that could disagree with the Trainer
    for cls in (DistillModule, SFTModule):
        assert "accumulate_grad_batches" not in inspect.signature(cls).parameters


def test_validation_logs_token_weighted_kl_and_expected_acceptance():
    module = make_module()
    batches = make_batches(make_examples(6), 4, 1)  # batches of 4 and 2 examples: unequal token counts
    metrics = make_trainer().validate(module, loader(batches), verbose=False)[0]
    kl, acc, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for b in batches:
            mask = b["labels"][:, 1:] != -100
            t = module.target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1][
                mask
            ]
            d = module.draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1][
                mask
            ]
            kl += forward_kl(t, d).sum().item()
            acc += expected_acceptance(t, d).sum().item()
            tokens += int(mask.sum())
    assert metrics["val/kl"] == pytest.approx(kl / tokens, rel=1e-5)
    assert metrics["val/expected_acceptance"] == pytest.approx(acc / tokens, rel=1e-5)
    assert 0 < metrics["val/expected_acceptance"] < 1


def test_padded_target_vocabulary_is_sliced_and_short_logits_refused():
    module = make_module(target_vocab=VOCAB + 8)  # padded embedding rows, as in Qwen
    batch = make_batches(make_examples(2), 2, 1)[0]
    assert torch.isfinite(module.training_step(batch, 0))
    short = DistillModule(
        draft=tiny_lm(1, hidden=16),
        target=tiny_lm(2, vocab=VOCAB - 4),
        vocab_size=VOCAB,
        divergence=ForwardKL(),
        optimizer=torch.optim.SGD,
    )
    with pytest.raises(ValueError, match="vocab_size"):
        short.training_step(batch, 0)
    del batch["window_answer_tokens"]
    with pytest.raises(ValueError, match="window_answer_tokens"):
        module.training_step(batch, 0)


class _KeepFirstHalf:
    """A real selector (not a mock): keeps the first half of the answer tokens, normalises by the kept count."""

    needs_reference = False

    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor | None] = {}

    def select(self, draft_divergence, reference_divergence, sequence_index, normaliser) -> Selection:
        self.seen = dict(
            draft=draft_divergence, reference=reference_divergence, rows=sequence_index, norm=normaliser
        )
        n = draft_divergence.shape[0]
        keep = torch.arange(n) < n // 2
        return Selection(keep=keep, normaliser=keep.sum().float())


def test_selector_restricts_the_loss_to_kept_tokens():
    selector = _KeepFirstHalf()
    module = make_module(selector=selector)
    assert module.selector is selector and module.reference is None
    batch = make_batches(make_examples(4), 4, 1)[0]
    loss = module.training_step(batch, 0)
    seen, record = selector.seen, module.last_selection
    mask = batch["labels"][:, 1:] != -100
    n = int(mask.sum())
    assert seen["draft"].shape == (n,) and not seen["draft"].requires_grad
    assert seen["reference"] is None  # this selector does not ask for one
    assert seen["rows"].equal(torch.arange(4)[:, None].expand_as(mask)[mask])
    assert seen["norm"].item() == batch["window_answer_tokens"].item()
    torch.testing.assert_close(loss.detach(), seen["draft"][: n // 2].mean())
    # the record the report callback reads
    assert record.token_ids.equal(batch["labels"][:, 1:][mask])
    assert record.keep.equal(torch.arange(n) < n // 2) and record.draft_divergence.equal(seen["draft"])
    assert record.reference_divergence is None and record.gap is None


def test_without_selector_every_answer_token_is_recorded_as_kept():
    module = make_module()
    batch = make_batches(make_examples(4), 4, 1)[0]
    module.training_step(batch, 0)
    record = module.last_selection
    assert record.keep.all() and record.keep.numel() == int((batch["labels"][:, 1:] != -100).sum())
    assert record.scores is None and record.reference_divergence is None


def test_constructor_refuses_a_missing_or_mismatched_reference():
    with pytest.raises(ValueError, match="needs the reference divergence"):
        make_module(selector=AdaSpecSelector(k=0.4))
    with pytest.raises(ValueError, match="same divergence"):
        make_module(
            selector=AdaSpecSelector(), reference=OnlineReference(tiny_lm(3, hidden=16), ReverseKL(), VOCAB)
        )
    with pytest.raises(ValueError, match="vocab_size"):
        make_module(
            selector=AdaSpecSelector(), reference=OnlineReference(tiny_lm(3, hidden=16), ForwardKL(), 32)
        )
    chunked = OnlineReference(
        tiny_lm(3, hidden=16), ForwardKL(chunk_size=8), VOCAB
    )  # same values, less memory
    assert make_module(selector=AdaSpecSelector(), reference=chunked).reference is chunked
    assert make_module(selector=DraftLossSelector(k=0.4)).reference is None  # needs no reference


# -- one normaliser for SFT and distillation --


def test_window_normaliser_uses_the_global_count_only_under_data_parallelism():
    batch = {"window_answer_tokens": torch.tensor(30), "global_window_answer_tokens": torch.tensor(70)}
    assert window_normaliser(batch, 1).item() == 30.0
    assert window_normaliser(batch, 2).item() == 35.0 and window_normaliser(batch, 2).dtype == torch.float32
    assert window_normaliser({"window_answer_tokens": torch.tensor(30)}, 2).item() == 30.0
    with pytest.raises(ValueError, match="window_answer_tokens"):
        window_normaliser({}, 1)


def _sft_module() -> SFTModule:
    return SFTModule(tiny_lm(1, hidden=16), functools.partial(torch.optim.SGD, lr=0.1))


def _ce_sum(module: SFTModule, batch: dict) -> torch.Tensor:
    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def test_sft_and_distillation_divide_by_the_same_global_window_count():
    """World size 2: both losses are sum / (global window tokens / 2) * accumulation, not sum / local tokens."""
    batch = make_batches(make_examples(4), 2, 2)[0]
    local = int(batch["window_answer_tokens"])
    batch["global_window_answer_tokens"] = torch.tensor(local + 17)  # the other device holds 17 more tokens
    normaliser = (local + 17) / 2
    sft = attach_trainer(_sft_module(), accumulate=2, world_size=2)
    torch.testing.assert_close(
        sft.training_step(batch, 0).detach(), _ce_sum(sft, batch).detach() / normaliser * 2
    )
    distill = attach_trainer(make_module(), accumulate=2, world_size=2)
    loss = distill.training_step(batch, 0)
    mask = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        t = distill.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        d = distill.draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(
        loss.detach(), forward_kl(t[:, :-1][mask], d[:, :-1][mask]).sum() / normaliser * 2
    )


def test_sft_single_device_loss_is_bit_identical_to_the_plain_formula():
    batch = make_batches(make_examples(4), 2, 2)[0]
    batch["global_window_answer_tokens"] = torch.tensor(999)  # ignored on one device
    sft = attach_trainer(_sft_module(), accumulate=2)
    loss = sft.training_step(batch, 0).detach()
    expected = _ce_sum(sft, batch).detach() / batch["window_answer_tokens"].clamp_min(1) * 2
    assert torch.equal(loss, expected)
    assert torch.equal(attach_trainer(_sft_module()).training_step(batch, 0).detach(), expected / 2)
