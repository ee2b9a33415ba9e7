"""The generated reference pages (docs/hooks/reference.py): every config key documented and listed with its
default, every CLI subcommand and option, every metric of the registry a gateway builds. Fast: no server."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_hook() -> ModuleType:
    """docs/hooks/ is not a package: load the hook from its path, as MkDocs does (it puts its reference_pages
    package on the path)."""
    name = "llmgw_docs_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / "reference.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ref = _load_hook()
cli_page_module = importlib.import_module("reference_pages.cli_page")
metrics_page_module = importlib.import_module("reference_pages.metrics_page")


@pytest.fixture(scope="module")
def config_page() -> str:
    return ref.config_reference()


@pytest.fixture(scope="module")
def cli_page() -> str:
    return ref.cli_reference()


@pytest.fixture(scope="module")
def metrics_page() -> str:
    return ref.metrics_reference()


# config


def test_every_config_key_has_a_doc_string() -> None:
    assert ref.missing_doc_strings() == []


THROWAWAY = '''
import msgspec


class Inner(msgspec.Struct, frozen=True, kw_only=True):
    documented: int = 1
    """Has one."""
    bare: str = ""


class Outer(msgspec.Struct, kw_only=True):
    name: str
    """Named."""
    inner: Inner = Inner()
    """A nested table."""
    items: list[Inner] = []
    plain: int = 0  # a comment is not a doc string
'''


def test_a_field_without_a_doc_string_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "llmgw_throwaway_config.py").write_text(THROWAWAY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("llmgw_throwaway_config")
    try:
        assert ref.missing_doc_strings(module.Outer) == ["items", "plain", "inner.bare", "items[].bare"]
        assert ref.missing_doc_strings(module.Inner) == ["bare"]
    finally:
        sys.modules.pop("llmgw_throwaway_config", None)


def _config_types() -> list[tuple[type, set[str] | None]]:
    """Every config type and the fields of it that are keys, found apart from the hook: msgspec's view of
    GatewayConfig's tables, each registered backend type's Settings, the engine's `speculative` table."""
    from backends.registry import backend_types, get_backend_class
    from engine_core.spec_decode.config import SpeculativeConfig
    from gateway.config import _TOP_LEVEL, GatewayConfig

    found: list[tuple[type, set[str] | None]] = [(GatewayConfig, set(_TOP_LEVEL))]

    def nested(t: Any) -> None:
        if isinstance(t, msgspec.inspect.StructType | msgspec.inspect.DataclassType):
            if all(cls is not t.cls for cls, _ in found):
                found.append((t.cls, None))
                for f in t.fields:
                    nested(f.type)
        for each in (*getattr(t, "types", ()), getattr(t, "item_type", None), getattr(t, "value_type", None)):
            if each is not None:  # X | None, list[X], dict[str, X]
                nested(each)

    for f in msgspec.inspect.type_info(GatewayConfig).fields:
        if f.name in _TOP_LEVEL and f.name != "backends":  # BackendEntry: the parsed form, not keys
            nested(f.type)
    for name in backend_types():
        nested(msgspec.inspect.type_info(get_backend_class(name).Settings))
    nested(msgspec.inspect.type_info(SpeculativeConfig))
    return found


def _toml_default(f: Any) -> str:
    if f.required:
        return "*required*"
    value = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
    if isinstance(value, msgspec.Struct):
        return "`{}`"
    if value is None:
        return "`none`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}`"
    return f"`{json.dumps(value)}`"


def test_config_reference_names_every_field_with_its_default(config_page: str) -> None:
    rows = set()  # (key, default cell) of every table row
    for line in config_page.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.add((cells[0].strip("`"), cells[2]))
    names = {key for key, _ in rows}
    types = _config_types()
    assert len(types) >= 15  # the gateway's tables, four backend types and their bases' keys, speculative
    for cls, keys in types:
        for f in msgspec.inspect.type_info(cls).fields:
            if keys is not None and f.name not in keys:
                continue
            assert f.name in names, f"{cls.__qualname__}.{f.name} is not in reference/config.md"
            if f.name == "type" or cls.__name__ == "GatewayConfig":  # the type selector; parse_config's defaults
                continue
            assert (f.name, _toml_default(f)) in rows, f"{cls.__qualname__}.{f.name}: default {_toml_default(f)}"
    assert "`default_model` | `str` | *the first model*" in config_page
    for heading in ("`[server]`", "`[[auth.keys]]`", "`[state]`", "`[backends.<name>]`", '`type = "engine"`',
                    '`type = "openai"`', '`type = "tgi"`', '`type = "triton"`', "`[backends.<name>.speculative]`",
                    "`[models.<name>]`", "`[[models.<name>.routes]]`", "`[models.<name>.shadow]`",
                    "`[models.<name>.rollout]`", "`[models.<name>.rollout.gates]`"):
        assert f" {heading} {{ #" in config_page, heading


def test_config_reference_cells_keep_their_columns(config_page: str) -> None:
    """A `|` in a type (`str | None`) or a doc string must not split a table cell."""
    assert "<code>str &#124; None</code>" in config_page
    assert '<code>"json" &#124; "console"</code>' in config_page
    for line in config_page.splitlines():
        if line.startswith("| `"):
            assert len(re.split(r"(?<!\\)\|", line)) == 6, line


# CLI


def _parsers() -> list[argparse.ArgumentParser]:
    from gateway.cli.commands import build_parser
    from llmgw_bench.cli import build_compare_parser
    from llmgw_bench.cli import build_parser as build_bench_parser

    top = build_parser()
    return [top, *(sub for _, sub, _ in cli_page_module.subcommands(top)), build_bench_parser(), build_compare_parser()]


def test_cli_reference_names_every_subcommand_and_option(cli_page: str) -> None:
    from gateway.cli.commands import build_parser

    names = [name for name, _, _ in cli_page_module.subcommands(build_parser())]
    assert {"serve", "check-config", "migration-report", "state", "keys", "rollout", "bench"} <= set(names)
    for name in [*names, "bench compare"]:
        assert f"## `llmgw {name}`" in cli_page, name
    for parser in _parsers():
        for action in parser._actions:
            for option in action.option_strings:
                assert option in cli_page, f"{parser.prog} {option}"
            if not action.option_strings and isinstance(action.choices, list):  # `rollout start|status|...`
                for choice in action.choices:
                    assert f"`{choice}`" in cli_page or f"{choice}," in cli_page, f"{parser.prog} {choice}"


def test_main_parses_with_the_factored_parser() -> None:
    from gateway.cli.commands import build_parser

    args = build_parser().parse_args(["serve", "--port", "9000"])
    assert (args.command, args.port, args.config) == ("serve", 9000, "config.toml")


# metrics


def test_metrics_reference_names_every_metric_of_the_registry(metrics_page: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.config import parse_config
    from gateway.state import Gateway

    with tempfile.TemporaryDirectory() as directory:
        gateway = Gateway(parse_config(metrics_page_module.DOCS_CONFIG.format(directory=directory)), backends={})
        families = list(gateway.metrics.registry.collect())
        tgi = list(text_string_to_metric_families(gateway.metrics.tgi.render().decode()))
    assert len(families) > 50
    for family in families:
        exposed = {"counter": f"{family.name}_total", "histogram": f"{family.name}_bucket"}.get(family.type,
                                                                                            family.name)
        assert f"`{exposed}`" in metrics_page, exposed
        assert family.documentation in metrics_page, family.name
    for family in tgi:
        assert f"`{family.name}" in metrics_page, family.name
    for name in ("llmgw_engine_spec_decode_num_drafts_total", "llmgw_key_requests_total", "llmgw_rollout_gate",
                 "llmgw_replica_in_flight", "llmgw_usage_rows_written_total", "tgi_request_count"):
        assert f"`{name}`" in metrics_page
    assert "| `llmgw_requests_total` | counter | `model`, `backend`, `route`, `status`, `finish_reason` |" \
        in metrics_page


# the hook


def test_mkdocs_builds_the_generated_pages_strictly(tmp_path: Path) -> None:
    """The hook in a real (strict) MkDocs build: the three pages exist, and every anchor they link to resolves."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[Config](reference/config.md)\n")
    (tmp_path / "mkdocs.yml").write_text(json.dumps({
        "site_name": "t", "docs_dir": "docs", "site_dir": "site", "strict": True, "theme": {"name": "mkdocs"},
        "hooks": [str(ROOT / "docs" / "hooks" / "reference.py")],
        "markdown_extensions": ["attr_list", "tables", "toc"],
        "validation": {"omitted_files": "warn", "unrecognized_links": "warn", "anchors": "warn"}}))
    build(load_config(str(tmp_path / "mkdocs.yml")))
    config_html = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert 'id="server"' in config_html and 'id="models-name-rollout-gates"' in config_html
    assert "<code>str &#124; None</code>" in config_html or "<code>str | None</code>" in config_html
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    assert "llmgw_requests_total" in (tmp_path / "site" / "reference" / "metrics" / "index.html").read_text()
