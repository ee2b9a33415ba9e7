"""A finished rollout written into config.toml: the model's `backend` becomes the candidate and its
`rollout` table goes, so the file says what serves (comments and layout kept, by tomlkit). A file the
gateway cannot write (a read-only ConfigMap) is left alone: the stored rollout keeps routing to the
candidate until someone edits the file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tomlkit

log = logging.getLogger("llmgw")


def promote_in_file(path: Path, model: str, candidate: str) -> bool:
    """True when the file now names `candidate` as `model`'s backend (and was changed to)."""
    try:
        document = tomlkit.parse(path.read_text())
        table = document["models"][model]  # type: ignore[index]
    except (OSError, KeyError, tomlkit.exceptions.TOMLKitError) as exc:
        log.warning("rollout of %s: promoted, but %s was not updated: %s", model, path, exc)
        return False
    if table.get("backend") == candidate and "rollout" not in table:  # type: ignore[union-attr]
        return False
    table["backend"] = candidate  # type: ignore[index]
    table.pop("rollout", None)  # type: ignore[union-attr]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(tomlkit.dumps(document))
        os.replace(temporary, path)  # whole or not at all: a reader never sees half a file
    except OSError as exc:
        log.warning("rollout of %s: promoted, but %s is not writable (%s): the stored rollout routes to %s "
                    "until the file names it", model, path, exc, candidate)
        temporary.unlink(missing_ok=True)
        return False
    log.warning("rollout of %s: promoted; %s now names backend %s", model, path, candidate)
    return True
