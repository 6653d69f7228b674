"""The configuration reference, `docs/reference/configuration.md`, written from the code so that it cannot drift:

    python -m specdistill.config_reference            # rewrite the reference
    python -m specdistill.config_reference --check    # exit 1 when the committed reference differs

Sources: each stage's settings dataclass in `specdistill/stages/settings.py` (fields, types, attribute docstrings,
and the ranges its `__post_init__` checks through the shared `check_*` helpers), the stage's
`conf/<stage>/default.yaml` (the defaults), and every config group under `conf/` with `conf/train.yaml`'s
defaults list. The functions below are pure (classes and a conf folder in, Markdown out), so tests can pass their own.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

PACKAGE = Path(__file__).resolve().parent
CONF = PACKAGE / "conf"
OUTPUT = PACKAGE.parent / "docs" / "reference" / "configuration.md"
COMMAND = "python -m specdistill.config_reference"
# Machine-specific files that .gitignore keeps out of the repository: listing them would make the reference differ
# between checkouts.
IGNORED = frozenset({"local/default.yaml"})
# The C loader when PyYAML has it: the pure-Python one takes seconds over conf/'s files.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_CELL = 90  # characters of a default value in a table; the yaml file holds the rest
# The columns of a stage's settings table. docs/stylesheets/extra.css labels the cells by position (a Markdown table
# cannot carry data-label attributes) when a phone's width stacks each row: keep the two in the same order.
SETTINGS_COLUMNS = ("Key", "Type", "Default", "Range", "Description")
# The class of the <div> around each settings table (md_in_html renders the Markdown inside; GitHub shows the table).
SETTINGS_CLASS = "settings-table"

# The range checks that `__post_init__` expresses as data (the helpers of specdistill/stages/settings.py): each maps
# the helper's bound arguments to a phrase. Checks written as plain `if` code are not read: their ranges appear only
# where the field's docstring states them.
RANGE_PHRASES = {
    "check_count": lambda a: f"integer ≥ {a['minimum']}" + (", or null" if a["optional"] else ""),
    "check_number": lambda a: (
        f"number in {'(' if a['low_open'] else '['}{a['low']:g}, {a['high']:g}{')' if a['high_open'] else ']'}"
    ),
    "check_choice": lambda a: "one of " + ", ".join(f"`{choice}`" for choice in a["choices"]),
}


# -- Markdown -------------------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """`text` as one table cell: one line, escaped outside code spans (placeholders such as <stage> are shown, not
    read as HTML). A code span holding `|` is written as plain text: MkDocs shows an escaped pipe inside code
    literally, and an unescaped one splits the cell on GitHub."""
    parts = " ".join(text.split()).split("`")
    if len(parts) % 2 == 0:  # a backtick left open is a plain character of the text before it
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f"`{part}`" if i % 2 and "|" not in part else plain(part) for i, part in enumerate(parts))


def plain(text: str) -> str:
    """Markdown-escape text outside code spans: `|`, `*`, `<`, and `_` where it could start or end emphasis (at a
    word's edge, as in outputs/<stage>/<date>_<time>; `max_length` needs none)."""
    text = text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", text)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]


def code(value: str) -> str:
    return f"`{value}`" if value else ""


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=YAML_LOADER)


def yaml_value(value: Any) -> str:
    """A value as one would write it in a yaml file or on the command line (flow style, one line)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=10**9, sort_keys=False).strip()[1:-1]
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


# -- settings dataclasses -------------------------------------------------------------------------------------------


@functools.cache  # inspect.getsource parses the class's whole module on each call
def class_node(cls: type) -> ast.ClassDef | None:
    """The class statement of `cls`, parsed from its source (None for a class without source, e.g. `object`)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.ClassDef) else None


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal after the annotated field), from `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = class_node(klass) if dataclasses.is_dataclass(klass) else None
        body = node.body if node else []
        for statement, after in zip(body, body[1:], strict=False):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(after.value.value)
    return docs


class _Unknown:
    """An argument the reader cannot evaluate statically (e.g. the checked value itself)."""


class _Each:
    """The loop variable of `for x in self.<field>`: the check applies to each element."""


def _evaluate(node: ast.expr, names: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_evaluate(element, names) for element in node.elts)
    if isinstance(node, ast.Name):
        return names.get(node.id, _Unknown)
    if isinstance(node, ast.Attribute):  # e.g. math.inf
        owner = _evaluate(node.value, names)
        return _Unknown if owner is _Unknown else getattr(owner, node.attr, _Unknown)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _evaluate(node.operand, names)
        return _Unknown if value is _Unknown else -value
    return _Unknown


def _collect_checks(body: Sequence[ast.stmt], names: Mapping[str, Any], found: dict[str, list[str]]) -> None:
    """Ranges of the `check_*` calls in `body`, into `found[field]`; `for` loops over literal keys are unrolled.

    Statements under `if` are skipped on purpose: such a check holds only in some cases, which a table cannot say.
    """
    for statement in body:
        if isinstance(statement, ast.For) and isinstance(statement.target, ast.Name):
            keys = _evaluate(statement.iter, names)
            values = keys if isinstance(keys, tuple) else (_Each,)
            for value in values:
                _collect_checks(statement.body, {**names, statement.target.id: value}, found)
            continue
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not (
            isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in RANGE_PHRASES
        ):
            continue
        helper = names.get(call.func.id)
        if not callable(helper):
            continue
        args = [_evaluate(arg, names) for arg in call.args]
        kwargs = {word.arg: _evaluate(word.value, names) for word in call.keywords if word.arg}
        bound = inspect.signature(helper).bind(*args, **kwargs)
        bound.apply_defaults()
        # `where` and `value` are known only at run time; the phrase needs every other argument
        needed = {name: value for name, value in bound.arguments.items() if name not in ("where", "value")}
        key = needed.get("key")
        if not isinstance(key, str) or any(value is _Unknown for value in needed.values()):
            continue
        phrase = RANGE_PHRASES[call.func.id](bound.arguments)
        each = isinstance(call.args[2], ast.Name) and names.get(call.args[2].id) is _Each
        found.setdefault(key, []).append(("each " if each else "") + phrase)


def field_ranges(cls: type) -> dict[str, str]:
    """The ranges `__post_init__` of `cls` and of its bases check through the `check_*` helpers, per field."""
    found: dict[str, list[str]] = {}
    for klass in reversed(cls.__mro__):
        node = class_node(klass) if dataclasses.is_dataclass(klass) else None
        for statement in node.body if node else []:
            if isinstance(statement, ast.FunctionDef) and statement.name == "__post_init__":
                module = sys.modules[klass.__module__]
                _collect_checks(statement.body, {**vars(module), "self": _Unknown}, found)
    return {key: "; ".join(dict.fromkeys(phrases)) for key, phrases in found.items()}


def type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def nested_blocks(cls: type) -> dict[str, type]:
    """Fields whose type names another dataclass of the same module (e.g. `acceptance_head: HeadPolicyGrid`)."""
    module = sys.modules[cls.__module__]
    blocks = {}
    for item in dataclasses.fields(cls):
        for name in re.findall(r"[A-Za-z_]\w*", type_name(item.type)):
            candidate = getattr(module, name, None)
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                blocks[item.name] = candidate
    return blocks


def composed_defaults(defaults: Sequence[Any]) -> dict[str, list[str]]:
    """A yaml file's defaults-list entries that fill its own keys (`/optimizer@optimizer: adamw`), per top key."""
    composed: dict[str, list[str]] = {}
    for entry in defaults:
        if isinstance(entry, Mapping):
            for target, option in entry.items():
                group, _, package = str(target).lstrip("/").partition("@")
                if package:
                    where = "" if package == package.split(".")[0] else f"`{package}`: "
                    composed.setdefault(package.split(".")[0], []).append(f"{where}`{group}/{option}`")
    return composed


def default_cell(
    item: dataclasses.Field, values: Mapping[str, Any], composed: Mapping[str, list[str]]
) -> str:
    parts = [", ".join(composed.get(item.name, []))]
    if item.name in values:
        parts.append(code(yaml_value(values[item.name])))
    elif item.default is not dataclasses.MISSING:
        parts.append(code(yaml_value(item.default)))
    elif item.default_factory is not dataclasses.MISSING:
        parts.append(code(yaml_value(item.default_factory())))
    return ", then ".join(part for part in parts if part) or "required"


def settings_table(cls: type, values: Mapping[str, Any]) -> list[str]:
    """The fields of the dataclass `cls` as a table; `values` is its yaml block (the defaults)."""
    docs, ranges = field_docs(cls), field_ranges(cls)
    composed = composed_defaults(values.get("defaults", []))
    rows = [
        (
            code(item.name),
            type_name(item.type),
            default_cell(item, values, composed),
            ranges.get(item.name, ""),
            docs.get(item.name, ""),
        )
        for item in dataclasses.fields(cls)
        if item.init
    ]
    # one block per field instead of a row too wide for a phone (docs/stylesheets/extra.css)
    return [f'<div class="{SETTINGS_CLASS}" markdown>', "", *table(SETTINGS_COLUMNS, rows), "", "</div>"]


def settings_section(cls: type, group: str, values: Mapping[str, Any]) -> list[str]:
    """One stage's section: its class, docstring, field table, and a subsection per nested block."""
    summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    lines = [
        f"## {group}: `{cls.__name__}`",
        "",
        cell(summary),
        "",
        f"Class `{cls.__module__}.{cls.__qualname__}`; defaults from `conf/{group}/default.yaml`.",
        "",
        *settings_table(cls, values),
        "",
    ]
    for name, block in nested_blocks(cls).items():
        inner = values.get(name)
        block_summary = inspect.cleandoc(block.__doc__ or "").split("\n\n")[0]
        lines += [f"### `{group}.{name}`: `{block.__name__}`", "", cell(block_summary), ""]
        lines += [*settings_table(block, inner if isinstance(inner, Mapping) else {}), ""]
    return lines


def stage_classes(module: ModuleType, base: type) -> list[type]:
    """The stage settings classes of `module`: subclasses of `base` with their config `group`, sorted by group."""
    found = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, base)
        and isinstance(getattr(value, "group", None), str)
    ]
    return sorted(found, key=lambda cls: cls.group)


# -- config groups --------------------------------------------------------------------------------------------------


def first_sentence(text: str, limit: int = 200) -> str:
    """The first sentence of `text` (not cut at `e.g.`/`i.e.`), at most `limit` characters."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    sentence = text[: match.start() + 1] if match else text
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rsplit(" ", 1)[0] + " …"


def header_comment(text: str) -> str:
    """The first sentence of a yaml file's opening comment (without Hydra's `# @package` line); the summary ends at a
    blank comment line or an indented example line."""
    lines = []
    for line in text.splitlines():
        body = line[1:] if line.startswith("#") else None
        if body is not None and body.strip().startswith("@package"):
            continue
        if body is None or not body.strip() or body.startswith("   "):
            break
        lines.append(body.strip())
    return first_sentence(" ".join(lines))


def group_options(conf: Path, group: str) -> list[tuple[str, str, str]]:
    """`(option, _target_, summary)` for each yaml file of `conf/<group>/`, sub-folders included, sorted."""
    rows = []
    for path in sorted((conf / group).rglob("*.yaml")):
        relative = path.relative_to(conf)
        if relative.as_posix() in IGNORED:
            continue
        text = path.read_text(encoding="utf-8")
        loaded = load_yaml(text)
        target = loaded.get("_target_", "") if isinstance(loaded, Mapping) else ""
        option = relative.relative_to(group).with_suffix("").as_posix()
        rows.append((option, str(target), header_comment(text)))
    return rows


def train_defaults(root: Mapping[str, Any]) -> dict[str, str]:
    """The root config's defaults list as group -> option (`optional` groups marked)."""
    chosen = {}
    for entry in root.get("defaults", []):
        if isinstance(entry, Mapping):
            for key, option in entry.items():
                optional, _, group = str(key).rpartition(" ")
                shown = option if isinstance(option, str) else yaml_value(option)
                chosen[group] = shown + (" (optional)" if optional else "")
    return chosen


def root_settings(text: str) -> list[tuple[str, str]]:
    """`(key, comment)` for each top-level key of the root config but `defaults`, with the comment lines above it."""
    rows, comment = [], []
    for line in text.splitlines():
        if line.startswith("#"):
            comment.append(line[1:].strip())
            continue
        match = re.match(r"([A-Za-z_]\w*):", line)
        if match and match[1] != "defaults":
            rows.append((match[1], " ".join(comment)))
        comment = []
    return rows


def groups_section(conf: Path) -> list[str]:
    """The root config and every config group: options, the default train.yaml picks, summaries and targets."""
    text = (conf / "train.yaml").read_text(encoding="utf-8")
    root = load_yaml(text)
    chosen = train_defaults(root)
    groups = sorted(path.name for path in conf.iterdir() if path.is_dir() and not path.name.startswith("_"))
    options = {group: group_options(conf, group) for group in groups}
    lines = [
        "## Config groups",
        "",
        "Choose an option with `<group>=<option>` on the command line; options in sub-folders are named by their "
        "path (`<folder>/<name>`). The default is the option `conf/train.yaml`'s defaults list picks; a group it "
        "does not name is composed by a stage, a pipeline step or an experiment.",
        "",
        "### Root settings",
        "",
        *table(
            ("Key", "Default", "Description"),
            [(code(key), code(yaml_value(root.get(key))), comment) for key, comment in root_settings(text)],
        ),
        "",
        "### Groups",
        "",
        *table(
            ("Group", "Default", "Options"),
            [(code(group), code(chosen.get(group, "")), str(len(options[group]))) for group in groups],
        ),
        "",
    ]
    for group in groups:
        lines += [f"### {group}", ""]
        if options[group]:
            rows = [(code(option), code(target), summary) for option, target, summary in options[group]]
            lines += [*table(("Option", "`_target_`", "Description"), rows), ""]
        else:
            readme = conf / group / "README.md"
            note = header_comment(readme.read_text(encoding="utf-8")) if readme.exists() else ""
            lines += [cell(f"No option is committed. {note}".strip()), ""]
    return lines


# -- the page -------------------------------------------------------------------------------------------------------


def render_reference(conf: Path, classes: Sequence[type]) -> str:
    """The whole reference page from the conf folder `conf` and the stage settings `classes` (each with `group`)."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from specdistill/stages/settings.py and conf/; do not edit by hand. -->",
        "",
        f"Written by `{COMMAND}` from the stages' settings dataclasses and `conf/`; a test fails when this page "
        "differs from what the command writes. Each stage section lists the keys of `<stage>.<key>`: the type, "
        "the default of `conf/<stage>/default.yaml` (entries of its defaults list first, e.g. `optimizer/adamw`, "
        "then the values it sets), the range the settings check through the shared `check_*` helpers (a check "
        "written otherwise is not listed there; some descriptions state theirs), and the field's docstring. A "
        "preset (`tuning`, `experiment`) may change the defaults.",
        "",
    ]
    for cls in classes:
        values = load_yaml((conf / cls.group / "default.yaml").read_text(encoding="utf-8"))
        lines += settings_section(cls, cls.group, values if isinstance(values, Mapping) else {})
    lines += groups_section(conf)
    return "\n".join(lines).rstrip("\n") + "\n"


def build_reference() -> str:
    """The reference of this checkout: the settings of specdistill/stages/settings.py and the package's conf/."""
    from specdistill.stages import settings

    return render_reference(CONF, stage_classes(settings, settings.StageSettings))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the committed reference is out of date"
    )
    parser.add_argument(
        "--output", type=Path, default=OUTPUT, help="the Markdown file (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    text = build_reference()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(
                f"{args.output.name} is out of date with the settings dataclasses and conf/: run `{COMMAND}` "
                "and commit the result.",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
