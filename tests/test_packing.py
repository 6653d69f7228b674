"""Packed rows (`<stage>.packing`, specdistill/data/packing.py): several examples end to end in one row, each
attending only to itself, so that training on packed rows is training on the examples one by one."""

from __future__ import annotations

import json
import re

import pytest
import torch

from specdistill.data.collate import Collator
from specdistill.data.packing import PackingCollator, pack, padding_share
from specdistill.data.tokenize import IGNORE_INDEX
from specdistill.drafts import target_pass
from specdistill.drafts.base import target_states
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask
from tests.helpers import TINY, check_ok, run_train, stage_overrides
from tests.test_eagle3 import AUX, DRAFT_V, TARGETS, V, tiny_head, tiny_target
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

PAD = 0


def examples(lengths: list[int], prompt: int = 3, seed: int = 0) -> list[dict]:
    """Examples of `lengths` tokens whose first `prompt` tokens are the prompt (labels -100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, V, (n,), generator=gen)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels, "example_id": 10 + i})
    return out


def test_first_fit_packs_every_example_once_within_max_length():
    lengths = [5, 9, 3, 7, 2, 10]
    rows = pack(lengths, 12)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 12 for row in rows)
    assert rows == [[0, 2, 4], [1], [3], [5]]  # first fit, in order: 5 + 3 + 2 share a row
    with pytest.raises(ValueError, match="does not fit a packed row of max_length=8"):
        pack([4, 9], 8)


def test_packing_says_how_much_padding_it_saves():
    # batches of 2: [5, 9] pads 4 of 18 unpacked and packs into rows of 9 and 5 (no room for both in 12)
    plain, packed, rows = padding_share([5, 9, 3, 3], 2, 12)
    assert rows == 3 and plain == pytest.approx(1 - 20 / 24) and packed == pytest.approx(1 - 20 / 24)
    assert padding_share([3, 3, 3, 3], 4, 12) == (0.0, 0.0, 1)


def test_a_packed_batch_restarts_positions_and_names_each_examples_place():
    batch = PackingCollator(PAD, 12)(examples([5, 9, 3]))
    assert batch["input_ids"].shape == (2, 9)  # [5 + 3] and [9]
    assert batch["position_ids"][0].tolist() == [
        0,
        1,
        2,
        3,
        4,
        0,
        1,
        2,
        3,
    ]  # the pad continues the last example
    assert batch["segment_ids"][0].tolist() == [0] * 5 + [1] * 3 + [-1]
    assert batch["attention_mask"][0].tolist() == [1] * 8 + [0]
    assert batch["segments"].tolist() == [[0, 0, 5, 10], [0, 5, 3, 12], [1, 0, 9, 11]]
    assert batch["example_id"].tolist() == [10, 12, 11]
    # the second example's first token is a prompt token: no answer row predicts across the boundary
    assert not answer_mask(batch["labels"])[0, 4]
    with pytest.raises(ValueError, match="no attached columns"):
        PackingCollator(PAD, 12)(
            [{**e, "scores": torch.zeros(len(e["input_ids"]) - 1)} for e in examples([5])]
        )


@pytest.mark.parametrize("name", ["gpt_neox", "llama", "qwen2_sliding", "gemma2"])
def test_the_target_sees_each_packed_example_as_alone(name):
    target = tiny_target(name)
    parts = examples([6, 11, 4], seed=1)
    packed = PackingCollator(PAD, 24)(parts)
    with torch.no_grad():
        last, states = target_states(target, packed, AUX)
        for (row, start, length, _), part in zip(packed["segments"].tolist(), parts, strict=True):
            alone_last, alone = target_states(target, Collator(PAD)([part]), AUX)
            torch.testing.assert_close(last[row, start : start + length], alone_last[0], rtol=1e-4, atol=1e-5)
            for layer in AUX:
                torch.testing.assert_close(states[layer][row, start : start + length], alone[layer][0],
                                           rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("name", TARGETS)
def test_training_time_test_on_packed_rows_is_training_on_each_example(name):
    """The EAGLE-3 head's unrolled rows on a packed batch are the rows of the examples one by one (same count, same
    weighted divergence): no chain is anchored in, and no attention reads, another example of the row."""
    target, kind = tiny_target(name), Eagle3(draft_vocab_size=DRAFT_V, aux_layer_ids=AUX, ttt_steps=4)
    head = tiny_head(target)
    parts = examples([9, 7, 12, 5], seed=2)

    def loss(batch):
        keep = answer_mask(batch["labels"])
        with torch.no_grad():
            rows = kind.training_rows(head, batch, keep, target_pass(target, batch, keep, V, AUX), V)
            divergence = ForwardKL().rows(rows.target, rows.draft)
        return len(divergence), float((rows.weight * divergence).sum())

    packed = PackingCollator(PAD, 24)(parts)
    assert packed["input_ids"].shape[0] < len(parts)
    count, total = loss(packed)
    alone = [loss(Collator(PAD)([part])) for part in parts]
    assert count == sum(n for n, _ in alone)
    assert total == pytest.approx(sum(t for _, t in alone), rel=1e-4)
    # and nothing of the next example leaks in: changing it leaves the first example's rows as they were
    changed = [parts[0], {**parts[2], "input_ids": torch.flip(parts[2]["input_ids"], [0])}]
    first = PackingCollator(PAD, 24)(changed)
    assert first["input_ids"].shape[0] == 1
    assert loss(first)[1] - loss(Collator(PAD)([changed[1]]))[1] == pytest.approx(alone[0][1], rel=1e-4)


@pytest.mark.slow
def test_train_py_trains_an_eagle3_head_on_packed_rows_of_its_cached_states(tmp_path):
    """`distill.packing=true` with the target's states cached: validation before training reads the same rows as
    without packing (the same `val/kl`), and AdaSPEC trains on packed rows against the packed head; a kind that
    cannot pack is refused by name."""
    pair = [*TINY, "models.target.config.num_hidden_layers=4", "draft=eagle3", "draft.draft_vocab_size=128",
            "draft.ttt_steps=3", "draft.aux_layer_ids=[0,1,3]"]  # fmt: skip
    results = {}
    for packing in (False, True):
        run = tmp_path / f"packing_{packing}"
        check_ok(run_train(["stage=distill", *pair, *stage_overrides("distill", 2), "distill.target_cache=bfloat16",
                            f"distill.packing={packing}", "distill.max_length=384", f"hydra.run.dir={run}"]))  # fmt: skip
        results[packing] = json.loads((run / "result.json").read_text())
    assert results[True]["val/kl_before"] == pytest.approx(results[False]["val/kl_before"], rel=1e-4)
    assert results[True]["train/answer_tokens"] == results[False]["train/answer_tokens"]
    packed = re.search(
        r"packing: the (\d+) training examples in (\d+) rows",
        (tmp_path / "packing_True" / "train.log").read_text(),
    )
    assert packed and int(packed[2]) < int(packed[1])
    adaspec = tmp_path / "adaspec"
    check_ok(run_train(["stage=adaspec", *pair, *stage_overrides("adaspec", 1), "+adaspec.packing=true",
                        f"adaspec.reference={tmp_path / 'packing_True' / 'export'}", "adaspec.cached_scores=false",
                        "adaspec.max_length=384", f"hydra.run.dir={adaspec}"]))  # fmt: skip
    assert 0 < json.loads((adaspec / "result.json").read_text())["val/expected_acceptance"] <= 1
    refused = run_train(["stage=distill", *TINY, "distill.packing=true", f"hydra.run.dir={tmp_path / 'no'}"])
    assert refused.returncode != 0 and "distill.packing=true with the" in refused.stderr
    assert "draft=eagle3" in refused.stderr
