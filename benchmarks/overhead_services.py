"""Processes for benchmarks/gateway_overhead.py: a throwaway Postgres cluster, a Redis server, and
LiteLLM's Prisma client made to run offline.

LiteLLM's database layer is prisma-client-py, which runs Prisma's native query engine; that binary
(and the schema engine) normally comes from Prisma's download host, which is not reachable here. Only
registry packages are used instead: `prisma generate` runs with the engine paths pointed at local
stand-ins (the CLI then downloads nothing), the schema comes from the SQL migrations that
litellm-proxy-extras ships (applied with psql; LiteLLM's own migrate step is turned off with
DISABLE_SCHEMA_UPDATE), and the query engine is prisma_wasm_engine.mjs: the same engine commit built
to WebAssembly (npm @prisma/query-engine-wasm) over node-postgres, behind the HTTP interface that
prisma-client-py expects.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PG_BIN = Path("/usr/lib/postgresql/15/bin")
# prisma-client-py's engine commit -> the npm build of that commit as WebAssembly
WASM_ENGINES = {"393aa359c9ad4a4bb28630fb5613f9c281cde053": "5.17.0-31.393aa359c9ad4a4bb28630fb5613f9c281cde053"}
ENGINE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-gateway-bench" / "prisma-wasm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, path: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"port {port} not ready")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process in a session of its own, so that stop() also ends what it started (LiteLLM's engine)."""
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: SIM115
                            env={**os.environ, **(env or {})}, start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of the group (children that outlive their parent)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip()[-1500:]
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {tail}")
    return result


class Postgres:
    """A throwaway cluster: trust auth on 127.0.0.1, fsync off, run as the `postgres` user when we are root."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="overhead-pg-"))
        self.port = free_port()
        self.started = False
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")

    def start(self) -> None:
        data = self.dir / "data"
        run([*self.as_user, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync",
             "-E", "UTF8"], "initdb")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
                f"-c full_page_writes=off -c max_connections=200")
        run([*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "server.log"), "-w",
             "-o", opts, "start"], "pg_ctl start")
        self.started = True

    def createdb(self, name: str) -> str:
        run([str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name], "createdb")
        return self.url(name)

    def url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def psql_file(self, name: str, script: Path) -> None:
        run([str(PG_BIN / "psql"), "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(self.port),
             "-U", "postgres", "-d", name, "-f", str(script)], f"psql -f {script.name}")

    def query(self, name: str, sql: str) -> str:
        return run([str(PG_BIN / "psql"), "-At", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", name,
                    "-c", sql], "psql -c").stdout.strip()

    def stop(self) -> None:
        if self.started:
            subprocess.run([*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate",
                            "stop"], capture_output=True)
            self.started = False
        shutil.rmtree(self.dir, ignore_errors=True)


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.proc = start(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no"], workdir / "redis.log")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop(self.proc)


def table_rows(database: str, pg: Postgres | None) -> dict[str, int]:
    """Rows in each table of a gateway state database (sqlite:///PATH, or a database in `pg`)."""
    if database.startswith("sqlite:///"):
        with closing(sqlite3.connect(database.removeprefix("sqlite:///"))) as db:
            names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            return {n: db.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in sorted(names)}
    assert pg is not None
    sql = ("SELECT table_name || ' ' || (xpath('/row/c/text()', query_to_xml(format('SELECT count(*) AS c FROM %I', "
           "table_name), false, true, '')))[1]::text FROM information_schema.tables "
           "WHERE table_schema = 'public' ORDER BY 1")
    rows = pg.query(database.rsplit("/", 1)[1], sql).splitlines()
    return {name: int(n) for name, n in (row.rsplit(" ", 1) for row in rows)}


def _litellm_paths(litellm_python: str) -> dict[str, str]:
    code = ("import json, os, litellm, litellm_proxy_extras as extras\n"
            "from prisma import config\n"
            "print(json.dumps({'schema': os.path.join(os.path.dirname(litellm.__file__), 'proxy', 'schema.prisma'),"
            " 'migrations': os.path.join(os.path.dirname(extras.__file__), 'migrations'),"
            " 'prisma_version': config.prisma_version, 'engine': config.expected_engine_version}))")
    return json.loads(run([litellm_python, "-c", code], "locating LiteLLM's schema (needs litellm[proxy] and prisma)")
                      .stdout.strip().splitlines()[-1])


def _engine_dir(prisma_version: str, engine: str) -> Path:
    """npm-install the Wasm engine and the pg driver adapter once; returns the folder with engine.mjs."""
    if engine not in WASM_ENGINES:
        raise RuntimeError(f"no known npm Wasm build of Prisma engine {engine} (prisma-client-py's); "
                           f"known: {', '.join(WASM_ENGINES)}")
    folder = ENGINE_CACHE / engine
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "node_modules" / "@prisma" / "query-engine-wasm").exists():
        (folder / "package.json").write_text('{"name": "prisma-wasm-engine", "private": true}\n')
        run(["npm", "install", "--no-audit", "--no-fund", f"@prisma/query-engine-wasm@{WASM_ENGINES[engine]}",
             f"@prisma/adapter-pg@{prisma_version}", f"@prisma/driver-adapter-utils@{prisma_version}", "pg@8"],
            "npm install of the Wasm query engine", cwd=folder, timeout=600)
    shutil.copy(ROOT / "benchmarks" / "prisma_wasm_engine.mjs", folder / "engine.mjs")
    wrapper = folder / "query-engine"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "query-engine {engine}"; exit 0; fi\n'
                       f'exec node --experimental-wasm-modules --no-warnings "{folder / "engine.mjs"}" "$@"\n')
    schema_engine = folder / "schema-engine"  # lets `prisma generate` start; migrations go through psql instead
    schema_engine.write_text(f'#!/bin/sh\necho "schema-engine-cli {engine}"\n[ "$1" = "--version" ] && exit 0\n'
                             'echo "no schema engine offline (benchmark stand-in)" >&2\nexit 1\n')
    for path in (wrapper, schema_engine):
        path.chmod(0o755)
    return folder


def prepare_litellm_db(litellm_python: str, pg: Postgres, workdir: Path) -> dict[str, str]:
    """Create LiteLLM's database and Prisma client; returns the environment the proxy needs for it.

    Raises RuntimeError with the reason where it cannot work (the caller then measures LiteLLM without it).
    """
    try:
        return _prepare_litellm_db(litellm_python, pg, workdir)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from e


def _prepare_litellm_db(litellm_python: str, pg: Postgres, workdir: Path) -> dict[str, str]:
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("node and npm are needed for the Prisma CLI and the Wasm query engine")
    paths = _litellm_paths(litellm_python)
    engines = _engine_dir(paths["prisma_version"], paths["engine"])
    bindir = os.path.dirname(os.path.abspath(litellm_python))  # not resolve(): the venv python is a symlink
    env = {"PATH": f"{bindir}:{os.environ.get('PATH', '')}",
           "PRISMA_QUERY_ENGINE_BINARY": str(engines / "query-engine"),
           "PRISMA_SCHEMA_ENGINE_BINARY": str(engines / "schema-engine"),
           "PRISMA_ENGINES_CHECKSUM_IGNORE_MISSING": "1", "PRISMA_HIDE_UPDATE_MESSAGE": "1"}
    # prisma-client-py writes the generated client into the venv's prisma package (it needs the venv's bin on PATH)
    run([str(Path(bindir) / "prisma"), "generate", "--schema", paths["schema"]], "prisma generate",
        env={**os.environ, **env}, cwd=workdir, timeout=600)
    url = pg.createdb("litellm")
    migrations = sorted(p for p in Path(paths["migrations"]).iterdir() if (p / "migration.sql").is_file())
    script = workdir / "litellm-migrations.sql"
    script.write_text("".join(f"\\i '{m / 'migration.sql'}'\n" for m in migrations))
    pg.psql_file("litellm", script)
    return {**env, "DATABASE_URL": url, "DISABLE_SCHEMA_UPDATE": "true"}
