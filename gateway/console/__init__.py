"""The admin console's built assets (static/, written by `make console` from src/ and the npm libraries pinned in
package.json; committed, so serving the console needs no node). See gateway/routes/console.py."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
MANIFEST = STATIC / "manifest.json"  # what the build read (versions, source hashes) and wrote (output hashes)
