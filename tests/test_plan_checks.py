"""What a config plans over its whole run is checked before the first model loads (specdistill/plan_checks.py):
every phase of stage=sequential, a self-reference warm-up against the planned optimizer steps, and a draft continued
from an export of another kind; through train.py each ends in one line and exit code 64, with nothing trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.drafts import KIND_FILE
from specdistill.errors import EX_USAGE, ConfigError
from specdistill.export.hf import export_pretrained
from tests.helpers import TINY, run_train
from tests.test_user_errors import validated


def test_a_sequential_run_whose_draft_cannot_continue_is_refused_before_phase_one():
    with pytest.raises(ConfigError, match=r"phase 2 \(math\) continues .* cannot continue from an export"):
        validated("stage=sequential", "draft=eagle3")
    validated("stage=sequential", "draft=cut_layers_3")  # a cut continues from its export


def test_every_phase_of_a_sequential_run_checks_its_self_reference_warm_up():
    with pytest.raises(
        ConfigError,
        match=r"first scores at optimizer step 50, but the run has 20 \(phase 1 \(code\) of stage=sequential",
    ):
        validated("stage=sequential", "selector=adaspec_lagged", "+adaspec.trainer.max_steps=20")
    validated(
        "stage=sequential", "selector=adaspec_lagged", "selector.every=5", "+adaspec.trainer.max_steps=20"
    )


@pytest.mark.parametrize(
    ("preset", "key", "first"),
    [
        ("selector=adaspec_lagged", "selector.every", 12),
        ("selector=adaspec_ema", "selector.warmup_steps", 40),
    ],
)
def test_a_self_reference_that_never_scores_is_refused_naming_the_keys(preset, key, first):
    message = rf"first scores at optimizer step {first}, but the run has 12 .*selector.every .* selector.warmup_steps"
    with pytest.raises(ConfigError, match=message):
        validated("stage=pipeline", preset, f"{key}={first}", "trainer.max_steps=12")
    validated(
        "stage=pipeline", preset, f"{key}=11", "trainer.max_steps=12"
    )  # one step of selection is enough


def test_a_standalone_run_continued_from_an_eagle3_export_is_refused_before_loading(tmp_path: Path):
    tokenizer = arith_tokenizer(vocab_size=300, train_size=200)
    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    export = export_pretrained(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "head")
    (export / KIND_FILE).write_text(json.dumps({"kind": "eagle3", "settings": {"draft_vocab_size": 64}}))
    with pytest.raises(ConfigError, match=rf"distill.init={export} is an export of the eagle3 draft kind, but this "
                       r"run trains a standalone draft: continue it with draft=eagle3"):  # fmt: skip
        validated("stage=distill", f"distill.init={export}")
    (export / KIND_FILE).write_text(json.dumps({"kind": "standalone", "settings": {}}))
    validated("stage=distill", f"distill.init={export}")


def test_train_py_refuses_a_sequential_eagle3_run_in_one_line_before_anything_is_written(tmp_path: Path):
    proc = run_train(["stage=sequential", *TINY, "draft=eagle3", f"hydra.run.dir={tmp_path}"], timeout=300)
    assert proc.returncode == EX_USAGE, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: stage=sequential: phase 2") and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("sequential/*"))  # phase 1 never started


def test_a_selector_setting_out_of_range_is_refused_before_the_pipelines_earlier_steps():
    """The selector is built by the adaspec step only, after sft and distill have trained: its ranges are checked
    up front (a non-number too, which the warm-up check would otherwise meet first)."""
    with pytest.raises(ConfigError, match=r"selector\.decay=1\.5"):
        validated("stage=pipeline", "selector=adaspec_ema", "selector.decay=1.5")
    with pytest.raises(ConfigError, match=r"selector\.every='abc'"):
        validated("stage=pipeline", "selector=adaspec_lagged", "selector.every=abc", "trainer.max_steps=12")
