"""The reference pages, generated from the code so that they cannot drift from it (an MkDocs hook).

- reference/config.md: every config.toml key, from the config types: each key's type and default
  (`msgspec.inspect`) and its attribute doc string, the string literal on the line after the field (read from
  the source with griffe, as mkdocstrings reads it);
- reference/cli.md: every `llmgw` subcommand's `--help`, from the real argparse parser;
- reference/metrics.md: every Prometheus metric of the registry a gateway builds.

`missing_doc_strings()` lists the config keys that have no doc string (tests/test_docs_reference.py keeps it
empty). Each page is also a plain function, for the tests and for a look without MkDocs:
`python docs/hooks/reference.py config|cli|metrics`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the gateway's packages, however MkDocs was started
    sys.path.insert(0, str(ROOT))

HELP_COLUMNS = 100  # argparse wraps --help to the terminal; the pages get one fixed width


# ---------------------------------------------------------------------------------------------------------------
# Markdown helpers


def _code(text: str) -> str:
    """Inline code in a table cell. A `|` inside backticks splits GitHub's table cells and shows its escape in
    Python-Markdown's, so such code is written as HTML with the bar as an entity."""
    if "|" in text or "`" in text:
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
        return f"<code>{escaped}</code>"
    return f"`{text}`"


def _cell(text: str) -> str:
    """Markdown text (a doc string) in one table cell: one line, `|` escaped, `<` kept from becoming HTML."""
    out = []
    for i, part in enumerate(" ".join(text.split()).split("`")):
        if i % 2:  # inside a code span
            out.append(_code(part) if "|" in part else f"`{part}`")
        else:
            out.append(part.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*"))
    return "".join(out)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


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


def _slug(path: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in path.replace("<name>", "name").lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug


def _heading(path: str, kind: str) -> str:
    return f"`[[{path}]]`" if kind == "array" else f"`[{path}]`"


def _walk(cls: type, path: str, kind: str, level: int, keys: list[Key] | None = None,
          label: str = "", heading: str = "", anchor: str = "") -> Iterator[Table]:
    """The table of `cls` at `path`, then each table nested in it, in field order."""
    table = Table(path + ("[]" if kind == "array" else ""), heading or _heading(path, kind),
                  anchor or _slug(path + ("-item" if kind == "array" else "")), cls, _intro(cls),
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
                + ", ".join(f"[`\"{n}\"`](#backends-{_slug(n)})" for n in settings) + ".", [], level)
    for name, cls in settings.items():
        own = [k for k in _keys(cls) if k.owner not in shared]
        for key in own:
            if key.name == "type":  # the key that picks the type: required, and only this value
                key.type, key.default = json.dumps(name), "required"
        also = [base for base in shared if issubclass(cls, base)]
        tables = list(_walk(cls, "backends.<name>", "table", level + 1, own, label=f'type = "{name}"',
                            heading=f'`type = "{name}"`', anchor=f"backends-{_slug(name)}"))
        if also:
            links = [f"[{_shared_title(base)}](#{_slug(base.__qualname__)})" for base in also]
            tables[0].intro += (" " if tables[0].intro else "") + "Also the keys in " + (
                ", ".join(links[:-1]) + " and " + links[-1] if len(links) > 1 else links[0]) + "."
        yield from tables
    for base, names in shared.items():
        overridden = {n for n in base.__dict__["__annotations__"]
                      if all(_owner(settings[t], n) is not base for t in names)}  # e.g. `type`: each type's own
        keys = [k for k in _keys(base) if k.owner is base and k.name not in overridden]
        tables = list(_walk(base, "backends.<name>", "table", level + 1, keys, label=base.__qualname__,
                            heading=_shared_title(base), anchor=_slug(base.__qualname__)))
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


def missing_doc_strings(root: type | None = None) -> list[str]:
    """The TOML key paths of config fields with no doc string: of the whole config, or of `root` and the types
    nested in it."""
    tables = config_tables() if root is None else list(_walk(root, "", "table", 2))
    out = []
    for table in tables:
        for key in table.keys:
            if not key.doc:
                path = f"{table.path}.{key.name}".lstrip(".")
                out.append(f"{path} ({table.label})" if table.label else path)
    return out


def config_reference() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the config types, so it cannot drift from the code: `gateway/config.py` "
             "(`GatewayConfig` and its tables), `gateway/rollout/spec.py` (rollouts), each backend type's `Settings` "
             "(`backends/engine.py`, `backends/http.py`, `backends/pool/settings.py`, `backends/openai.py`, "
             "`backends/tgi.py`, `backends/triton.py`, through `backends/registry.py`) and "
             "`engine_core/spec_decode/config.py`. Each description is the field's doc string; "
             "`llmgw check-config FILE` validates a file against the same types.", "",
             "Defaults are TOML values; *required* keys have none, and *none* means the key is unset "
             "(TOML has no null: leave the key out).", ""]
    for table in config_tables():
        lines += [f"{'#' * table.level} {table.heading} {{ #{table.anchor} }}", ""]
        if table.intro:
            lines += [_cell(table.intro), ""]
        if table.keys:
            rows = []
            for key in table.keys:
                doc = _cell(key.doc or "")
                if key.link:
                    doc += f" See [below](#{key.link})."
                default = f"*{key.default}*" if key.default == "required" else key.default
                rows.append([f"`{key.name}`", _code(key.type), default if default.startswith("*") else _code(default),
                             doc])
            lines += _table(["Key", "Type", "Default", "Description"], rows) + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# CLI


@contextmanager
def _columns(n: int) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, help line) of each subcommand, in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return []


def cli_parsers() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """("llmgw", the top parser, its description), then each subcommand's. `llmgw bench` hands the rest of its
    line to llmgw_bench's own parsers (gateway/cli.py main): those stand for it, and `bench compare` after it."""
    from gateway.cli import build_parser
    from llmgw_bench.cli import build_compare_parser
    from llmgw_bench.cli import build_parser as build_bench_parser

    parser = build_parser()
    out = [("llmgw", parser, parser.description or "")]
    for name, sub, help_line in subcommands(parser):
        if name == "bench":
            out.append(("llmgw bench", build_bench_parser(), help_line))
            compare = build_compare_parser()
            out.append(("llmgw bench compare", compare, compare.description or ""))
        else:
            out.append((f"llmgw {name}", sub, help_line))
    return out


def cli_reference() -> str:
    lines = ["# CLI reference", "",
             "Generated from the argparse parsers that `llmgw` runs (`gateway/cli.py` `build_parser`, and "
             "`llmgw_bench/cli.py` for `llmgw bench`): each subcommand's help line and its `--help`.", ""]
    parsers = cli_parsers()
    lines += _table(["Command", "What it does"], [[f"[`{name}`](#{_slug(name)})", _cell(help_line)]
                                                   for name, _, help_line in parsers[1:]]) + [""]
    with _columns(HELP_COLUMNS):
        for name, parser, help_line in parsers:
            lines += [f"## `{name}` {{ #{_slug(name)} }}", ""]
            if help_line:
                lines += [_cell(help_line[:1].upper() + help_line[1:]), ""]
            actions = [a for a in parser._actions if not a.option_strings and a.choices and
                       not isinstance(a, argparse._SubParsersAction)]
            for action in actions:  # `llmgw rollout start|status|...`: an action word, not a subparser
                lines += [f"Its `{action.dest}` is one of: " + ", ".join(f"`{c}`" for c in action.choices) + ".", ""]
            lines += ["```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Metrics

# A gateway with every optional metric on: TGI's names, per-key series, [state] (keys, usage rows). Its one backend
# is never built: Gateway(backends={}) wires the registry as `llmgw serve` does, and starts nothing.
DOCS_CONFIG = """
[server]
tgi_metrics = true
metrics_per_key = true
[state]
database = "sqlite:///{directory}/state.db"
[backends.docs]
type = "openai"
base_url = "http://127.0.0.1:9"
model = "docs"
[models.docs]
backend = "docs"
"""


@dataclass(frozen=True)
class MetricDoc:
    name: str  # the family's name
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    exposed: str  # the series names on /metrics
    note: str = ""


GROUPS: list[tuple[str, tuple[str, ...], str]] = [
    ("Requests and tokens", (), "Every request the gateway answers, by model, backend and route."),
    ("Engine backends", ("llmgw_engine_",), "Series for each engine backend (each worker of an engine pool) once "
     "it has started; the `spec_decode` ones only while an engine speculates "
     "(`[backends.<name>.speculative]`)."),
    ("Backend health", ("llmgw_backend_",), "A series per backend, read at scrape time."),
    ("Replica pools", ("llmgw_replica_", "llmgw_balancer_", "llmgw_pd_"), "Series for backends that are pools "
     "(`endpoints`, `discovery = \"dns\"`, `replicas` > 1, prefill/decode pools)."),
    ("Per API key", ("llmgw_key_",), "Only with `server.metrics_per_key = true`; labelled by the key's name, "
     "never its secret, at most `server.max_key_series` names (the rest count under `other`)."),
    ("Limits and the state store", ("llmgw_limiter_", "llmgw_state_", "llmgw_usage_", "llmgw_responses_"),
     "The limiter's always; the state store's only with `[state]`, the usage rows' only with "
     "`state.record_usage`."),
    ("Rollouts", ("llmgw_rollout_",), "Series for each rollout in progress; the leader gauge always."),
    ("TGI-compatible names", ("tgi_",), "Only with `server.tgi_metrics = true`: TGI's own names, types and "
     "buckets (counters without `_total`, no help text), so dashboards built for TGI keep working."),
]


def _exposed(name: str, kind: str, created: bool) -> str:
    if kind == "counter":
        names = [f"{name}_total"] + ([f"{name}_created"] if created else [])
    elif kind == "histogram":
        names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"] + ([f"{name}_created"] if created else [])
    else:
        names = [name]
    return ", ".join(names)


def _speculating_engine() -> Any:
    """A stand-in engine row for spec_decode_state: its families exist only while an engine speculates."""
    counters = types.SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_emitted_tokens=0,
                                     accepted_per_pos=[0], mean_acceptance_length=lambda: 0.0)
    spec = types.SimpleNamespace(config=types.SimpleNamespace(method="ngram"), counters=counters)
    return types.SimpleNamespace(spec=spec)


def metric_docs() -> list[MetricDoc]:
    """Every metric family of a gateway's registry (and its hand-written TGI set), each once."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.config import parse_config
    from gateway.state import Gateway
    from gateway.telemetry.metrics import spec_decode_state
    from gateway.telemetry.record import RequestRecord

    with tempfile.TemporaryDirectory() as directory:
        gateway = Gateway(parse_config(DOCS_CONFIG.format(directory=directory)), backends={})
        registry = gateway.metrics.registry
        labels: dict[str, tuple[str, ...]] = {}  # the labels of registered metric objects, by family name
        for collector, names in registry._collector_to_names.items():
            for name in names:
                labels[name] = tuple(getattr(collector, "_labelnames", ()))
        out: list[MetricDoc] = []
        seen: set[str] = set()

        def add(families: Any, created: bool, note: str = "") -> None:
            for family in families:
                if family.name in seen:
                    continue
                seen.add(family.name)
                names = getattr(family, "_labelnames", None) or labels.get(family.name, ())
                if not names:
                    names = tuple(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
                own = created and family.name in labels  # metric objects expose _created; scrape-time families not
                out.append(MetricDoc(family.name, family.type, tuple(names), family.documentation,
                                     _exposed(family.name, family.type, own), note))

        add(registry.collect(), created=True)
        add(spec_decode_state([("docs", _speculating_engine())]), created=False,
            note="only while an engine speculates")
        tgi = gateway.metrics.tgi
        tgi.observe(RequestRecord("docs", "POST", "/generate", model="docs", status=422))  # a failure: its label
        for family in text_string_to_metric_families(tgi.render().decode()):
            if family.name not in seen:
                seen.add(family.name)
                names = tuple(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
                exposed = (family.name if family.type != "histogram" else
                           f"{family.name}_bucket, {family.name}_sum, {family.name}_count")
                out.append(MetricDoc(family.name, family.type, names, family.documentation, exposed))
    return out


def _series(d: MetricDoc) -> str:
    """The exposed names, short: `x_bucket`, `_sum`, `_count` (no `_created`: the page's intro says which)."""
    names = [n for n in d.exposed.split(", ") if not n.endswith("_created")]
    return ", ".join([_code(names[0]), *(_code(n.removeprefix(d.name)) for n in names[1:])])


def _group(name: str) -> str:
    for title, prefixes, _ in GROUPS[1:]:
        if name.startswith(prefixes):
            return title
    return GROUPS[0][0]


def metrics_reference() -> str:
    docs = metric_docs()
    lines = ["# Metrics reference", "",
             "Generated from the Prometheus registry a gateway builds (`gateway/state.py` `Gateway`, "
             "`gateway/telemetry/`, `gateway/rollout/manager.py`), here one with `server.tgi_metrics`, "
             "`server.metrics_per_key` and `[state]` on and no backend started, so every family is listed "
             "although many have series only once backends run and requests come. Every metric is on "
             "`GET /metrics` (with `[auth] protect_metrics`, behind a key).", "",
             "Counters are exposed with `_total` and histograms as `_bucket`, `_sum` and `_count` (TGI's names "
             "excepted). The counters and histograms that count as requests go also have prometheus_client's "
             "`_created` timestamp series; the figures read at scrape time (engines, pools' replicas, limits, "
             "state store, rollouts) do not.", ""]
    for title, _, note in GROUPS:
        rows = [[_series(d), d.type, ", ".join(_code(label) for label in d.labels) or "-",
                 _cell(d.help + (f" ({d.note})" if d.note else "")) or "-"] for d in docs if _group(d.name) == title]
        if not rows:
            continue
        lines += [f"## {title}", "", _cell(note), ""]
        lines += _table(["Name", "Type", "Labels", "Help"], rows) + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The MkDocs hook

PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_reference,
    "reference/cli.md": cli_reference,
    "reference/metrics.md": metrics_reference,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        existing = files.get_file_from_path(path)
        if existing is not None:  # the generated page wins over a stale hand-written one
            files.remove(existing)
        files.append(File.generated(config, path, content=make()))
    return files


if __name__ == "__main__":
    which = {"config": config_reference, "cli": cli_reference, "metrics": metrics_reference}
    for arg in sys.argv[1:] or list(which):
        print(which[arg]())
