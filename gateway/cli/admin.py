"""A running gateway's admin routes from the command line: what `llmgw migration-report`, `llmgw keys` and
`llmgw rollout` share."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def admin_request(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> Any | None:
    """The JSON answer of `method path` on `args.url` with the admin key (`--admin-key`, else
    $LLMGW_ADMIN_KEY); None once what went wrong is printed."""
    import httpx

    key = args.admin_key or os.environ.get("LLMGW_ADMIN_KEY", "")
    try:
        response = httpx.request(method, f"{args.url.rstrip('/')}{path}", headers={"authorization": f"Bearer {key}"},
                                 timeout=30, **kwargs)
    except httpx.HTTPError as exc:
        print(f"llmgw: cannot reach {args.url}: {exc}", file=sys.stderr)
        return None
    if response.status_code >= 400:
        print(f"llmgw: {response.status_code}: {response.text}", file=sys.stderr)
        return None
    return response.json()
