"""AdaSPEC's metric beside the speed results: every draft's acceptance_rate at one fixed draft length, and the
SpecDec++ prompt templates (`task.prompt_style=specdecpp`)."""

from __future__ import annotations

import pytest

from specdistill.decoding.policies import HeuristicSchedule
from specdistill.tasks.alpaca import Alpaca
from specdistill.tasks.gsm8k import GSM8K
from specdistill.tasks.humaneval import HumanEval
from tests.test_eval_protocol import _run
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def pair():
    from specdistill.decoding.toy import toy_pair

    target, draft = toy_pair(40)
    return target, {"noisy": draft, "self": target}


def test_every_draft_reports_its_acceptance_rate_at_the_fixed_length(pair):
    target, drafts = pair
    result = _run(target, drafts, {}, {"heuristic": HeuristicSchedule()}, fixed_lengths=[1, 3],
                  acceptance_draft_length=4)  # fmt: skip
    names = [e.name for e in result.report.entries]
    alpha = result.report.settings["acceptance_at_fixed_length"]
    assert alpha["draft_length"] == 4
    for draft in drafts:
        # K = 4 is not in the selection grid, so it is an extra configuration beside the chosen K
        assert (
            names.index(f"{draft}/fixed_k4")
            == names.index(f"{draft}/fixed_k{result.choices[draft]['best_k']}") + 1
        )
        entry = result.report.entry(f"{draft}/fixed_k4")
        assert entry.stats.rounds > 0 and max(entry.stats.draft_length_hist[5:], default=0) == 0
        assert alpha[draft] == entry.stats.metrics()["acceptance_rate"]
    assert alpha["self"] == 1.0 and alpha["noisy"] < 1.0  # the target drafting for itself is always accepted
    assert "acceptance_rate at fixed K = 4 (AdaSPEC's alpha): noisy " in result.table


def test_a_fixed_length_already_chosen_is_not_run_twice(pair):
    target, drafts = pair
    result = _run(target, {"self": drafts["self"]}, {}, {}, fixed_lengths=[4], acceptance_draft_length=4)
    assert [e.name for e in result.report.entries] == ["autoregressive", "self/fixed_k4"]
    assert result.report.settings["acceptance_at_fixed_length"]["self"] == 1.0
    assert "acceptance_at_fixed_length" not in _run(target, drafts, {}, {}).report.settings


def test_specdecpp_prompts_are_the_public_codes_llama2_chat_templates():
    alpaca = Alpaca(prompt_style="specdecpp")
    assert (
        alpaca.prompt({"instruction": "Name a colour.", "input": "", "output": "Red"})
        == "[INST] Name a colour. [/INST]"
    )
    assert (
        alpaca.prompt({"instruction": "Add.", "input": "1 and 2", "output": "3"})
        == "[INST] Add.\nInput: 1 and 2 [/INST]"
    )
    gsm8k = GSM8K(prompt_style="specdecpp").prompt({"question": "What is 2+2?", "answer": "#### 4"})
    assert gsm8k.startswith("[INST] Below is an instruction that describes a task.")
    assert gsm8k.endswith("### Instruction:\nWhat is 2+2?\n\n### Response: Let's think step by step. [/INST]")
    humaneval = HumanEval(prompt_style="specdecpp").prompt({"prompt": "def f():\n"})
    assert "Create a Python script for this problem:\ndef f():\n\n\n### Response: [/INST]" in humaneval
    assert GSM8K().prompt({"question": "Q", "answer": "#### 1"}) != gsm8k  # the default stays AdaSPEC's
    with pytest.raises(ValueError, match="no prompt_style 'specdecpp'"):
        from specdistill.tasks.mbpp import MBPP

        MBPP(prompt_style="specdecpp")
