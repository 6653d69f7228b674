"""The draft kinds an export may name, and how an export's record becomes a kind without running anything it names.

An export is data: its `draft_kind.json` names its kind by a registry name (`{"kind": "eagle3", "settings": {...}}`)
and the kind is looked up here, never imported from the record. The registry holds specdistill's own kinds and the
kinds a user registers on purpose: `register_kind(name, cls)` in their own code, or an installed package's entry
point in the group `specdistill.draft_kinds` (`name = "package.module:KindClass"` in its pyproject.toml). The
record's settings must be plain JSON values that the kind's typed settings accept (the annotations of its
constructor's parameters named in `exported_settings`); only then is the kind's class called with them.

Exports written before this format recorded `{"_target_": "<class path>", ...settings}`; a `_target_` that is one
of specdistill's own kind classes is read as that kind (the string is compared, never imported), any other is refused.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Union

from specdistill.drafts.base import DraftKind
from specdistill.errors import ConfigError, InputFileError

ENTRY_POINT_GROUP = "specdistill.draft_kinds"
RECORD_KEYS = frozenset({"kind", "settings"})

_registered: dict[str, type[DraftKind]] = {}


@cache
def builtin_kinds() -> dict[str, type[DraftKind]]:
    """specdistill's own kinds by registry name (the names of `conf/draft/<name>.yaml`)."""
    # imported here: the kinds' modules import specdistill.drafts.base, whose package imports this module
    from specdistill.drafts.cut_layers.kind import CutLayers
    from specdistill.drafts.dflash.kind import DFlash
    from specdistill.drafts.eagle3.kind import Eagle3
    from specdistill.drafts.standalone.kind import Standalone

    return {"standalone": Standalone, "cut_layers": CutLayers, "eagle3": Eagle3, "dflash": DFlash}


# Registry name of each own kind by the `_target_` that older records wrote: the class paths of that time, fixed
# strings (the classes have moved since; a record's string is compared with these, never imported).
LEGACY_TARGETS = {
    "specdistill.drafts.standalone.Standalone": "standalone",
    "specdistill.drafts.cut_layers.CutLayers": "cut_layers",
    "specdistill.drafts.eagle3.Eagle3": "eagle3",
}


def register_kind(name: str, cls: type[DraftKind]) -> None:
    """Let exports name the user's kind `cls` as `name` (call it before loading such an export).

    Raises:
        ConfigError: `cls` is not a `DraftKind` subclass, or `name` is taken by another kind.
    """
    if not (isinstance(cls, type) and issubclass(cls, DraftKind)):
        raise ConfigError(f"register_kind({name!r}, {cls!r}): a draft kind is a subclass of DraftKind")
    known = known_kinds().get(name)
    if known is not None and known is not cls:
        raise ConfigError(
            f"the draft kind name {name!r} is taken by {known.__qualname__}: register under another"
        )
    _registered[name] = cls


def known_kinds() -> dict[str, type[DraftKind]]:
    """specdistill's own kinds and those registered so far (entry points once asked for), by name."""
    return {**builtin_kinds(), **_registered}


def kind_names() -> list[str]:
    """Every name an export may use: own kinds, registered kinds and installed entry points."""
    return sorted({*known_kinds(), *(point.name for point in entry_points(group=ENTRY_POINT_GROUP))})


def kind_class(name: str) -> type[DraftKind] | None:
    """The kind registered as `name`, or None; an entry point is loaded only when its name is asked for."""
    known = known_kinds().get(name)
    if known is not None:
        return known
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name == name:
            cls = point.load()
            register_kind(name, cls)
            return cls
    return None


def kind_name(cls: type[DraftKind]) -> str:
    """The registry name of `cls`, which an export records.

    Raises:
        ConfigError: `cls` is in no registry (an export of it could not be loaded back).
    """
    for name, known in known_kinds().items():
        if known is cls:
            return name
    raise ConfigError(
        f"the draft kind {cls.__qualname__} is not registered, so its exports could not be loaded back: call "
        f"specdistill.drafts.register_kind('<name>', {cls.__qualname__}) or declare an entry point in the group "
        f"{ENTRY_POINT_GROUP!r}"
    )


def kind_from_record(record: Any, where: Path) -> DraftKind:
    """The kind that the parsed `draft_kind.json` `record` (read from `where`) names, built from its plain settings.

    Raises:
        InputFileError: the record names no registered kind, or holds settings that are not plain values of the
            kind's typed settings; nothing the record names is imported, called or unpickled.
    """
    name, settings = _split_record(record, where)
    cls = kind_class(name)
    if cls is None:
        raise InputFileError(
            f"{where} names the draft kind {name!r}, which is not registered (known: {', '.join(kind_names())}): "
            "refused. Install and register the package that defines it, or re-export the draft"
        )
    return build_kind(cls, settings, where)


def _split_record(record: Any, where: Path) -> tuple[str, dict[str, Any]]:
    """`(name, settings)` of a record in the current format or in the older `_target_` one."""
    if not isinstance(record, dict):
        raise InputFileError(
            f"{where} holds {_shown(record)}, not a draft-kind record: refused; re-export the draft"
        )
    if "_target_" in record:
        target = record["_target_"]
        name = LEGACY_TARGETS.get(target) if isinstance(target, str) else None
        if name is None:
            raise InputFileError(
                f"{where} names the callable {_shown(target)}, which is not one of specdistill's draft kinds "
                f"({', '.join(builtin_kinds())}): refused, since an export is data and nothing it names is "
                "imported or run. Re-export the draft with this specdistill"
            )
        return name, {key: value for key, value in record.items() if key != "_target_"}
    extra = sorted(set(record) - RECORD_KEYS)
    if "kind" not in record or extra:
        raise InputFileError(
            f"{where} holds the keys {sorted(record)}, but a draft-kind record holds exactly 'kind' (a registered "
            "name) and 'settings' (plain values): refused; re-export the draft"
        )
    name, settings = record["kind"], record.get("settings", {})
    if not isinstance(name, str):
        raise InputFileError(f"{where}: 'kind' is {_shown(name)}, not a registered kind's name: refused")
    if not isinstance(settings, dict):
        raise InputFileError(
            f"{where}: 'settings' is {_shown(settings)}, not an object of plain values: refused"
        )
    return name, settings


def build_kind(cls: type[DraftKind], settings: Mapping[str, Any], where: Path) -> DraftKind:
    """`cls(**settings)` once every setting is one the kind exports and a plain value of its annotated type."""
    allowed = typed_settings(cls)
    for key, value in settings.items():
        if key not in allowed:
            raise InputFileError(
                f"{where}: the {kind_name(cls)} kind has no exported setting {key!r} (it has "
                f"{sorted(allowed) or 'none'}): refused; re-export the draft"
            )
        if not is_plain(value, allowed[key]):
            raise InputFileError(
                f"{where}: settings.{key} holds {_shown(value)}, but the {kind_name(cls)} kind expects a plain "
                f"{_type_name(allowed[key])}: refused, since an export is data; re-export the draft"
            )
    try:
        return cls(**settings)
    except (ConfigError, TypeError) as error:
        raise InputFileError(
            f"{where}: its settings do not build a {kind_name(cls)} kind ({error})"
        ) from error


def typed_settings(cls: type[DraftKind]) -> dict[str, Any]:
    """The type of each setting `cls` exports (`cls.exported_settings`), from its constructor's annotations."""
    hints = typing.get_type_hints(cls.__init__)
    parameters = inspect.signature(cls.__init__).parameters
    missing = [name for name in cls.exported_settings if name not in parameters or name not in hints]
    if missing:
        raise TypeError(
            f"{cls.__qualname__}.exported_settings names {missing}, which its __init__ does not annotate"
        )
    return {name: hints[name] for name in cls.exported_settings}


def is_plain(value: Any, hint: Any) -> bool:
    """Whether `value` (parsed JSON) is a plain value of the type `hint`: None, bool, int, float, str, and lists or
    tuples of them, or unions of those; a JSON object is never plain (it could stand for something to build)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(is_plain(value, arm) for arm in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        args = [arg for arg in typing.get_args(hint) if arg is not Ellipsis] or [Any]
        return isinstance(value, list) and all(is_plain(item, args[0]) for item in value)
    return False


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _shown(value: Any, limit: int = 120) -> str:
    """`value` as the message quotes it, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
