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

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
for path in (ROOT, HOOKS):  # the gateway's packages and reference_pages, however MkDocs was started
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from reference_pages.cli_page import cli_reference  # noqa: E402
from reference_pages.config_page import config_reference, missing_doc_strings  # noqa: E402
from reference_pages.metrics_page import metrics_reference  # noqa: E402

__all__ = ["cli_reference", "config_reference", "metrics_reference", "missing_doc_strings", "on_files"]

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
