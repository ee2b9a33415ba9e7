"""A PEP 503 package index on 127.0.0.1 for an image build that cannot reach the PyTorch index: it
answers /simple/torch/ with the torch wheel(s) found in a folder (the CPU build pip finds on this
machine's disk) and redirects every other project to the PyPI index pip already uses, where torch's
dependencies come from.

    python deploy/ci/torch_index.py --wheels DIR [--port 18631] [--upstream https://pypi.org/simple]

Prints `serving http://127.0.0.1:PORT/simple` once it listens; serves until killed.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: str) -> str:
    return normalize(wheel.split("-", 1)[0])


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def make_handler(files: dict[str, Path], hashes: dict[str, str], upstream: str) -> type[BaseHTTPRequestHandler]:
    served = {project_of(name) for name in files}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = unquote(urlsplit(self.path).path)  # the '+' of a local version arrives as %2B
            parts = [p for p in path.split("/") if p]
            if parts[:1] == ["simple"] and len(parts) == 1:
                links = "".join(f'<a href="/simple/{p}/">{p}</a>\n' for p in sorted(served))
                return self._send(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
            if parts[:1] == ["simple"] and len(parts) == 2:
                project = normalize(parts[1])
                if project in served:
                    links = "".join(f'<a href="/files/{quote(n)}#sha256={hashes[n]}">{html.escape(n)}</a>\n'
                                    for n in sorted(files) if project_of(n) == project)
                    return self._send(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
                self.send_response(302)
                self.send_header("Location", f"{upstream}/{project}/")
                self.send_header("Content-Length", "0")
                return self.end_headers()
            if parts[:1] == ["files"] and len(parts) == 2 and parts[1] in files:
                wheel = files[parts[1]]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(wheel.stat().st_size))
                self.end_headers()
                with wheel.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        self.wfile.write(chunk)
                return None
            return self._send(404, "not found\n")

        def _send(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            sys.stderr.write(f"torch_index: {format % args}\n")

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder holding the torch wheel(s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18631)
    parser.add_argument("--upstream", default="https://pypi.org/simple", help="index for every other project")
    args = parser.parse_args()
    files = {p.name: p for p in sorted(args.wheels.glob("*.whl"))}
    if not files:
        sys.exit(f"no wheels in {args.wheels}")
    hashes = {name: sha256(path) for name, path in files.items()}
    server = ThreadingHTTPServer((args.host, args.port), make_handler(files, hashes, args.upstream.rstrip("/")))
    print(f"serving http://{args.host}:{server.server_port}/simple ({', '.join(files)}; the rest from "
          f"{args.upstream})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
