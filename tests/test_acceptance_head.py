"""Acceptance head (model, save/load), its weighted BCE loss and validation metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.head_data import (
    RolloutCollator,
    RolloutDataModule,
    build_hidden_cache,
    judged_head_inputs,
    mix_sequence,
)
from specdistill.losses.head_bce import (
    auroc_rejection,
    binary_kl,
    expected_calibration_error,
    reliability_bins,
    weighted_bce_terms,
    weighted_bce_with_logits,
    write_reliability_diagram,
)
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.rollout import run_rollouts
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)


def _random_head(hidden: int = 16, blocks: int = 3, seed: int = 0) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, blocks)
    with torch.no_grad():  # leave the zero init so the blocks matter in the tests
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head


# --- head -------------------------------------------------------------------------------------------------------


def test_head_blocks_have_their_own_weights_and_shapes():
    head = _random_head(hidden=16, blocks=3)
    weights = [block.linear.weight for block in head.blocks]
    assert len(weights) == 3
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1])
    assert head(torch.randn(2, 5, 16)).shape == (2, 5)
    assert head(torch.randn(16)).shape == ()


def test_head_forward_matches_formula():
    head = _random_head(hidden=8, blocks=2)
    x = torch.randn(4, 8)
    expected = x
    for block in head.blocks:
        expected = expected + F.silu(expected @ block.linear.weight.T + block.linear.bias)
    expected = (expected @ head.out.weight.T + head.out.bias).squeeze(-1)
    torch.testing.assert_close(head(x), expected)


def test_untrained_blocks_are_identity():
    head = AcceptanceHead(8, 3)
    x = torch.randn(3, 8)
    torch.testing.assert_close(head.blocks(x), x)


def test_head_save_load_round_trip(tmp_path):
    head = _random_head(hidden=16, blocks=3)
    head.save(tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["head_config.json", "model.safetensors"]
    loaded = AcceptanceHead.load(tmp_path / "head")
    assert loaded.config() == {"hidden_size": 16, "num_blocks": 3, "input": "candidate"}
    x = torch.randn(7, 16)
    torch.testing.assert_close(loaded(x), head(x), rtol=0, atol=0)


def test_head_load_missing_files_and_bad_width(tmp_path):
    with pytest.raises(FileNotFoundError, match="head_config.json"):
        AcceptanceHead.load(tmp_path)
    with pytest.raises(ValueError, match="hidden_size"):
        AcceptanceHead(8)(torch.randn(2, 9))


# --- loss -------------------------------------------------------------------------------------------------------


def test_weighted_bce_equals_formula_on_small_example():
    logits = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([1.0, 0.25, 0.0])
    s = torch.sigmoid(logits)
    w_acc, w_rej = 1.0, 6.0
    num = sum(
        w_rej * (1 - a) * -math.log(1 - si) + w_acc * a * -math.log(si)
        for si, a in zip(s.tolist(), labels.tolist(), strict=True)
    )
    den = sum(w_rej * (1 - a) + w_acc * a for a in labels.tolist())
    loss = weighted_bce_with_logits(logits, labels, w_acc=w_acc, w_rej=w_rej)
    assert loss.item() == pytest.approx(float(num / den), rel=1e-6)
    # hand value: den = 1 + (6 * 0.75 + 0.25) + 6 = 11.75
    assert float(den) == pytest.approx(11.75)


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_equal_weights_reduce_to_soft_label_bce(weight):
    torch.manual_seed(0)
    logits, labels = torch.randn(50) * 3, torch.rand(50)
    expected = F.binary_cross_entropy_with_logits(logits, labels)
    torch.testing.assert_close(weighted_bce_with_logits(logits, labels, w_acc=weight, w_rej=weight), expected)


def test_rejection_weight_pulls_predictions_down():
    labels = torch.full((1,), 0.5)
    grid = torch.linspace(-4, 4, 801)
    losses = torch.stack([weighted_bce_with_logits(x.view(1), labels, 1.0, 6.0) for x in grid])
    best = torch.sigmoid(grid[losses.argmin()]).item()
    # minimiser of 6*0.5*(-log(1-s)) + 0.5*(-log s): s = 0.5 / (0.5 + 3) = 1/7
    assert best == pytest.approx(1 / 7, abs=2e-3)


def test_loss_stable_for_extreme_logits_and_empty_input():
    logits = torch.tensor([200.0, -200.0], requires_grad=True)
    loss = weighted_bce_with_logits(logits, torch.tensor([0.0, 1.0]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx((6 * 200 + 200) / 7, rel=1e-5)
    empty = torch.zeros(0, requires_grad=True)
    zero = weighted_bce_with_logits(empty, torch.zeros(0))
    zero.backward()
    assert zero.item() == 0.0


def test_loss_terms_sum_across_splits_equal_whole():
    torch.manual_seed(1)
    logits, labels = torch.randn(20), torch.rand(20)
    terms, weights = weighted_bce_terms(logits, labels)
    split = (terms[:7].sum() + terms[7:].sum()) / (weights[:7].sum() + weights[7:].sum())
    torch.testing.assert_close(split, weighted_bce_with_logits(logits, labels))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        weighted_bce_with_logits(torch.zeros(2), torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="same length"):
        weighted_bce_with_logits(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="positive"):
        weighted_bce_with_logits(torch.zeros(2), torch.zeros(2), w_rej=0.0)


# --- metrics ----------------------------------------------------------------------------------------------------


def test_binary_kl_matches_direct_formula_and_is_zero_at_labels():
    labels = torch.tensor([0.0, 0.3, 1.0, 0.9])
    logits = torch.tensor([0.5, -0.2, 1.5, 3.0])
    s = torch.sigmoid(logits)
    direct = torch.tensor(
        [
            -math.log(1 - s[0]),
            0.3 * math.log(0.3 / s[1]) + 0.7 * math.log(0.7 / (1 - s[1])),
            -math.log(s[2]),
            0.9 * math.log(0.9 / s[3]) + 0.1 * math.log(0.1 / (1 - s[3])),
        ]
    )
    torch.testing.assert_close(binary_kl(logits, labels), direct)
    at_labels = torch.logit(torch.tensor([0.2, 0.7]))
    torch.testing.assert_close(
        binary_kl(at_labels, torch.tensor([0.2, 0.7])), torch.zeros(2), atol=1e-6, rtol=0
    )


def _pairwise_auroc(scores: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> float:
    num = den = 0.0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if i == j:
                continue
            w = float(pos[i] * neg[j])
            den += w
            num += w * (1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0)
    return num / den


def test_auroc_hard_labels_matches_torchmetrics_and_pairwise():
    from torchmetrics.functional.classification import binary_auroc

    torch.manual_seed(0)
    logits = torch.randn(40).round(decimals=1)  # rounding creates ties
    labels = (torch.rand(40) > 0.4).float()
    ours = auroc_rejection(logits, labels).item()
    reference = binary_auroc(-logits, (1 - labels).long()).item()
    assert ours == pytest.approx(reference, abs=1e-6)
    assert ours == pytest.approx(_pairwise_auroc(-logits, 1 - labels, labels), abs=1e-6)


def test_auroc_soft_labels_matches_pairwise_and_extremes():
    torch.manual_seed(3)
    logits, labels = torch.randn(15).round(decimals=1), torch.rand(15)
    expected = _pairwise_auroc(-logits, 1 - labels, labels)
    assert auroc_rejection(logits, labels).item() == pytest.approx(expected, abs=1e-6)
    hard = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert auroc_rejection(torch.tensor([3.0, 2.0, -1.0, -2.0]), hard).item() == 1.0
    assert auroc_rejection(torch.tensor([-3.0, -2.0, 1.0, 2.0]), hard).item() == 0.0
    with pytest.raises(ValueError, match="undefined"):
        auroc_rejection(torch.randn(3), torch.ones(3))


def test_ece_and_bins_on_hand_example():
    probs = torch.tensor([0.05, 0.15, 0.15, 0.95])
    labels = torch.tensor([0.0, 0.5, 0.1, 1.0])
    logits = torch.logit(probs)
    mean_pred, mean_label, count = reliability_bins(logits, labels, num_bins=10)
    assert count.tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 1]
    torch.testing.assert_close(mean_label[1], torch.tensor(0.3))
    # |0 - 0.05| * 1/4 + |0.3 - 0.15| * 2/4 + |1 - 0.95| * 1/4
    expected = 0.05 / 4 + 0.15 / 2 + 0.05 / 4
    assert expected_calibration_error(logits, labels, 10).item() == pytest.approx(expected, abs=1e-5)


def test_reliability_diagram_png(tmp_path):
    torch.manual_seed(0)
    path = write_reliability_diagram(torch.randn(100), torch.rand(100), tmp_path / "sub" / "rel.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- mixing and the Lightning module ----------------------------------------------------------------------------


def test_mix_sequence_puts_loss_only_on_draft_tokens():
    response = torch.arange(100, 400)
    draft = torch.arange(1000, 1300)  # disjoint from the response, so every position is identifiable
    mixed, is_draft = mix_sequence(response, draft, r=0.15, generator=torch.Generator().manual_seed(0))
    assert is_draft.dtype == torch.bool
    assert torch.equal(mixed[is_draft], draft[is_draft]) and torch.equal(
        mixed[~is_draft], response[~is_draft]
    )
    assert 0.75 < is_draft.float().mean() < 0.95  # about 1 - r of the positions hold draft tokens
    same = torch.arange(5)
    _, all_draft = mix_sequence(same, same.clone(), r=0.0)
    assert all_draft.all()  # a draft token equal to the target token still carries the loss
    _, none_draft = mix_sequence(same, same.clone(), r=1.0)
    assert not none_draft.any()
    with pytest.raises(ValueError, match="mixing ratio"):
        mix_sequence(same, same, r=1.5)


@pytest.fixture(scope="module")
def head_setup(tmp_path_factory):
    """Rollouts of a tiny GPT-NeoX pair (vocab 40) and a matching hidden-state cache."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from specdistill.decoding.sampling import SamplingConfig

    def lm(seed: int, hidden: int) -> GPTNeoXForCausalLM:
        torch.manual_seed(seed)
        config = GPTNeoXConfig(vocab_size=40, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=2 * hidden, max_position_embeddings=64, eos_token_id=1)  # fmt: skip
        return GPTNeoXForCausalLM(config).eval()

    target, draft = lm(0, 32), lm(1, 16)
    root = tmp_path_factory.mktemp("head")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 40, (int(torch.randint(2, 6, (), generator=gen)),), generator=gen).tolist()
               for _ in range(12)]  # fmt: skip
    run_rollouts(target, draft, prompts, root / "rollouts", SamplingConfig(temperature=1.0), max_new_tokens=8,
                 batch_size=6, shard_size=6, seed=0, vocab_size=40)  # fmt: skip
    build_hidden_cache(draft, root / "rollouts", root / "cache", mixing_ratio=0.15, seed=0, batch_size=6,
                       shard_size=12, dtype="float32")  # fmt: skip
    return draft, root


def _module(draft, cache: bool = False, lr: float = 1e-2, hidden_cache=None):
    from functools import partial

    from specdistill.modules.acceptance_head import AcceptanceHeadModule
    from specdistill.utils.schedules import cosine

    torch.manual_seed(0)
    return AcceptanceHeadModule(
        head=AcceptanceHead(16, 3),
        draft=None if cache else draft,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(cosine, warmup_fraction=0.03),
        cache_hidden_states=cache,
        hidden_cache=hidden_cache,
    )


def _datamodule(root, cache: bool = False):
    return RolloutDataModule(str(root / "rollouts"), batch_size=4, mixing_ratio=0.15, val_fraction=0.25, seed=0,
                             hidden_cache_dir=str(root / "cache") if cache else None)  # fmt: skip


def _trainer(root, **kwargs):
    import lightning as L

    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, default_root_dir=str(root))  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def test_head_module_fit_lowers_loss_and_checkpoint_has_no_draft(head_setup, tmp_path):
    draft, root = head_setup
    module, data = _module(draft), _datamodule(root)
    before = _trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
    assert set(before) == {"val/head_bce", "val/binary_kl", "val/auroc_rejection", "val/ece"}
    trainer = _trainer(tmp_path, max_steps=12, enable_checkpointing=False, check_val_every_n_epoch=1000)
    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data, verbose=False)[0]
    assert after["val/head_bce"] < before["val/head_bce"]
    assert (tmp_path / "reliability_diagram.png").is_file()
    trainer.save_checkpoint(tmp_path / "head.ckpt")
    state = torch.load(tmp_path / "head.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert state and all(key.startswith("head.") for key in state)
    assert all(p.requires_grad is False for p in draft.parameters())


def test_head_module_on_cached_hidden_states_matches_running_the_draft(head_setup, tmp_path):
    draft, root = head_setup
    live = _trainer(tmp_path).validate(_module(draft), datamodule=_datamodule(root), verbose=False)[0]
    cached_module = _module(draft, cache=True)
    assert cached_module.draft is None
    cached = _trainer(tmp_path).validate(
        cached_module, datamodule=_datamodule(root, cache=True), verbose=False
    )[0]
    for key, value in live.items():  # same head, same fixed validation mixing: same metrics
        assert cached[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    _trainer(tmp_path, max_steps=2).fit(cached_module, datamodule=_datamodule(root, cache=True))
    with pytest.raises(ValueError, match="hidden_states"):
        cached_module.head_logits({"loss_mask": torch.ones(1, 1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="hidden_size"):
        from specdistill.modules.acceptance_head import AcceptanceHeadModule

        AcceptanceHeadModule(AcceptanceHead(8), draft, optimizer=torch.optim.AdamW)


def test_a_hidden_cache_built_at_fit_start_trains_exactly_as_a_prebuilt_one(head_setup, tmp_path):
    """`HiddenCache` given to the module and the datamodule: `prepare_caches` builds it at the module's validation or
    fit start (the datamodule's rows are read only then), the same cache as `build_hidden_cache` (root/cache) to the
    bit, and training on it gives the same head, step for step; a later run reuses it without running the draft."""
    import copy

    import datasets

    from specdistill.head_data import HiddenCache
    from tests.test_selection_reference import _count_calls

    draft, root = head_setup
    frozen_draft = copy.deepcopy(draft)
    calls = _count_calls(frozen_draft)

    def lazy():
        cache = HiddenCache(frozen_draft, root / "rollouts", tmp_path / "lazy", batch_size=6, shard_size=12,
                            dtype="float32")  # fmt: skip
        module = _module(draft, cache=True, hidden_cache=cache)
        data = RolloutDataModule(str(root / "rollouts"), batch_size=4, mixing_ratio=0.15, val_fraction=0.25,
                                 seed=0, hidden_cache=cache)  # fmt: skip
        return cache, module, data

    cache, module, data = lazy()
    data.setup()
    with pytest.raises(RuntimeError, match="built at fit start"):
        data.train_set[0]
    validated = _trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]  # builds it first
    assert cache.ready and calls[0] == 2  # 12 rollouts in batches of 6
    prebuilt = _trainer(tmp_path).validate(_module(draft, cache=True), datamodule=_datamodule(root, cache=True),
                                           verbose=False)[0]  # fmt: skip
    assert validated == prebuilt

    def stored(path):
        return datasets.load_from_disk(str(path / "shards" / "shard_00000")).data.table

    assert stored(tmp_path / "lazy").equals(stored(root / "cache"))

    heads = []
    for trained, rows in (lazy()[1:], (_module(draft, cache=True), _datamodule(root, cache=True))):
        torch.manual_seed(1)  # the same shuffling of the training rows
        _trainer(tmp_path, max_steps=4, enable_checkpointing=False).fit(trained, datamodule=rows)
        heads.append(trained.head.state_dict())
    assert calls[0] == 2  # the second HiddenCache found the same key: reused
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[1])
    with pytest.raises(ValueError, match="not both"):
        RolloutDataModule(str(root / "rollouts"), hidden_cache=cache, hidden_cache_dir=str(root / "cache"))
    with pytest.raises(ValueError, match="cache_hidden_states=False"):
        from specdistill.modules.acceptance_head import AcceptanceHeadModule

        AcceptanceHeadModule(AcceptanceHead(16), draft, optimizer=torch.optim.AdamW, hidden_cache=cache)


def test_head_config_builds_the_head():
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "acceptance_head" / "default.yaml")
    head = instantiate(cfg.model, hidden_size=24)
    assert isinstance(head, AcceptanceHead)
    assert head.config() == {"hidden_size": 24, "num_blocks": 3, "input": "proposer"}
    assert head.input_size == 24 + 1
    assert (cfg.w_acc, cfg.w_rej, cfg.mixing_ratio) == (1.0, 6.0, 0.15)


# --- proposer heads ------------------------------------------------------------------------------------------------


def _proposer_row():
    return {"prompt_index": 3, "prompt_ids": [7, 8, 9], "response_ids": [10, 11, 12, 13],
            "draft_tokens": [20, 11, 22, 23], "labels": [0.25, 1.0, 0.5, 0.0]}  # fmt: skip


def test_proposer_collation_keeps_target_tokens_and_judges_the_proposing_states():
    row = _proposer_row()
    batch = RolloutCollator(pad_token_id=0, mixing_ratio=0.15, seed=None, head_input="proposer")(
        [row, {**row, "prompt_index": 4, "prompt_ids": [7]}]
    )
    # no mixing whatever r: the input is prompt + target response
    assert batch["input_ids"][0].tolist() == [7, 8, 9, 10, 11, 12, 13]
    assert batch["input_ids"][1].tolist() == [7, 10, 11, 12, 13, 0, 0]
    # response token i is proposed by the state at len(prompt) + i - 1
    assert batch["loss_mask"][0].tolist() == [False, False, True, True, True, True, False]
    assert batch["loss_mask"][1].tolist() == [True, True, True, True, False, False, False]
    assert batch["head_labels"][0, 2:6].tolist() == row["labels"]
    assert batch["draft_tokens"][0, 2:6].tolist() == row["draft_tokens"]
    assert batch["draft_tokens"][0, batch["loss_mask"][0].logical_not()].eq(0).all()
    candidate = RolloutCollator(0, 0.0, seed=0, head_input="candidate")([row])
    # a candidate head with r = 0 reads every draft token at its own position
    assert candidate["input_ids"][0].tolist() == [7, 8, 9, 20, 11, 22, 23]
    assert candidate["loss_mask"][0].tolist() == [False, False, False, True, True, True, True]
    with pytest.raises(ValueError, match="head_input"):
        RolloutCollator(head_input="newest")


def test_proposer_head_inputs_are_proposing_state_and_draft_probability(head_setup):
    from specdistill.decoding.sampling import SamplingConfig

    draft, _ = head_setup
    row = {**_proposer_row(), "response_ids": [10, 11, 12, 13], "draft_tokens": [20, 11, 22, 23]}
    batch = RolloutCollator(0, head_input="proposer")([row])
    sampling = SamplingConfig(temperature=0.7, top_k=5)
    inputs = judged_head_inputs(draft, batch, "proposer", sampling)
    assert inputs.shape == (4, draft.config.hidden_size + 1)
    with torch.no_grad():
        out = draft(input_ids=batch["input_ids"], output_hidden_states=True)
    for i, token in enumerate(row["draft_tokens"]):
        position = len(row["prompt_ids"]) + i - 1
        torch.testing.assert_close(inputs[i, :-1], out.hidden_states[-1][0, position])
        q = sampling.policy_probs(out.logits[0, position])[token]
        torch.testing.assert_close(inputs[i, -1], q)


@pytest.mark.parametrize("head_input", ["candidate", "proposer"])
def test_single_candidate_score_equals_batched_forward(head_input):
    torch.manual_seed(0)
    head = AcceptanceHead(12, num_blocks=2, input=head_input)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    hidden, probs = torch.randn(12), torch.randn(30).softmax(-1)
    expected = head.acceptance_probability(head.head_input(hidden[None], probs[None], torch.tensor([7])))
    assert head.score(hidden, probs, 7) == pytest.approx(float(expected), rel=1e-5)
    head.double()  # the decoding path follows dtype changes of the parameters
    assert head.score(hidden, probs, 7) == pytest.approx(float(expected), rel=1e-5)
    other = AcceptanceHead(12, num_blocks=2, input=head_input)
    other.load_state_dict(head.float().state_dict(), assign=True)  # new Parameter objects
    assert other.score(hidden, probs, 7) == pytest.approx(float(expected), rel=1e-5)
    assert head.input_size == 12 + (1 if head_input == "proposer" else 0)
    if head_input == "proposer":
        with pytest.raises(ValueError, match="proposer"):
            head.score(hidden)
        with pytest.raises(ValueError, match="width"):
            AcceptanceHead(11, input="proposer").score(hidden, probs, 7)
    with pytest.raises(ValueError, match="head input"):
        AcceptanceHead(12, input="newest")


def test_proposer_head_module_learns_and_cache_matches_running_the_draft(head_setup, tmp_path):
    from functools import partial

    from specdistill.decoding.sampling import SamplingConfig
    from specdistill.modules.acceptance_head import AcceptanceHeadModule

    draft, root = head_setup
    sampling = SamplingConfig(temperature=1.0)  # what head_setup's rollouts were labelled with

    def module(cache: bool):
        torch.manual_seed(0)
        return AcceptanceHeadModule(AcceptanceHead(16, 2, input="proposer"), None if cache else draft,
                                    optimizer=partial(torch.optim.AdamW, lr=1e-2), cache_hidden_states=cache,
                                    sampling=sampling)  # fmt: skip

    def data(cache_dir=None):
        return RolloutDataModule(str(root / "rollouts"), batch_size=4, val_fraction=0.25, seed=0,
                                 hidden_cache_dir=cache_dir, head_input="proposer")  # fmt: skip

    live_module = module(False)
    before = _trainer(tmp_path).validate(live_module, datamodule=data(), verbose=False)[0]
    build_hidden_cache(draft, root / "rollouts", tmp_path / "cache", batch_size=6, shard_size=12, dtype="float32",
                       head_input="proposer", sampling=sampling)  # fmt: skip
    cached = _trainer(tmp_path).validate(
        module(True), datamodule=data(str(tmp_path / "cache")), verbose=False
    )[0]
    for key, value in before.items():
        assert cached[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    trainer = _trainer(tmp_path, max_steps=12, enable_checkpointing=False, check_val_every_n_epoch=1000)
    trainer.fit(live_module, datamodule=data())
    assert (
        trainer.validate(live_module, datamodule=data(), verbose=False)[0]["val/head_bce"]
        < before["val/head_bce"]
    )
    with pytest.raises(ValueError, match="proposer head inputs, not candidate"):
        RolloutDataModule(str(root / "rollouts"), hidden_cache_dir=str(tmp_path / "cache")).setup()
