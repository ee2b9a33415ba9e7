"""The admin console at /console: a static page and its bundled script, served by the gateway itself.

The page holds no data: every number it shows comes from the admin API, which its script calls with the admin key
the user typed (kept in the tab's sessionStorage). So the page and its assets are public, and the admin key stays
the only door to data. Without an admin key configured there is nothing the console could show: 403.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Controller, Response, get

from gateway.console import STATIC
from gateway.state import Gateway

# Litestar adds "; charset=utf-8" to text types itself
MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".json": "application/json",
               ".txt": "text/plain"}
ASSETS = {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in MEDIA_TYPES} if STATIC.is_dir() else {}
# own origin only (nothing from a CDN can run); uPlot sizes its elements through inline styles; no framing
HEADERS = {"content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                      "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache"}
DISABLED = """<!doctype html><html><head><meta charset="utf-8"><title>llm-gateway console</title></head><body>
<h1>The admin console is off</h1>
<p>It reads the admin API, which needs an admin key: set <code>admin_key</code> (or <code>admin_key_env</code>,
the name of an environment variable holding it) in the <code>[server]</code> table of config.toml, reload
(<code>kill -HUP</code> or <code>POST /admin/reload</code>) or restart, then open /console again.</p>
</body></html>"""


def _file(path: Path) -> Response[bytes]:
    return Response(path.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


class ConsoleController(Controller):
    path = "/console"
    include_in_schema = False  # a page for people, not an API

    @get("/", summary="The admin console")
    async def page(self, gateway: Gateway) -> Response[bytes]:
        if not gateway.config.server.resolved_admin_key():
            return Response(DISABLED.encode(), status_code=403, media_type=MEDIA_TYPES[".html"], headers=HEADERS)
        return _file(STATIC / "index.html")

    @get("/static/{name:str}", summary="The console's bundled script and style")
    async def asset(self, name: str) -> Response[bytes]:
        path = ASSETS.get(name)  # only files of the bundle: a name is never joined onto a path
        if path is None:
            return Response(b"not found", status_code=404, media_type=MEDIA_TYPES[".txt"])
        return _file(path)
