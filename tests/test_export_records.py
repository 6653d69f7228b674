"""An export is data (`specdistill.drafts.registry`): loading a draft folder never imports, calls or unpickles what
its `draft_kind.json` names. Hostile records (another callable, a nested `_target_`, a pickle to unpickle) are
refused with an error that says what the record holds, and the marker files they would write never appear; the
kinds specdistill writes, older `_target_` records of its own kinds, and kinds a user registers on purpose load."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.drafts import KIND_FILE, DraftKind, Standalone, exported_kind, load_draft, register_kind
from specdistill.drafts.cut_layers.kind import CutLayers
from specdistill.drafts.eagle3.kind import Eagle3
from specdistill.drafts.registry import ENTRY_POINT_GROUP, is_plain, kind_class, kind_names
from specdistill.errors import ConfigError, InputFileError
from specdistill.export.hf import export_pretrained


class Marker:
    """Unpickling it writes the marker file: proof that a pickle was read."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("unpickled",))


@pytest.fixture(scope="module")
def tokenizer():
    return arith_tokenizer(vocab_size=300, train_size=200)


@pytest.fixture()
def export(tokenizer, tmp_path: Path) -> Path:
    """A real standalone export (safetensors, tokenizer) to put records into."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    return export_pretrained(AutoModelForCausalLM.from_config(config).eval(), tokenizer, tmp_path / "export")


def hostile_records(tmp_path: Path) -> dict[str, tuple[dict, Path]]:
    """Records that would each write (or empty) a file if anything in them ran: name -> (record, that file)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    pickled = tmp_path / "payload.pkl"
    pickled.write_bytes(pickle.dumps(Marker(str(tmp_path / "unpickled.txt"))))
    spawned = tmp_path / "spawned.txt"
    nested_open = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    return {
        "subprocess": ({"_target_": "subprocess.run", "args": ["touch", str(spawned)]}, spawned),
        "torch.load pickle": (
            {"_target_": "torch.load", "f": str(pickled), "weights_only": False},
            tmp_path / "unpickled.txt",
        ),
        "pickle.loads": (
            {"_target_": "pickle.loads", "data": pickled.read_bytes().hex()},
            tmp_path / "unpickled.txt",
        ),
        "nested in an own kind's legacy record": (
            {"_target_": "specdistill.drafts.cut_layers.CutLayers", "num_layers": nested_open},
            victim,
        ),
        "nested in a list": (
            {"_target_": "specdistill.drafts.eagle3.Eagle3", "aux_layer_ids": [1, nested_open, 3]},
            victim,
        ),
        "nested in settings": ({"kind": "eagle3", "settings": {"aux_layer_ids": nested_open}}, victim),
        "callable as the kind": (
            {"kind": "subprocess.run", "settings": {"args": ["touch", str(spawned)]}},
            spawned,
        ),
        "hydra keys beside the kind": (
            {"kind": "cut_layers", "settings": {"num_layers": 1}, "_target_": "subprocess.run"},
            spawned,
        ),
        "unknown setting": (
            {"kind": "cut_layers", "settings": {"num_layers": 1, "_target_": "os.system"}},
            spawned,
        ),
    }


HOSTILE = [
    "subprocess", "torch.load pickle", "pickle.loads", "nested in an own kind's legacy record", "nested in a list",
    "nested in settings", "callable as the kind", "hydra keys beside the kind", "unknown setting",
]  # fmt: skip


def test_the_hostile_cases_are_all_run(tmp_path: Path):
    assert sorted(hostile_records(tmp_path)) == sorted(HOSTILE)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_record_is_refused_and_nothing_runs(export: Path, tmp_path: Path, name: str):
    record, marker = hostile_records(tmp_path)[name]
    before = marker.read_text() if marker.exists() else None
    (export / KIND_FILE).write_text(json.dumps(record))
    with pytest.raises(InputFileError, match="refused") as error:
        load_draft(export)
    message = str(error.value)
    assert str(export / KIND_FILE) in message and "\n" not in message
    # the marker is unchanged: no subprocess ran, nothing was unpickled, no file was opened for writing
    assert (marker.read_text() if marker.exists() else None) == before


def test_the_refusal_quotes_what_the_record_names(export: Path, tmp_path: Path):
    (export / KIND_FILE).write_text(json.dumps({"_target_": "subprocess.run", "args": ["true"]}))
    with pytest.raises(InputFileError, match=r"names the callable 'subprocess.run'.*refused"):
        exported_kind(export)
    (export / KIND_FILE).write_text(
        json.dumps({"kind": "eagle3", "settings": {"ttt_steps": {"_target_": "x.y"}}})
    )
    with pytest.raises(
        InputFileError, match=r"settings.ttt_steps holds \{'_target_': 'x.y'\}.*expects a plain int"
    ):
        exported_kind(export)


def test_a_pickled_weights_file_is_never_unpickled(export: Path, tmp_path: Path):
    """A folder whose weights are a pickle (`pytorch_model.bin`) instead of safetensors is refused unread."""
    (export / "model.safetensors").unlink()
    torch.save({"weights": Marker(str(tmp_path / "unpickled.txt"))}, export / "pytorch_model.bin")
    with pytest.raises(InputFileError, match=r"no model.safetensors \(found pytorch_model.bin: pickles"):
        load_draft(export)
    assert not (tmp_path / "unpickled.txt").exists()


@pytest.mark.parametrize(
    "kind",
    [
        Standalone(),
        CutLayers(num_layers=2),
        Eagle3(draft_vocab_size=64, aux_layer_ids=[1, 2, 3], ttt_steps=3),
    ],
    ids=["standalone", "cut_layers", "eagle3"],
)
def test_each_own_kind_records_plain_settings_and_reads_them_back(kind: DraftKind, export: Path):
    record = kind.record()
    assert set(record) == {"kind", "settings"} and record["kind"] in kind_names()
    assert (
        json.loads(json.dumps(record)) == record
    )  # plain JSON values, nothing that would not survive a round trip
    (export / KIND_FILE).write_text(json.dumps(record))
    back = exported_kind(export)
    assert type(back) is type(kind) and back.settings() == kind.settings()


def test_an_older_record_of_an_own_kind_still_loads(export: Path):
    (export / KIND_FILE).write_text(json.dumps({"_target_": "specdistill.drafts.standalone.Standalone"}))
    assert type(load_draft(export).kind) is Standalone
    (export / KIND_FILE).write_text(
        json.dumps({"_target_": "specdistill.drafts.cut_layers.CutLayers", "num_layers": 2})
    )
    kind = exported_kind(export)
    assert isinstance(kind, CutLayers) and kind.num_layers == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_layers": True}, "expects a plain int"),
        ({"num_layers": "2"}, "expects a plain int"),
        ({"num_layers": 0}, "do not build a cut_layers kind"),
        ({}, "do not build a cut_layers kind"),
        ({"continues": "/elsewhere"}, "no exported setting 'continues'"),
    ],
)
def test_settings_are_checked_against_the_kinds_typed_settings(export: Path, settings: dict, message: str):
    (export / KIND_FILE).write_text(json.dumps({"kind": "cut_layers", "settings": settings}))
    with pytest.raises(InputFileError, match=message):
        exported_kind(export)


def test_plain_values_follow_the_annotations():
    hint = list[int] | tuple[int, ...] | None
    assert is_plain([1, 2], hint) and is_plain(None, hint) and not is_plain([1, "2"], hint)
    assert not is_plain({"_target_": "x"}, hint) and not is_plain([True], list[int])
    assert is_plain(1, float) and not is_plain(True, float) and not is_plain(1, bool)


class UserKind(DraftKind):
    """A kind of the user's own, with one setting."""

    exported_settings = ("width",)

    def __init__(self, width: int = 4) -> None:
        self.width = width

    def settings(self) -> dict:
        return {"width": self.width}


def test_a_kind_registered_on_purpose_loads(export: Path, tokenizer):
    (export / KIND_FILE).write_text(json.dumps({"kind": "user_kind", "settings": {"width": 8}}))
    with pytest.raises(InputFileError, match="not registered"):
        exported_kind(export)
    register_kind("user_kind", UserKind)
    kind = exported_kind(export)
    assert isinstance(kind, UserKind) and kind.width == 8
    assert UserKind(width=3).record() == {"kind": "user_kind", "settings": {"width": 3}}
    with pytest.raises(ConfigError, match="taken"):
        register_kind("eagle3", UserKind)
    with pytest.raises(ConfigError, match="not registered"):

        class Unregistered(UserKind):
            pass

        Unregistered().record()


def test_an_entry_point_registers_a_kind(tmp_path: Path, monkeypatch, export: Path):
    """An installed package's entry point in the group `specdistill.draft_kinds` names a kind exports may use;
    it is loaded only when an export asks for that name."""
    package = tmp_path / "site"
    (package / "userkinds").mkdir(parents=True)
    (package / "userkinds" / "__init__.py").write_text(
        "from specdistill.drafts import DraftKind\n"
        "class Folded(DraftKind):\n"
        "    exported_settings = ('depth',)\n"
        "    def __init__(self, depth: int = 1):\n"
        "        self.depth = depth\n"
    )
    info = package / "userkinds-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: userkinds\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nfolded = userkinds:Folded\n")
    monkeypatch.syspath_prepend(str(package))
    assert "folded" in kind_names() and "userkinds" not in sys.modules
    (export / KIND_FILE).write_text(json.dumps({"kind": "folded", "settings": {"depth": 3}}))
    kind = exported_kind(export)
    assert type(kind).__name__ == "Folded" and kind.depth == 3 and kind_class("folded") is type(kind)
