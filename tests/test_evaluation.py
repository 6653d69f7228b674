"""Evaluation runner, report files, table and the validation-only selection helpers."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdistill.decoding.policies import FixedLength, HeuristicSchedule, Oracle
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.toy import toy_pair
from specdistill.evaluation import best_fixed_length, evaluate_policies, format_table, select_policy
from specdistill.evaluation.report import TABLE_COLUMNS
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 40
GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def models_():
    target, draft = toy_pair(V)
    return target, {"noisy": draft, "self": target}


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {f"w{i}": i for i in range(V - 1)} | {"</s>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="w0")


def _prompts(count: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "prompt_ids": torch.randint(0, V - 1, (4,), generator=gen).tolist(),
            "record": {"id": i},
            "example_id": i,
        }
        for i in range(count)
    ]


def _even_fraction(ids, record):
    """Toy task metric on token ids; record 2 is 'unscorable'."""
    if record["id"] == 2:
        return None
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def test_report_has_baseline_and_every_draft_policy_pair(models_, tmp_path):
    target, drafts = models_
    policies = {"k3": FixedLength(3), "heuristic": HeuristicSchedule(2)}
    report = evaluate_policies(
        target, drafts, policies, _prompts(), _even_fraction, None, GREEDY, 12, seed=0, vocab_size=V,
        max_draft_length=6,
    )  # fmt: skip
    names = [e.name for e in report.entries]
    assert names == ["autoregressive", "noisy/k3", "noisy/heuristic", "self/k3", "self/heuristic"]
    base = report.baseline
    for e in report.entries:
        # greedy decoding is lossless: every configuration reproduces the baseline's outputs and task metric
        assert [o["tokens"] for o in e.outputs] == [o["tokens"] for o in base.outputs]
        assert e.task_metric == base.task_metric and e.num_scored == 2
        assert e.stats.generated_tokens == 3 * 12
    data = report.to_dict()
    metrics = {e["name"]: e["metrics"] for e in data["entries"]}
    assert report.settings["max_draft_length"] == 6
    assert max(len(e.stats.draft_length_hist) for e in report.entries) <= 7  # no round above the bound
    assert metrics["autoregressive"]["speedup"] == 1.0
    assert metrics["autoregressive"]["acceptance_rate"] is None
    assert metrics["self/k3"]["acceptance_rate"] == 1.0 and metrics["self/k3"]["tokens_per_target_call"] > 3
    assert 0 < metrics["noisy/k3"]["acceptance_rate"] < 1
    assert all(set(TABLE_COLUMNS) <= set(m) for m in metrics.values())
    assert all(m["speedup"] > 0 for m in metrics.values())

    report.save(tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(data))
    assert len((tmp_path / "outputs.jsonl").read_text().splitlines()) == 5 * 3
    for png in ("acceptance_by_position.png", "draft_length_hist.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_scoring_through_the_tokenizer(models_, tokenizer):
    target, drafts = models_
    seen: list[str] = []

    def score(text, record):
        seen.append(text)
        return float(text.startswith("w"))

    report = evaluate_policies(
        target,
        {"noisy": drafts["noisy"]},
        {"oracle": Oracle()},
        _prompts(2),
        score,
        tokenizer,
        SamplingConfig(temperature=1.0),
        10,
        seed=3,
        task_metric_name="starts_with_w",
        split="validation",
        max_draft_length=4,
    )
    assert len(seen) == 4 and all(isinstance(t, str) for t in seen)
    assert report.settings["vocab_size"] == V and report.settings["split"] == "validation"
    assert "starts_with_w" in format_table(report)
    for e in report.entries:  # EOS (the tokenizer's) ends outputs: nothing after it
        for o in e.outputs:
            assert V - 1 not in o["tokens"][:-1]


def test_format_table_is_a_pure_readable_function():
    entry = {
        "name": "autoregressive",
        "metrics": {c: None for c in TABLE_COLUMNS} | {"tokens_per_second": 123.4567, "speedup": 1.0},
        "task_metric": 0.5,
    }
    other = {"name": "d/k4", "metrics": {c: 0.25 for c in TABLE_COLUMNS}, "task_metric": None}
    data = {"settings": {"task_metric_name": "accuracy"}, "entries": [entry, other]}
    table = format_table(data)
    assert table == format_table(data)
    lines = table.splitlines()
    assert lines[0].split() == ["name", *TABLE_COLUMNS, "accuracy"]
    assert lines[2].split() == ["autoregressive", "-", "-", "-", "-", "-", "123.457", "1.000", "0.500"]
    assert lines[3].split() == ["d/k4", *(["0.250"] * len(TABLE_COLUMNS)), "-"]


def test_selection_refuses_the_test_split(models_):
    target, drafts = models_
    with pytest.raises(ValueError, match="test split"):
        best_fixed_length(target, drafts["noisy"], [1, 2], _prompts(1), GREEDY, 8, split="test", vocab_size=V)
    with pytest.raises(ValueError, match="criterion"):
        select_policy(
            target,
            drafts["noisy"],
            {"a": FixedLength(1)},
            _prompts(1),
            GREEDY,
            8,
            "validation",
            criterion="accuracy",
            vocab_size=V,
        )


def test_the_engine_bound_reaches_every_engine(models_):
    target, drafts = models_
    never = HeuristicSchedule(initial=50)  # a schedule longer than any bound: only the engine stops it
    report = evaluate_policies(
        target, {"self": drafts["self"]}, {"long": never}, _prompts(1), None, None, GREEDY, 20,
        vocab_size=V, baseline=False, max_draft_length=3,
    )  # fmt: skip
    assert report.entries[0].stats.draft_length_hist == [0, 0, 0, 5]  # 5 rounds of 3 (+1 bonus) = 20 tokens
    best, values = select_policy(
        target, drafts["self"], {"long": never, "k1": FixedLength(1)}, _prompts(1), GREEDY, 20, "validation",
        criterion="mean_draft_length", vocab_size=V, max_draft_length=3,
    )  # fmt: skip
    assert best == "long" and values["long"] == 3.0
    with pytest.raises(ValueError, match="max_draft_length"):
        best_fixed_length(
            target,
            drafts["self"],
            [2, 8],
            _prompts(1),
            GREEDY,
            8,
            "validation",
            vocab_size=V,
            max_draft_length=6,
        )


def test_best_fixed_length_picks_by_the_criterion(models_):
    target, drafts = models_
    prompts = _prompts(2)
    # a self-draft accepts everything, so tokens per target call grows with K: the longest K must win
    best, values = best_fixed_length(
        target,
        drafts["self"],
        [1, 2, 4],
        prompts,
        GREEDY,
        12,
        split="validation",
        criterion="tokens_per_target_call",
        vocab_size=V,
    )
    assert best == 4 and values[1] < values[2] < values[4]
    best, values = best_fixed_length(
        target, drafts["noisy"], [1, 3], prompts, GREEDY, 12, "validation", vocab_size=V
    )
    assert best in (1, 3) and all(v > 0 for v in values.values())


def test_bad_inputs_are_rejected(models_):
    target, drafts = models_
    args = (target, drafts, {"k": FixedLength(2)})
    with pytest.raises(ValueError, match="no prompts"):
        evaluate_policies(*args, [], None, None, GREEDY, 4, vocab_size=V)
    with pytest.raises(ValueError, match="example_id"):
        evaluate_policies(*args, [{"prompt_ids": [1], "record": {}}], None, None, GREEDY, 4, vocab_size=V)
    with pytest.raises(ValueError, match="vocab_size"):
        evaluate_policies(*args, _prompts(1), None, None, GREEDY, 4)
    with pytest.raises(ValueError, match="unknown draft or policy"):
        evaluate_policies(*args, _prompts(1), None, None, GREEDY, 4, vocab_size=V, combinations=[("x", "k")])


class _Logged(FixedLength):
    """FixedLength that logs its label each time the engine starts a sequence with it (`reset`)."""

    def __init__(self, k: int, label: str, log: list[str]) -> None:
        super().__init__(k)
        self.label, self.log = label, log

    def reset(self, max_draft_length: int | None = None) -> None:
        self.log.append(self.label)


def _policies() -> dict:
    # persistent: the schedule carries its length across sequences, so sharing it between drafts would mix them
    return {"k3": FixedLength(3), "sched": HeuristicSchedule(2, persistent=True)}


def _counters(report) -> dict:
    timing = ("target_time_s", "draft_time_s", "wall_time_s", "oracle_probe_time_s")
    return {
        e.name: {k: v for k, v in e.stats.to_dict().items() if k not in timing and k != "tokens_per_second"}
        for e in report.entries
    }


def test_interleaving_decodes_exactly_what_each_configuration_decodes_alone(models_):
    target, drafts = models_
    sampling = SamplingConfig(temperature=1.0)  # sampled, so a shifted seed or mixed policy state would show
    prompts = _prompts(3)
    kw = dict(vocab_size=V, seed=5, warmup=2, max_draft_length=6)
    joint = evaluate_policies(target, drafts, _policies(), prompts, _even_fraction, None, sampling, 10, **kw)
    alone = [
        evaluate_policies(
            target, drafts, {}, prompts, _even_fraction, None, sampling, 10, combinations=[], **kw
        )
    ]
    for d in drafts:
        for p in _policies():
            alone.append(
                evaluate_policies(
                    target,
                    drafts,
                    _policies(),
                    prompts,
                    _even_fraction,
                    None,
                    sampling,
                    10,
                    combinations=[(d, p)],
                    baseline=False,
                    **kw,
                )  # fmt: skip
            )
    alone_entries = {e.name: e for r in alone for e in r.entries}
    assert [e.name for e in joint.entries] == list(alone_entries)
    for e in joint.entries:
        assert e.outputs == alone_entries[e.name].outputs
        assert e.task_metric == alone_entries[e.name].task_metric
    # every counter but the timings: same rounds, draft lengths, acceptances
    assert _counters(joint) == {k: v for r in alone for k, v in _counters(r).items()}

    # repeats: stats summed over the passes, outputs and scores from the first only (same seeds: same tokens)
    twice = evaluate_policies(
        target, drafts, {"k3": FixedLength(3)}, prompts, _even_fraction, None, sampling, 10, repeats=2, **kw
    )
    assert twice.settings["repeats"] == 2
    for e in twice.entries:
        once = joint.entry(e.name)
        assert e.outputs == once.outputs and e.task_metric == once.task_metric and e.num_scored == 2
        assert e.stats.sequences == 2 * len(prompts)
        assert e.stats.generated_tokens == 2 * once.stats.generated_tokens
    with pytest.raises(ValueError, match="repeats"):
        evaluate_policies(target, drafts, {}, prompts, None, None, GREEDY, 4, vocab_size=V, repeats=0)


def test_configurations_take_turns_prompt_by_prompt(models_):
    target, drafts = models_
    log: list[str] = []
    policies = {name: _Logged(k, name, log) for name, k in (("a", 1), ("b", 2), ("c", 3))}
    evaluate_policies(
        target, {"noisy": drafts["noisy"]}, policies, _prompts(4), None, None, GREEDY, 3,
        vocab_size=V, baseline=False, warmup=1, repeats=2,
    )  # fmt: skip
    # warm-up of every configuration first, then per prompt (4 prompts x 2 passes) all three, rotating by one
    assert log[:3] == ["a", "b", "c"]
    rounds = [log[3 + 3 * s : 6 + 3 * s] for s in range(8)]
    assert len(log) == 3 + 3 * 8
    rotations = [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rounds == [rotations[s % 3] for s in range(8)]
