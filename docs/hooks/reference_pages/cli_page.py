"""reference/cli.md: every `llmgw` subcommand's help, from the real argparse parsers."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from reference_pages import markdown as md

HELP_COLUMNS = 100  # argparse wraps --help to the terminal; the pages get one fixed width


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
    line to llmgw_bench's own parsers (gateway/cli/commands.py main): those stand for it, and `bench compare`
    after it."""
    from gateway.cli.commands import build_parser
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
             "Generated from the argparse parsers that `llmgw` runs (`gateway/cli/commands.py` `build_parser`, and "
             "`llmgw_bench/cli.py` for `llmgw bench`): each subcommand's help line and its `--help`.", ""]
    parsers = cli_parsers()
    lines += md.table(["Command", "What it does"], [[f"[`{name}`](#{md.slug(name)})", md.cell(help_line)]
                                                   for name, _, help_line in parsers[1:]]) + [""]
    with _columns(HELP_COLUMNS):
        for name, parser, help_line in parsers:
            lines += [f"## `{name}` {{ #{md.slug(name)} }}", ""]
            if help_line:
                lines += [md.cell(help_line[:1].upper() + help_line[1:]), ""]
            actions = [a for a in parser._actions if not a.option_strings and a.choices and
                       not isinstance(a, argparse._SubParsersAction)]
            for action in actions:  # `llmgw rollout start|status|...`: an action word, not a subparser
                lines += [f"Its `{action.dest}` is one of: " + ", ".join(f"`{c}`" for c in action.choices) + ".", ""]
            lines += ["```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


