"""The evaluation protocol (`specdistill/evaluation/protocol.py`): selection on validation, report on test, ratios."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from specdistill.decoding.policies import HeuristicSchedule, Oracle
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.decoding.toy import toy_pair
from specdistill.drafts.prompt_lookup.hybrid import HybridProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer
from specdistill.evaluation import protocol
from specdistill.evaluation.protocol import EvalProtocol, evaluate_drafts, format_ratios, policy_ratios
from specdistill.evaluation.report import Report, ReportEntry
from specdistill.models.acceptance_head import AcceptanceHead
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

V = 40
GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def models_():
    target, draft = toy_pair(V)
    return target, {"noisy": draft, "self": target}


def _prompts(count: int, offset: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(offset)
    return [
        {
            "prompt_ids": torch.randint(0, V, (4,), generator=gen).tolist(),
            "record": {"id": i},
            "example_id": i,
        }
        for i in range(count)
    ]


def _run(target, drafts, heads, policies, **overrides):
    kwargs = dict(
        fixed_lengths=[1, 3], head_thresholds=[0.3, 0.5], head_score_newest=[False, True], head_min_draft_length=2,
        max_draft_length=6, test_prompts=_prompts(2), selection_prompts=_prompts(2, offset=1),
        selection_split="validation", split="test", tokenizer=None, vocab_size=V, sampling=GREEDY,
        max_new_tokens=10, seed=0, warmup=0, repeats=1, score_fn=lambda ids, record: float(len(ids)),
        task_metric_name="length",
    )  # fmt: skip
    kwargs |= overrides
    protocol = EvalProtocol(**{f.name: kwargs.pop(f.name) for f in fields(EvalProtocol) if f.name in kwargs})
    return evaluate_drafts(target, drafts, heads, policies, protocol, **kwargs)


def test_protocol_reports_every_configuration_in_the_stage_order(models_):
    target, drafts = models_
    heads = {"noisy": AcceptanceHead(target.config.hidden_size, num_blocks=1)}
    policies = {"heuristic": HeuristicSchedule(), "oracle": Oracle()}
    result = _run(target, drafts, heads, policies)
    assert list(policies) == ["heuristic", "oracle"]  # the caller's dict is not changed
    noisy, same = result.choices["noisy"], result.choices["self"]
    grid = [
        "acceptance_head_h0.3",
        "acceptance_head_h0.3_newest",
        "acceptance_head_h0.5",
        "acceptance_head_h0.5_newest",
    ]
    assert noisy["best_k"] in (1, 3) and sorted(noisy["tokens_per_second_by_k"]) == [1, 3]
    assert list(noisy["tokens_per_second_by_head"]) == grid
    assert noisy["best_head"] in {f"noisy_{name}" for name in grid}
    assert "best_head" not in same  # no head for this draft
    names = [e.name for e in result.report.entries]
    assert names == [
        "autoregressive",
        f"noisy/fixed_k{noisy['best_k']}",
        "noisy/heuristic",
        "noisy/oracle",
        *(f"noisy/noisy_{name}" for name in grid),
        f"self/fixed_k{same['best_k']}",
        "self/heuristic",
        "self/oracle",
    ]
    base = result.report.baseline
    for e in result.report.entries:  # greedy: lossless everywhere
        assert [o["tokens"] for o in e.outputs] == [o["tokens"] for o in base.outputs]
        assert len(e.stats.draft_length_hist) <= 7  # the engine's bound, 6, for every configuration
    settings = result.report.settings
    assert settings["split"] == "test" and settings["max_draft_length"] == 6
    assert settings["selection"] == {"split": "validation", **result.choices}
    assert settings["ratios"] == result.ratios
    assert set(result.ratios) == {
        "noisy/acceptance_head_over_best_fixed_k",
        "noisy/acceptance_head_over_oracle",
    }
    # greedy: every configuration's outputs compared with the target's, and the count in the table's last line
    agreement = settings["greedy_agreement"]
    assert list(agreement) == names[1:]
    assert all(a["identical"] == a["outputs"] == 2 and not a["departures"] for a in agreement.values()), (
        agreement
    )
    assert format_ratios(result.choices, result.ratios) in result.table
    assert result.table.splitlines()[-1] == (
        f"greedy outputs identical to the target's (float32): {len(names) - 1} of {len(names) - 1} configurations "
        "on all 2 prompts"
    )
    assert "length" in result.table.splitlines()[0]


def test_selection_uses_the_selection_prompts_and_the_engine_bound(models_, monkeypatch):
    target, drafts = models_
    calls: list[dict] = []

    def fake_best_fixed_length(target, draft, ks, **kwargs):
        calls.append({"what": "k", "ks": ks, **kwargs})
        return 3, {k: float(k) for k in ks}

    def fake_select_policy(target, draft, candidates, **kwargs):
        calls.append({"what": "h", "candidates": sorted(candidates), **kwargs})
        return "acceptance_head_h0.5", dict.fromkeys(candidates, 1.0)

    monkeypatch.setattr(protocol, "best_fixed_length", fake_best_fixed_length)
    monkeypatch.setattr(protocol, "select_policy", fake_select_policy)
    selection_prompts = _prompts(1, offset=7)
    heads = {"noisy": AcceptanceHead(target.config.hidden_size, num_blocks=1)}
    result = _run(
        target, {"noisy": drafts["noisy"]}, heads, {"oracle": Oracle()}, selection_prompts=selection_prompts,
        head_score_newest=False, selection_repeats=2,
    )  # fmt: skip
    assert [c["what"] for c in calls] == ["k", "h"]
    for call in calls:
        assert call["prompts"] is selection_prompts and call["split"] == "validation"
        assert call["max_draft_length"] == 6 and call["repeats"] == 2
    assert calls[1]["candidates"] == ["acceptance_head_h0.3", "acceptance_head_h0.5"]
    assert result.choices["noisy"]["best_head"] == "noisy_acceptance_head_h0.5"
    assert result.report.entry("noisy/fixed_k3").policy == "fixed_k3"


def test_prompt_lookup_gets_its_own_k_and_one_row_after_the_drafts(models_, monkeypatch):
    target, drafts = models_
    lookup = PromptLookupProposer(V, torch.device("cpu"))
    chosen: list[tuple[object, list]] = []
    real_best_fixed_length = protocol.best_fixed_length

    def recording(target, draft, ks, **kwargs):
        chosen.append((draft, kwargs["prompts"]))
        return real_best_fixed_length(target, draft, ks, **kwargs)

    monkeypatch.setattr(protocol, "best_fixed_length", recording)
    selection_prompts = _prompts(2, offset=1)
    result = _run(
        target, {"noisy": drafts["noisy"]}, {}, {"oracle": Oracle()}, lookups={"prompt_lookup": lookup},
        selection_prompts=selection_prompts,
    )  # fmt: skip
    k = result.choices["prompt_lookup"]["best_k"]
    assert chosen[-1] == (lookup, selection_prompts)  # chosen on the selection prompts, like a draft's K
    names = [e.name for e in result.report.entries]
    assert (
        names[-1] == f"prompt_lookup/fixed_k{k}" and sum(n.startswith("prompt_lookup/") for n in names) == 1
    )
    row = result.report.entry(f"prompt_lookup/fixed_k{k}")
    assert [o["tokens"] for o in row.outputs] == [o["tokens"] for o in result.report.baseline.outputs]
    assert row.stats.draft_forwards == 0
    with pytest.raises(ValueError, match="have the names of drafts"):
        _run(target, drafts, {}, {}, lookups={"noisy": lookup})


def test_a_hybrids_draft_rounds_take_the_k_chosen_for_its_draft(models_):
    target, drafts = models_
    hybrid = HybridProposer(PromptLookupProposer(V, torch.device("cpu")), drafts["noisy"])
    result = _run(
        target, {"noisy": drafts["noisy"]}, {}, {}, lookups={"noisy+prompt_lookup": hybrid},
        hybrids={"noisy+prompt_lookup": "noisy"},
    )  # fmt: skip
    chosen = result.choices["noisy"]["best_k"]
    assert hybrid.draft_length == chosen == result.choices["noisy+prompt_lookup"]["draft_k"]
    assert (
        f"noisy+prompt_lookup: K={result.choices['noisy+prompt_lookup']['best_k']} (the draft's rounds K={chosen})"
        in (result.table)
    )
    with pytest.raises(ValueError, match="must name a lookup"):
        _run(
            target,
            drafts,
            {},
            {},
            lookups={"noisy+prompt_lookup": hybrid},
            hybrids={"noisy+prompt_lookup": "x"},
        )


def test_protocol_refuses_bad_inputs(models_):
    target, drafts = models_
    with pytest.raises(ValueError, match="test split"):
        _run(target, drafts, {}, {}, selection_split="test")
    with pytest.raises(ValueError, match="not evaluated"):
        _run(target, drafts, {"other": AcceptanceHead(8, 1)}, {})
    with pytest.raises(ValueError, match="max_draft_length"):
        _run(target, drafts, {}, {}, fixed_lengths=[2, 8])


def _entry(name: str, tokens_per_second: float) -> ReportEntry:
    stats = DecodingStats(sequences=1, generated_tokens=int(tokens_per_second), wall_time_s=1.0)
    draft, _, policy = name.partition("/")
    return ReportEntry(name, draft, policy, stats)


def test_ratios_and_their_text():
    report = Report(
        [_entry("d/fixed_k3", 100.0), _entry("d/d_acceptance_head_h0.5", 125.0), _entry("d/oracle", 250.0)]
    )
    choices = {"d": {"best_k": 3, "best_head": "d_acceptance_head_h0.5"}, "e": {"best_k": 2}}
    ratios = policy_ratios(report, choices)
    assert ratios == {"d/acceptance_head_over_best_fixed_k": 1.25, "d/acceptance_head_over_oracle": 0.5}
    assert format_ratios(choices, ratios).splitlines() == [
        "chosen on the selection split (tokens/s): d: K=3, d_acceptance_head_h0.5; e: K=2",
        "d/acceptance_head_over_best_fixed_k = 1.250",
        "d/acceptance_head_over_oracle = 0.500",
    ]


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["plain"], ["acceptance_head_h0.5"]),
        (["withdrawn"], ["acceptance_head_h0.5_withdrawn"]),
        (["plain", "padded"], ["acceptance_head_h0.5", "acceptance_head_h0.5_padded"]),
        (
            ["plain", "padded", "withdrawn"],
            ["acceptance_head_h0.5", "acceptance_head_h0.5_withdrawn", "acceptance_head_h0.5_padded"],
        ),
    ],
)
def test_head_candidates_are_the_stops_asked_for_and_only_plain_stops_are_padded(
    stops, expected, monkeypatch
):
    whole_block = object()  # stands for a drafter that drafts its whole block in one pass (DFlash's mark)
    monkeypatch.setattr(protocol, "drafts_whole_blocks", lambda draft: draft is whole_block)
    head = AcceptanceHead(8, 1, input="proposer")
    settings = dict(fixed_lengths=[1], head_thresholds=[0.5], head_min_draft_length=1, selection_split="validation",
                    split="test", sampling=GREEDY, max_new_tokens=4, head_stops=stops)  # fmt: skip
    cost = {1: 1.0, 2: 1.0, 3: 1.5}
    candidates = protocol.head_candidates(head, whole_block, EvalProtocol(**settings, padding_cost=cost))
    assert list(candidates) == expected
    assert [policy.withdraws_stop for policy in candidates.values()] == [
        n.endswith("_withdrawn") for n in expected
    ]
    # a chain pays a step per candidate: its stops are never padded
    chain = protocol.head_candidates(head, object(), EvalProtocol(**settings, padding_cost=cost))
    assert list(chain) == [name for name in expected if not name.endswith("_padded")]
    if "padded" in stops:
        with pytest.raises(ValueError, match="padding_cost"):
            protocol.head_candidates(head, whole_block, EvalProtocol(**settings))
