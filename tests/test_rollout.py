"""SpecDec++ rollouts: soft labels, batched generation, teacher-forced labelling, resumable storage, hidden cache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from specdistill.decoding.sampling import SamplingConfig
from specdistill.head_data import RolloutCollator, build_hidden_cache, load_hidden_cache
from specdistill.rollout import labelling_config, load_rollouts, run_rollouts, soft_labels
from specdistill.rollout.generate import label_responses, race_sample, sample_responses
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

VOCAB = 48  # real vocabulary; the models carry 2 padded rows more
EOS, PAD = 1, 0


def tiny_lm(seed: int, hidden: int = 32) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=VOCAB + 2,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return GPTNeoXForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pair() -> tuple[GPTNeoXForCausalLM, GPTNeoXForCausalLM]:
    return tiny_lm(0, hidden=32), tiny_lm(1, hidden=16)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17]]


# --- soft labels on hand-checked positions ----------------------------------------------------------------------


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_soft_labels_hand_checked():
    target = torch.stack([_logits([0.5, 0.3, 0.1, 0.1])] * 3)
    draft = torch.stack([_logits([0.25, 0.25, 0.25, 0.25])] * 3)
    tokens = torch.tensor([0, 2, 1])
    # T = 1: min(1, 0.5/0.25) = 1, 0.1/0.25 = 0.4, 0.3/0.25 -> 1
    labels = soft_labels(target, draft, tokens, SamplingConfig())
    torch.testing.assert_close(labels, torch.tensor([1.0, 0.4, 1.0]))
    # T = 0.5 squares the target probabilities (q stays uniform): p(2) = 0.01 / 0.36
    labels = soft_labels(target, draft, tokens, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(labels, torch.tensor([1.0, (0.01 / 0.36) / 0.25, 1.0]))
    # top-p 0.75 drops the two 0.1 tokens of the target (tail mass 0.2 <= 0.25): p = [0.625, 0.375, 0, 0];
    # the draft [0.4, 0.3, 0.2, 0.1] loses only token 3 (tail 0.1): q = [4/9, 3/9, 2/9, 0]
    draft_skewed = torch.stack([_logits([0.4, 0.3, 0.2, 0.1])] * 3)
    labels = soft_labels(target, draft_skewed, tokens, SamplingConfig(top_p=0.75))
    torch.testing.assert_close(labels, torch.tensor([1.0, 0.0, 1.0]))
    labels = soft_labels(target, draft_skewed, torch.tensor([1, 1, 0]), SamplingConfig(top_p=0.75))
    torch.testing.assert_close(labels, torch.tensor([1.0, 1.0, 1.0]))
    flipped = torch.stack([_logits([0.1, 0.1, 0.3, 0.5])] * 1)
    labels = soft_labels(flipped, draft_skewed[:1], torch.tensor([1]), SamplingConfig(top_p=0.75))
    # p = [0, 0, 0.375, 0.625] -> token 1 has p = 0
    torch.testing.assert_close(labels, torch.tensor([0.0]))


def test_soft_labels_greedy_and_temperature_one_option():
    target = torch.stack([_logits([0.5, 0.3, 0.1, 0.1]), _logits([0.1, 0.6, 0.2, 0.1])])
    draft = torch.stack([_logits([0.4, 0.3, 0.2, 0.1]), _logits([0.4, 0.3, 0.2, 0.1])])
    tokens = torch.tensor([0, 0])  # the draft's argmax on both rows
    greedy = SamplingConfig(temperature=0.0)
    torch.testing.assert_close(soft_labels(target, draft, tokens, greedy), torch.tensor([1.0, 0.0]))
    raw = labelling_config(greedy, label_temperature_one=True)
    assert raw == SamplingConfig()
    torch.testing.assert_close(soft_labels(target, draft, tokens, raw), torch.tensor([1.0, 0.25]))
    assert labelling_config(greedy, label_temperature_one=False) is greedy


def test_soft_labels_reject_impossible_tokens_and_shapes():
    target = torch.stack([_logits([0.5, 0.3, 0.1, 0.1])])
    draft = torch.stack([_logits([0.4, 0.3, 0.2, 0.1])])
    with pytest.raises(ValueError, match="zero probability"):
        soft_labels(target, draft, torch.tensor([3]), SamplingConfig(top_k=2))
    with pytest.raises(ValueError, match="real vocabulary"):
        soft_labels(target, draft[:, :3], torch.tensor([0]), SamplingConfig())


# --- generation and teacher-forced labelling ----------------------------------------------------------------


def generate_responses(target, prompts, sampling, max_new_tokens, eos, pad=PAD, vocab=VOCAB, seeds=None):
    seeds = range(len(prompts)) if seeds is None else seeds
    return sample_responses(target, prompts, sampling, max_new_tokens, eos, pad, vocab, seeds=list(seeds))[0]


def test_greedy_generation_equals_transformers_generate(pair):
    target, _ = pair
    responses = generate_responses(target, PROMPTS, SamplingConfig(temperature=0.0), 6, eos=47)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        expected = target.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=47,
            pad_token_id=PAD,
            suppress_tokens=[VOCAB, VOCAB + 1],  # the padded embedding rows are not the vocabulary
        )[0, len(prompt) :].tolist()
        assert response == expected


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.5, top_p=0.9)]
)
def test_batched_generation_matches_single_and_stops_rows_at_eos(pair, sampling):
    """Left padding and finished rows leaving the batch change nothing: each row's draws are its own."""
    target, _ = pair
    never = VOCAB + 1  # a padded row: never generated, so every response runs 8 tokens
    batched = generate_responses(target, PROMPTS, sampling, 8, eos=never)
    singles = [
        generate_responses(target, [p], sampling, 8, eos=never, seeds=[i])[0] for i, p in enumerate(PROMPTS)
    ]
    assert batched == singles and all(len(r) == 8 for r in batched)
    # an EOS that ends one response at its third token while others go on (rows leave the batch one by one)
    row, eos = next((i, r[2]) for i, r in enumerate(batched) if r[2] not in r[:2])
    stopped = generate_responses(target, PROMPTS, sampling, 8, eos=eos)
    for full, short in zip(batched, stopped, strict=True):
        assert short == (full[: full.index(eos) + 1] if eos in full else full)
    assert len(stopped[row]) == 3 and max(map(len, stopped)) == 8
    assert stopped == [
        generate_responses(target, [p], sampling, 8, eos=eos, seeds=[i])[0] for i, p in enumerate(PROMPTS)
    ]


def test_generation_uses_our_warping_and_real_vocabulary(pair):
    target, _ = pair
    greedy = generate_responses(target, PROMPTS, SamplingConfig(temperature=0.0), 5, eos=47)
    top1 = generate_responses(target, PROMPTS, SamplingConfig(temperature=1.5, top_k=1), 5, eos=47)
    assert top1 == greedy  # top-k 1 sampling is argmax: our warper is the one in use
    sampled = generate_responses(target, PROMPTS * 4, SamplingConfig(temperature=3.0), 8, 47, PAD, 10)
    assert all(0 <= t < 10 for response in sampled for t in response)
    assert len({tuple(r) for r in sampled}) > len(PROMPTS)  # seeds differ per row: repeated prompts differ


def test_race_sample_draws_each_row_from_its_distribution_and_generator():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.0, 0.0, 0.0, 0.1, 0.9]])
    n = 20_000
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = torch.stack([race_sample(probs, generators) for _ in range(n)])  # (n, 2)
    for row in range(2):
        frequencies = torch.bincount(draws[:, row], minlength=5).double() / n
        # 4 standard errors of a frequency at most sqrt(0.25 / n): a wrong sampler fails, a right one passes
        torch.testing.assert_close(frequencies, probs[row].double(), atol=4 * (0.25 / n) ** 0.5, rtol=0)
        assert frequencies[probs[row] == 0].sum() == 0  # never a zero-probability token
    # a row's draws depend on its own generator only, not on the other rows of the batch
    alone, batch = (
        [torch.Generator().manual_seed(2)],
        [torch.Generator().manual_seed(9), torch.Generator().manual_seed(2)],
    )
    flat = torch.full((1, 5), 0.2)  # uniform: every draw is informative
    assert [int(race_sample(flat, alone)) for _ in range(50)] == [
        int(race_sample(flat.repeat(2, 1), batch)[1]) for _ in range(50)
    ]


def test_each_draw_is_the_warped_target_distribution_with_the_rows_seed(pair):
    """Replaying a row's generator on teacher-forced target logits redraws the same response, token by token."""
    target, _ = pair
    sampling = SamplingConfig(temperature=1.2, top_k=20, top_p=0.95)
    seeds = [11, 12, 13, 14, 15]
    responses, logits = sample_responses(target, PROMPTS, sampling, 7, 47, PAD, VOCAB, seeds=seeds)
    for prompt, response, seed, row_logits in zip(PROMPTS, responses, seeds, logits, strict=True):
        with torch.no_grad():
            forced = target(input_ids=torch.tensor([prompt + response])).logits[
                0, len(prompt) - 1 : -1, :VOCAB
            ]
        torch.testing.assert_close(row_logits, forced, atol=1e-5, rtol=1e-5)
        generator = torch.Generator().manual_seed(seed)
        replay = [int(race_sample(sampling.warp_probs(row[None]), [generator])) for row in forced]
        assert replay == response
    with pytest.raises(ValueError, match="one seed per prompt"):
        sample_responses(target, PROMPTS, sampling, 7, 47, PAD, VOCAB, seeds=seeds[:2])


def test_labels_match_direct_min_ratio_per_example(pair):
    target, draft = pair
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    responses = generate_responses(target, PROMPTS, sampling, 6, eos=47)
    tokens, labels = label_responses(
        target, draft, PROMPTS, responses, sampling, PAD, VOCAB, torch.Generator().manual_seed(0)
    )
    checked = 0
    for prompt, response, ys, ays in zip(PROMPTS, responses, tokens, labels, strict=True):
        assert len(ys) == len(response) == len(ays)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            p_logits = target(input_ids=ids).logits[0, :, :VOCAB]
            q_logits = draft(input_ids=ids).logits[0, :, :VOCAB]
        for i, (y, a) in enumerate(zip(ys, ays, strict=True)):
            pos = len(prompt) + i - 1  # the position whose logits predict response token i
            p = sampling.warp_probs(p_logits[pos])[y].item()
            q = sampling.warp_probs(q_logits[pos])[y].item()
            assert q > 0, "draft token outside the warped draft support"
            assert a == pytest.approx(min(1.0, p / q), rel=1e-4, abs=1e-6)
            checked += 1
    assert checked >= 10


def test_labels_from_the_generation_scores_equal_the_teacher_forced_pass(pair):
    """One-pass rollouts: the generation's raw logits give the two-pass labels and the same draft tokens."""
    target, draft = pair
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    responses, logits = sample_responses(target, PROMPTS, sampling, 6, EOS, PAD, VOCAB, seeds=[3, 4, 5, 6, 7])
    assert sum(map(len, responses)) >= 15
    assert [t.shape for t in logits] == [(len(r), VOCAB) for r in responses]
    two_pass = label_responses(
        target, draft, PROMPTS, responses, sampling, PAD, VOCAB, torch.Generator().manual_seed(0)
    )
    one_pass = label_responses(
        target,
        draft,
        PROMPTS,
        responses,
        sampling,
        PAD,
        VOCAB,
        torch.Generator().manual_seed(0),
        target_logits=logits,
    )
    assert one_pass[0] == two_pass[0]
    for row, expected in zip(one_pass[1], two_pass[1], strict=True):
        assert row == pytest.approx(expected, abs=1e-5)
    assert any(0 < a < 1 for row in one_pass[1] for a in row)  # labels that depend on the target's logits
    with pytest.raises(ValueError, match="target_logits"):
        label_responses(target, draft, PROMPTS, responses, sampling, PAD, VOCAB, target_logits=logits[:-1])


# --- storage, resume --------------------------------------------------------------------------------------------


def _run(pair, out_dir, **kwargs):
    target, draft = pair
    return run_rollouts(
        target,
        draft,
        PROMPTS,
        out_dir,
        sampling=SamplingConfig(temperature=0.9, top_p=0.95),
        max_new_tokens=5,
        batch_size=2,
        shard_size=2,
        seed=7,
        vocab_size=VOCAB,
        **kwargs,
    )


class Interrupt(RuntimeError):
    pass


@pytest.fixture(scope="module")
def rollout_dir(pair, tmp_path_factory):
    """One uninterrupted run shared by the tests below."""
    out_dir = tmp_path_factory.mktemp("rollouts")
    _run(pair, out_dir)
    return out_dir


def test_rollouts_resume_without_duplicates_or_loss(pair, rollout_dir, tmp_path):
    reference = load_rollouts(rollout_dir)

    def stop_after_first(shard: int) -> None:
        if shard == 0:
            raise Interrupt

    with pytest.raises(Interrupt):
        _run(pair, tmp_path / "resumed", on_shard_done=stop_after_first)
    shards = sorted(p.name for p in (tmp_path / "resumed" / "shards").iterdir())
    assert shards == ["shard_00000"]
    with pytest.raises(ValueError, match="incomplete"):
        load_rollouts(tmp_path / "resumed")

    seen = []
    resumed = _run(pair, tmp_path / "resumed", on_shard_done=seen.append)
    assert seen == [1, 2]  # the finished shard was not redone
    assert resumed["prompt_index"][:] == list(range(len(PROMPTS)))
    assert resumed["prompt_ids"][:] == PROMPTS
    assert resumed.to_dict() == reference.to_dict()  # same draws as an uninterrupted run
    assert load_rollouts(tmp_path / "resumed").to_dict() == reference.to_dict()
    for row in reference:
        assert len(row["response_ids"]) == len(row["draft_tokens"]) == len(row["labels"]) >= 1
        assert all(0.0 <= a <= 1.0 for a in row["labels"])


def test_rollouts_refuse_other_settings(pair, rollout_dir):
    target, draft = pair
    with pytest.raises(ValueError, match="seed"):
        run_rollouts(target, draft, PROMPTS, rollout_dir, SamplingConfig(temperature=0.9, top_p=0.95), 5, 2, 2,
                     seed=8, vocab_size=VOCAB)  # fmt: skip


def test_reused_responses_label_another_draft_exactly_as_a_fresh_run(
    pair, rollout_dir, tmp_path, monkeypatch
):
    """A second draft labels the first run's responses: the same dataset as generating them again, no generation."""
    target, _ = pair
    other = (target, target)  # another draft: here the target itself
    fresh = _run(other, tmp_path / "fresh")

    import specdistill.rollout.run as run_module

    def no_generation(*args, **kwargs):
        raise AssertionError("responses were generated although they could be reused")

    monkeypatch.setattr(run_module, "sample_responses", no_generation)
    reused = _run(other, tmp_path / "reused", responses_from=rollout_dir)
    # reused responses are labelled by a teacher-forced target pass, fresh ones from the generation's own logits
    labels, fresh_labels = reused.to_dict().pop("labels"), fresh.to_dict().pop("labels")
    assert {k: v for k, v in reused.to_dict().items() if k != "labels"} == {
        k: v for k, v in fresh.to_dict().items() if k != "labels"
    }
    for row, fresh_row in zip(labels, fresh_labels, strict=True):
        assert row == pytest.approx(fresh_row, abs=1e-5)
    assert reused["response_ids"][:] == load_rollouts(rollout_dir)["response_ids"][:]


def test_reused_responses_must_come_from_the_same_settings(pair, rollout_dir, tmp_path):
    target, draft = pair
    with pytest.raises(ValueError, match="seed"):
        run_rollouts(target, draft, PROMPTS, tmp_path / "other", SamplingConfig(temperature=0.9, top_p=0.95), 5, 2,
                     2, seed=8, vocab_size=VOCAB, responses_from=rollout_dir)  # fmt: skip


def test_collator_and_hidden_cache(pair, rollout_dir, tmp_path):
    _, draft = pair
    rollouts = load_rollouts(rollout_dir)
    collate = RolloutCollator(pad_token_id=PAD, mixing_ratio=0.3, seed=3)
    rows = [rollouts[i] for i in range(3)]
    batch = collate(rows)
    assert torch.equal(collate(rows)["input_ids"], batch["input_ids"])  # seeded mixing is reproducible
    for i, row in enumerate(rows):
        start, n = len(row["prompt_ids"]), len(row["response_ids"])
        assert not batch["loss_mask"][i, :start].any() and not batch["loss_mask"][i, start + n :].any()
        mixed = batch["input_ids"][i, start : start + n]
        is_draft = batch["loss_mask"][i, start : start + n]
        assert torch.equal(mixed[is_draft], torch.tensor(row["draft_tokens"])[is_draft])
        assert torch.equal(mixed[~is_draft], torch.tensor(row["response_ids"])[~is_draft])
        torch.testing.assert_close(
            batch["head_labels"][i, start : start + n][is_draft], torch.tensor(row["labels"])[is_draft]
        )

    cache = build_hidden_cache(draft, rollout_dir, tmp_path / "cache", 0.3, seed=3, batch_size=2, shard_size=2,
                               dtype="float32")  # fmt: skip
    assert len(cache) == len(rollouts)
    cached = load_hidden_cache(tmp_path / "cache", expected_mixing_ratio=0.3).with_format("torch")
    with torch.no_grad():
        hidden = draft.base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
    for i in range(3):
        torch.testing.assert_close(
            cached[i]["hidden"], hidden[i][batch["loss_mask"][i]], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(cached[i]["head_labels"], batch["head_labels"][i][batch["loss_mask"][i]])
    with pytest.raises(ValueError, match="mixing_ratio"):
        load_hidden_cache(tmp_path / "cache", expected_mixing_ratio=0.15)
    assert math.isfinite(float(cached[0]["hidden"].sum()))
