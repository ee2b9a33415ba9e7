"""reference/config.md: every config.toml key with its type, default and attribute doc string."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from reference_pages import markdown as md

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------------------------------
# Attribute doc strings, read from the source with griffe

_modules: dict[str, Any] = {}


def _griffe_module(name: str) -> Any:
    """griffe's view of a module, parsed from its source once (static analysis only: no imports)."""
    import griffe

    if name not in _modules:  # sys.path as it is now: a test may have put a throwaway module on it
        loader = griffe.GriffeLoader(search_paths=[str(ROOT), *sys.path], allow_inspection=False)
        try:
            _modules[name] = loader.load(name)
        except (ImportError, griffe.GriffeError):  # no source found: every doc string of it is missing
            _modules[name] = None
    return _modules[name]


def _griffe_class(cls: type) -> Any:
    """griffe's view of a class from its source; None when its source cannot be found."""
    obj = _griffe_module(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, "members", {}).get(part)
    return obj


def doc_string(cls: type, name: str) -> str | None:
    """The attribute doc string of field `name`, from the class (in the MRO) that declares it."""
    for owner in _declaring_classes(cls, name):
        member = getattr(_griffe_class(owner), "members", {}).get(name)
        if member is not None and member.docstring is not None and member.docstring.value.strip():
            return member.docstring.value.strip()
    return None


def class_doc(cls: type) -> str | None:
    obj = _griffe_class(cls)
    return obj.docstring.value.strip() if obj is not None and obj.docstring is not None else None


def _declaring_classes(cls: type, name: str) -> list[type]:
    """The classes of the MRO that annotate `name`, the nearest first (a subclass may redeclare a field)."""
    return [c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {})]


def _owner(cls: type, name: str) -> type:
    found = _declaring_classes(cls, name)
    return found[0] if found else cls


# ---------------------------------------------------------------------------------------------------------------
# Config: the tables a config.toml has, walked from the config types


@dataclass
class Key:
    name: str
    type: str  # readable: int, str | None, "json" | "console", list[str], table
    default: str  # TOML-ish, "required", or "none"
    doc: str | None
    owner: type  # the class that declares the field
    link: str | None = None  # the anchor of the table this key opens


@dataclass
class Table:
    path: str  # TOML key path with placeholders: "server", "auth.keys[]", "models.<name>.rollout"
    heading: str  # "`[server]`", "`[[auth.keys]]`", "`type = \"openai\"`"
    anchor: str
    cls: type | None
    intro: str = ""
    keys: list[Key] = field(default_factory=list)
    level: int = 2
    label: str = ""  # what tells two tables of one path apart in missing_doc_strings (a backend type)


def _is_table(t: Any) -> bool:
    return isinstance(t, type) and (issubclass(t, msgspec.Struct) or dataclasses.is_dataclass(t))


def _optional(t: Any) -> Any:
    """`X | None` → X; anything else as it is."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(t) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return t


def _nesting(t: Any) -> tuple[str, type] | None:
    """How a field's value holds a config type: ("table" | "array" | "named", the type); None for a plain value."""
    t = _optional(t)
    if _is_table(t):
        return "table", t
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list and args and _is_table(args[0]):
        return "array", args[0]
    if origin is dict and len(args) == 2 and _is_table(args[1]):
        return "named", args[1]
    return None


def _type_text(t: Any) -> str:
    """A type as a reader of config.toml thinks of it."""
    if t is type(None):
        return "None"
    if t is Any:
        return "any"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is list:
        return "array of tables" if _is_table(args[0]) else f"list[{_type_text(args[0])}]"
    if origin is dict:
        if args[1] is Any:
            return "table"
        return "tables by name" if _is_table(args[1]) else f"table of {_type_text(args[1])}"
    if _is_table(t):
        return "table"
    return getattr(t, "__name__", str(t))


def _toml(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, msgspec.Struct) or dataclasses.is_dataclass(value):
        return "{}"  # a table left out: every key at its default
    return repr(value)


def _defaults(cls: type) -> dict[str, str]:
    info = msgspec.inspect.type_info(cls)
    out = {}
    for f in info.fields:  # type: ignore[attr-defined]
        if f.required:
            out[f.name] = "required"
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = _toml(f.default_factory())
        else:
            out[f.name] = _toml(f.default)
    return out


def _keys(cls: type, names: list[str] | None = None) -> list[Key]:
    hints = typing.get_type_hints(cls)
    defaults = _defaults(cls)
    fields = [f.name for f in msgspec.inspect.type_info(cls).fields]  # type: ignore[attr-defined]
    return [Key(name, _type_text(hints[name]), defaults[name], doc_string(cls, name), _owner(cls, name))
            for name in fields if names is None or name in names]


def _loose_tables() -> dict[tuple[type, str], type]:
    """Fields typed as a free-form table (`dict[str, Any]`) that the config checks against a type of its own."""
    from backends.engine import EngineSettings
    from engine_core.spec_decode.config import SpeculativeConfig

    return {(EngineSettings, "speculative"): SpeculativeConfig}  # EngineSettings.speculative_config()


def _heading(path: str, kind: str) -> str:
    return f"`[[{path}]]`" if kind == "array" else f"`[{path}]`"


def _walk(cls: type, path: str, kind: str, level: int, keys: list[Key] | None = None,
          label: str = "", heading: str = "", anchor: str = "") -> Iterator[Table]:
    """The table of `cls` at `path`, then each table nested in it, in field order."""
    table = Table(path + ("[]" if kind == "array" else ""), heading or _heading(path, kind),
                  anchor or md.slug(path + ("-item" if kind == "array" else "")), cls, _intro(cls),
                  keys if keys is not None else _keys(cls), level, label)
    yield table
    hints = typing.get_type_hints(cls)
    loose = _loose_tables()
    for key in table.keys:
        nested = _nesting(hints[key.name])
        if nested is None and (cls, key.name) in loose:
            nested = ("table", loose[cls, key.name])
        if nested is None:
            continue
        how, inner = nested
        child = (f"{path}.{key.name}" if path else key.name) + (".<name>" if how == "named" else "")
        children = list(_walk(inner, child, how, level + 1 if level < 4 else level))
        key.link = children[0].anchor
        yield from children


def _intro(cls: type) -> str:
    """A class doc string as a table's intro, less a leading "`[server]`: " that the heading already says."""
    doc = " ".join((class_doc(cls) or "").split())
    if doc.startswith("`") and "`: " in doc:
        doc = doc.split("`: ", 1)[1]
        doc = doc[:1].upper() + doc[1:]
    return doc


def _backend_tables(level: int) -> Iterator[Table]:
    """`[backends.<name>]`: a table per backend type (the registry's, third-party ones too), then the keys some of
    them share (a base class of two or more types' Settings), once each."""
    from backends.registry import backend_types, get_backend_class

    settings = {name: get_backend_class(name).Settings for name in backend_types()}
    shared: dict[type, list[str]] = {}  # base class -> the types whose Settings inherit its fields
    for name, cls in settings.items():
        for base in cls.__mro__[1:]:
            if base.__dict__.get("__annotations__") and base is not msgspec.Struct:
                shared.setdefault(base, []).append(name)
    shared = {base: names for base, names in shared.items() if len(names) > 1}
    yield Table("backends.<name>", "`[backends.<name>]`", "backends-name", None,
                "One table per backend; its `type` picks the backend type, and the type its keys: "
                + ", ".join(f"[`\"{n}\"`](#backends-{md.slug(n)})" for n in settings) + ".", [], level)
    for name, cls in settings.items():
        own = [k for k in _keys(cls) if k.owner not in shared]
        for key in own:
            if key.name == "type":  # the key that picks the type: required, and only this value
                key.type, key.default = json.dumps(name), "required"
        also = [base for base in shared if issubclass(cls, base)]
        tables = list(_walk(cls, "backends.<name>", "table", level + 1, own, label=f'type = "{name}"',
                            heading=f'`type = "{name}"`', anchor=f"backends-{md.slug(name)}"))
        if also:
            links = [f"[{_shared_title(base)}](#{md.slug(base.__qualname__)})" for base in also]
            tables[0].intro += (" " if tables[0].intro else "") + "Also the keys in " + (
                ", ".join(links[:-1]) + " and " + links[-1] if len(links) > 1 else links[0]) + "."
        yield from tables
    for base, names in shared.items():
        overridden = {n for n in base.__dict__["__annotations__"]
                      if all(_owner(settings[t], n) is not base for t in names)}  # e.g. `type`: each type's own
        keys = [k for k in _keys(base) if k.owner is base and k.name not in overridden]
        tables = list(_walk(base, "backends.<name>", "table", level + 1, keys, label=base.__qualname__,
                            heading=_shared_title(base), anchor=md.slug(base.__qualname__)))
        tables[0].intro = "Keys of types " + ", ".join(f"`{json.dumps(n)}`" for n in names) + "."
        yield from tables


def _shared_title(base: type) -> str:
    """A shared base's title: its doc string up to the first `:`, `;` or `.` (else its name)."""
    doc = " ".join((class_doc(base) or "").split())
    for stop in (":", ";", "."):
        doc = doc.split(stop, 1)[0]
    return doc or base.__qualname__


def config_tables() -> list[Table]:
    """Every table of config.toml, in the order a user meets them."""
    from gateway.config import _TOP_LEVEL, GatewayConfig

    top = [k for k in _keys(GatewayConfig) if k.name in _TOP_LEVEL]  # source, version: not keys of the file
    for key in top:
        if key.name == "server":  # parse_config: an absent [server] is every default
            key.default = "{}"
        if key.name == "default_model":  # parse_config: the first [models] table
            key.default = "*the first model*"
    tables = [Table("", "Top-level keys", "top-level-keys", GatewayConfig, _intro(GatewayConfig), top)]
    hints = typing.get_type_hints(GatewayConfig)
    for key in top:
        if key.name == "backends":  # BackendEntry is the parsed form: each type has its own keys
            key.type, key.link = "tables by name", "backends-name"
            tables += _backend_tables(2)
            continue
        nested = _nesting(hints[key.name])
        if nested is not None:
            how, inner = nested
            path = key.name + (".<name>" if how == "named" else "")
            children = list(_walk(inner, path, how, 2))
            key.link = children[0].anchor
            tables += children
    return tables


PROJECT_PACKAGES = {"gateway", "backends", "engine_core"}


def missing_doc_strings(root: type | None = None) -> list[str]:
    """The TOML key paths of config fields with no doc string: of the whole config, or of `root` and the types
    nested in it. Fields a third-party backend type declares (a plugin, or a test's) are its author's to document:
    the reference lists them, this leaves them out."""
    tables = config_tables() if root is None else list(_walk(root, "", "table", 2))
    out = []
    for table in tables:
        for key in table.keys:
            ours = root is not None or key.owner.__module__.split(".")[0] in PROJECT_PACKAGES
            if ours and not key.doc:
                path = f"{table.path}.{key.name}".lstrip(".")
                out.append(f"{path} ({table.label})" if table.label else path)
    return out


def config_reference() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the config types, so it cannot drift from the code: `gateway/config_tables.py` "
             "(`GatewayConfig` and its tables), `gateway/rollout/spec.py` (rollouts), each backend type's `Settings` "
             "(`backends/engine.py`, `backends/upstream/http.py`, `backends/pool/settings.py`, `backends/openai.py`, "
             "`backends/tgi.py`, `backends/triton.py`, through `backends/registry.py`) and "
             "`engine_core/spec_decode/config.py`. Each description is the field's doc string; "
             "`llmgw check-config FILE` validates a file against the same types.", "",
             "Defaults are TOML values; *required* keys have none, and *none* means the key is unset "
             "(TOML has no null: leave the key out).", ""]
    for table in config_tables():
        lines += [f"{'#' * table.level} {table.heading} {{ #{table.anchor} }}", ""]
        if table.intro:
            lines += [md.cell(table.intro), ""]
        if table.keys:
            rows = []
            for key in table.keys:
                doc = md.cell(key.doc or "")
                if key.link:
                    doc += f" See [below](#{key.link})."
                default = f"*{key.default}*" if key.default == "required" else key.default
                rows.append([f"`{key.name}`", md.code(key.type),
                             default if default.startswith("*") else md.code(default), doc])
            lines += md.table(["Key", "Type", "Default", "Description"], rows) + [""]
    return "\n".join(lines)


