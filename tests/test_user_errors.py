"""Mistakes a user makes end in a message naming the problem, the key or file, and the fix, before anything loads:
settings (specdistill/validation.py), model folders, data rows (tasks/base.py), and train.py's one-line report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from specdistill.errors import EX_USAGE, ConfigError, DataError, InputFileError
from specdistill.validation import validate_config
from tests.helpers import ROOT, run_train


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra)


def validated(*overrides: str) -> None:
    """`validate_config` as train.py calls it, with Hydra's job config (the command-line overrides) in place."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            validate_config(cfg)
        finally:
            HydraConfig.instance().cfg = None


# -- settings -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", ["0", "-0.2", "1.5"])
def test_adaspec_k_out_of_range_is_refused_naming_the_key(k):
    with pytest.raises(ConfigError, match=rf"adaspec\.k={k}: .*\(0, 1\]"):
        validate_config(composed("stage=adaspec", f"adaspec.k={k}", "adaspec.reference=/nonexistent"))


@pytest.mark.parametrize("stage", ["sft", "distill", "adaspec", "acceptance_head", "rollout"])
@pytest.mark.parametrize("size", ["0", "-2"])
def test_a_batch_size_below_one_is_refused_naming_the_key(stage, size):
    """Before typed settings this ended in utils/batching.py's `ValueError: global batch 0 and world size 1 ...`."""
    reference = ["adaspec.reference=/nonexistent"] if stage == "adaspec" else []
    with pytest.raises(ConfigError, match=rf"^{stage}\.batch_size={size} must be an integer >= 1"):
        validate_config(composed(f"stage={stage}", f"{stage}.batch_size={size}", *reference))


# the embedded default caches the target's top-64, which a head reading the target's states cannot train from
EAGLE3_PIPELINE = ("draft=eagle3", "distill.target_cache=null", "adaspec.target_cache=null")


def test_adaspec_on_eagle3_heads_with_the_per_token_score_cache_is_refused_before_anything_loads():
    """The reference head scores the unrolled rows online; the cache holds one score per answer token."""
    with pytest.raises(ConfigError, match=r"adaspec\.cached_scores=true .* set adaspec\.cached_scores=false"):
        validated("stage=pipeline", *EAGLE3_PIPELINE, "adaspec.cached_scores=true")
    validated("stage=pipeline", *EAGLE3_PIPELINE, "adaspec.cached_scores=false")
    validated(
        "stage=pipeline", *EAGLE3_PIPELINE, "adaspec.cached_scores=true", "selector=draft_loss"
    )  # no reference


@pytest.mark.parametrize("strategy", ["trainer=deepspeed_zero3", "+trainer.strategy=deepspeed_stage_3"])
def test_eagle3_heads_under_zero3_are_refused_before_anything_loads(strategy):
    """ZeRO-3 would partition the target's embeddings and output layer, which the head reads directly."""
    with pytest.raises(ConfigError, match=r"^distill with the Eagle3 draft kind under DeepSpeed ZeRO-3: .*"
                       r"use trainer=deepspeed_zero2"):  # fmt: skip
        validated("stage=pipeline", *EAGLE3_PIPELINE, strategy)
    with pytest.raises(ConfigError, match=r"^adaspec with the Eagle3 draft kind under DeepSpeed ZeRO-3"):
        validated("stage=adaspec", "draft=eagle3", "adaspec.reference=/nonexistent", strategy)
    validated("stage=pipeline", *EAGLE3_PIPELINE, "trainer=deepspeed_zero2")
    validated("stage=pipeline", "draft=cut_layers_3", strategy)  # a cut draft shards like any causal LM


def test_a_key_no_setting_reads_is_refused_by_the_settings_themselves():
    """A key that reaches a stage's group without a '+' on the command line (a preset, a merged file) is refused when
    the typed settings are built, naming the key, the stage and the nearest key."""
    from omegaconf import open_dict

    from specdistill.stages.settings import build_settings

    cfg = composed("stage=adaspec", "adaspec.reference=/nonexistent")
    with open_dict(cfg):
        cfg.adaspec.cached_score = False
    with pytest.raises(ConfigError, match=r"^adaspec\.cached_score: the adaspec settings have no key .*did you mean "
                       r"adaspec\.cached_scores"):  # fmt: skip
        validate_config(cfg)
    with open_dict(cfg):
        del cfg.adaspec.cached_score
        cfg.adaspec.typo = 1
    with pytest.raises(ConfigError, match=r"^adaspec\.typo: the adaspec settings have no key 'typo'"):
        build_settings(cfg, "adaspec")  # what the stage itself runs first
    evaluate = composed("stage=evaluate")
    with open_dict(evaluate):
        evaluate.evaluate.acceptance_head.threshold = [0.5]
    with pytest.raises(ConfigError, match=r"evaluate\.acceptance_head\.threshold: .*did you mean "
                       r"evaluate\.acceptance_head\.thresholds"):  # fmt: skip
        build_settings(evaluate, "evaluate")


def test_a_plus_key_in_a_stage_group_is_accepted_only_if_a_setting_reads_it():
    with pytest.raises(ConfigError, match=r"\+adaspec\.typo=1: adds 'adaspec\.typo', which nothing reads"):
        validated("stage=adaspec", "adaspec.reference=/nonexistent", "+adaspec.typo=1")
    with pytest.raises(ConfigError, match=r"adds 'evaluate\.acceptance_head\.h'"):
        validated("stage=evaluate", "+evaluate.drafts.d=/nonexistent", "+evaluate.acceptance_head.h=0.5")
    # optimal_epochs is a setting the group leaves out (conf/tuning/ gives it for the pairs the paper ran)
    with pytest.raises(InputFileError):  # past the settings checks, to the missing reference folder
        validated("stage=adaspec", "adaspec.reference=/nonexistent", "+adaspec.optimal_epochs=3")


def test_out_of_range_settings_are_refused_naming_the_key():
    cases = {
        "acceptance_head.mixing_ratio=1.5": r"acceptance_head\.mixing_ratio=1\.5 must be a number in \[0, 1\]",
        "evaluate.fixed_lengths=[2,30]": r"evaluate\.fixed_lengths=\[2, 30\]: each K must be an integer in \[1, "
        r"evaluate\.max_draft_length=20\]",
        "evaluate.acceptance_head.score_newest=maybe": r"evaluate\.acceptance_head\.score_newest='maybe'",
        "evaluate.acceptance_head.stops=[plain,maybe]": r"evaluate\.acceptance_head\.stops=\['plain', 'maybe'\] must list",
        "evaluate.acceptance_head.stops=[padded]": r"names no stop to pad: add plain",
        "rollout.backend=vlm": r"rollout\.backend='vlm' is not one of transformers, vllm",
        "evaluate.prompt_lookup.min_ngram=0": r"evaluate\.prompt_lookup\.min_ngram=0 must be an integer >= 1",
        "evaluate.prompt_lookup.min_ngram=4": r"evaluate\.prompt_lookup\.min_ngram=4 is above "
        r"evaluate\.prompt_lookup\.max_ngram=3: give min_ngram <= max_ngram",
        "+evaluate.drafts.prompt_lookup=/x": r"evaluate\.drafts names a draft prompt_lookup.*prompt_lookup=null",
    }
    for override, message in cases.items():
        stage = override.lstrip("+").split(".")[0]
        extra = ["+evaluate.drafts.d=/nonexistent"] if stage == "evaluate" else []
        with pytest.raises(ConfigError, match=message):
            validate_config(composed(f"stage={stage}", override, *extra))


def test_adaspec_without_reference_is_refused_before_loading_unless_a_pipeline_step_fills_it():
    with pytest.raises(ConfigError, match=r"adaspec\.reference is not set.*<distill_run_dir>/export"):
        validate_config(composed("stage=adaspec"))
    with pytest.raises(ConfigError, match="adaspec.reference is not set"):
        validate_config(composed("pipeline.steps=[sft,adaspec]"))
    validate_config(composed())  # the default pipeline: distill fills it
    # a selector that reads no reference needs none; a self-reference scores with the draft's own earlier weights
    validate_config(composed("stage=adaspec", "selector=none", "adaspec.k=1"))  # k < 1 is refused for it
    validate_config(composed("stage=adaspec", "selector=adaspec_lagged"))


@pytest.mark.parametrize(
    ("needs", "self_referencing", "per_row", "cached", "source"),
    [
        (False, False, True, True, None),
        (True, True, True, True, "self"),
        (True, False, True, False, "kind"),
        (True, False, False, True, "cached"),
        (True, False, False, False, "online"),
    ],
)
def test_the_reference_source_is_one_of_five(needs, self_referencing, per_row, cached, source):
    from specdistill.stages.adaspec import reference_source

    assert reference_source(needs, self_referencing, per_row, cached) == source


def test_max_steps_zero_is_refused_instead_of_exporting_an_untrained_draft():
    with pytest.raises(ConfigError, match=r"max_steps=0 for stage distill.*untrained"):
        validate_config(composed("stage=distill", "++distill.trainer.max_steps=0"))


def test_evaluate_with_no_drafts_is_refused_instead_of_evaluating_a_random_draft():
    with pytest.raises(ConfigError, match=r"evaluate\.drafts is empty.*random weights.*\+evaluate\.drafts"):
        validate_config(composed("stage=evaluate"))


def test_misspelt_plus_key_is_refused_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"\+sft\.batch_sise=4: adds 'sft\.batch_sise'.*did you mean sft\.batch_size"
    ):
        validated("stage=sft", "+sft.batch_sise=4")
    with pytest.raises(ConfigError, match="adds 'adaspec_k'"):
        validated("stage=sft", "+adaspec_k=0.2")
    with pytest.raises(ConfigError, match=r"adds 'rollout\.vlm_python'.*did you mean rollout\.vllm_python"):
        validated("+rollout.vlm_python=/usr/bin/python3")


def test_plus_keys_that_something_reads_are_accepted(tmp_path):
    validated(
        "stage=sft",
        "+trainer.deterministic=true",  # a Lightning Trainer argument
        "++sft.trainer.max_steps=3",  # the stage's trainer block
        "+models.draft.config.rope_theta=500.0",  # a Hugging Face config argument
        "++sft.batch_size=4",  # ++ on an existing key overrides it
    )
    export = tmp_path / "export"
    _save_tiny_model(export)
    validated(
        "stage=evaluate", f"+evaluate.drafts.mine={export}"
    )  # an entry of a map that is empty by default
    validated(
        "+rollout.vllm.enforce_eager=true"
    )  # a vllm.LLM argument (the default pipeline has a rollout step)


# -- models ---------------------------------------------------------------------------------------------------------


def _save_tiny_model(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def test_mistyped_local_model_path_names_the_path_before_the_tokenizer_loads():
    path = "outputs/sft/2026-01-01_00-00-00/exprot"
    with pytest.raises(
        InputFileError, match=rf"models\.target\.pretrained_model_name_or_path={path}: no such"
    ):
        validate_config(composed("stage=sft", f"models.target.pretrained_model_name_or_path={path}"))


def test_model_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputFileError, match=r"no config\.json there"):
        validate_config(composed("stage=sft", f"models.target.pretrained_model_name_or_path={tmp_path}"))


def test_truncated_model_safetensors_is_named(tmp_path):
    _save_tiny_model(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(InputFileError, match=r"model\.safetensors is not a readable safetensors file.*again"):
        validate_config(composed("stage=sft", f"models.draft.pretrained_model_name_or_path={tmp_path}"))


def test_unreachable_hub_id_while_offline_is_named(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputFileError, match=r"nobody-here/no-such-model: .*not in the local cache.*offline"):
        validate_config(
            composed("stage=sft", "models.target.pretrained_model_name_or_path=nobody-here/no-such-model")
        )


def test_code_execution_without_isolation_is_refused_before_loading(monkeypatch):
    from specdistill.tasks import code_execution

    monkeypatch.setattr(code_execution, "namespaces_unavailable", lambda: "user namespaces are disabled")
    with pytest.raises(code_execution.SandboxUnavailableError, match="task.sandbox=process"):
        validate_config(composed("stage=sft", "task=mbpp", "task.execute_code=true"))
    validate_config(composed("stage=sft", "task=mbpp", "task.execute_code=true", "task.sandbox=process"))


# -- data -----------------------------------------------------------------------------------------------------------


def gsm8k_from(tmp_path: Path, lines: list[str]):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "task"), version_base="1.3"):
        return instantiate(
            compose("gsm8k", overrides=[f"data_files={{train: {path}, validation: {path}}}"])
        ), path


GOOD = json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"})


def test_malformed_json_line_names_the_file_and_line(tmp_path):
    task, path = gsm8k_from(tmp_path, [GOOD, GOOD, '{"question": "2 + 2?", "answer": "4\\n#### 4"', GOOD])
    with pytest.raises(DataError, match=rf"{path}, line 3: not valid JSON"):
        task.load_split("train")


def test_record_missing_a_field_names_the_row(tmp_path):
    task, path = gsm8k_from(tmp_path, [GOOD, json.dumps({"question": "3 + 3?"}), GOOD])
    with pytest.raises(DataError, match=rf"{path}.*train row 1 .*no value for \['answer'\]"):
        task.load_split("train")


def test_gsm8k_answer_without_hashes_names_the_row_before_training(tmp_path):
    no_marker = json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4, so 4"})
    task, path = gsm8k_from(tmp_path, [GOOD, GOOD, no_marker])
    with pytest.raises(DataError, match=r"train row 2 .*no '#### <number>' line"):
        task.load_split("train")


def test_every_example_longer_than_max_length_is_counted_and_warned(caplog):
    from specdistill.data.arith_tokenizer import arith_tokenizer
    from specdistill.data.datamodule import TaskDataModule
    from specdistill.tasks.arith import Arith

    task = Arith(sizes={"train": 12, "validation": 4, "test": 4})
    with caplog.at_level(logging.WARNING):
        TaskDataModule(task, arith_tokenizer(), max_length=12, batch_size=4).tokenized("train")
    assert "12 of 12 examples are longer than max_length=12 and are truncated" in caplog.text
    assert "every one of them: raise max_length" in caplog.text


# -- how train.py reports them --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_user_error_is_one_line_with_its_own_exit_code_and_the_traceback_on_request(tmp_path, monkeypatch):
    args = ["stage=adaspec", "adaspec.k=0", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(args)
    assert proc.returncode == EX_USAGE
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: adaspec.k=0"), proc.stderr
    assert not (tmp_path / "run" / ".hydra").exists()  # refused before anything was written
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    full = run_train(args)
    assert (
        full.returncode not in (0, EX_USAGE) and "Traceback" in full.stderr and "ConfigError" in full.stderr
    )
