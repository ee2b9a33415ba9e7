"""Throwaway redis-server and PostgreSQL servers for tests: real processes on free ports of 127.0.0.1,
stoppable and restartable on the same port and data (to test outages), removed on exit."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT = 60.0  # generous: slow or busy CI machines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(ready: Callable[[], bool], what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not start\n{tail}")


def have_redis() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.dir, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = directory / "redis.log"
        self._proc: subprocess.Popen | None = None

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> None:
        if self._proc is not None:
            return
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir), "--logfile", str(self.log)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        try:
            _wait(self._ping, f"redis-server on port {self.port}", self._proc, self.log)
        except BaseException:
            self.stop()
            raise

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers (a slow or hung Redis)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused server would not act on SIGTERM
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / f"redis-{os.getpid()}-{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    server = RedisServer(directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _pg_bin_dir() -> Path | None:
    """Where initdb, pg_ctl and createdb are: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += [Path(p) for p in sorted(versions, key=lambda p: int(Path(p).parent.name), reverse=True)
                   if Path(p).parent.name.isdigit()]
    for d in candidates:
        if all((d / name).exists() for name in ("initdb", "pg_ctl", "createdb")):
            return d
    return None


def have_postgres() -> bool:
    return _pg_bin_dir() is not None


class PostgresServer:
    """A cluster run as an unprivileged user: `postgres` when we are root (PostgreSQL refuses root), else us."""

    def __init__(self, directory: Path) -> None:
        bindir = _pg_bin_dir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries (initdb, pg_ctl) not found")
        self.bin, self.dir, self.port = bindir, directory, free_port()
        self.data, self.log = directory / "data", directory / "postgres.log"
        self.user = "postgres" if os.geteuid() == 0 else _current_user()
        self.url = f"postgresql://{self.user}@127.0.0.1:{self.port}/llmgw"
        self._running = False

    def _run(self, *args: str) -> None:
        as_user = {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}
        done = subprocess.run([str(self.bin / args[0]), *args[1:]], cwd=self.dir, capture_output=True, text=True,
                              timeout=START_TIMEOUT * 2, stdin=subprocess.DEVNULL, **as_user)
        if done.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}{tail}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-locale",
                  "--no-instructions")
        settings = {"listen_addresses": "'127.0.0.1'", "port": str(self.port),
                    "unix_socket_directories": f"'{self.dir}'", "fsync": "off", "synchronous_commit": "off",
                    "full_page_writes": "off", "max_connections": "100"}
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n# tests/services.py\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "llmgw")

    def start(self) -> None:
        if not self._running:
            self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(int(START_TIMEOUT)))
            self._running = True

    def stop(self) -> None:
        if self._running:
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", str(int(START_TIMEOUT)))
            self._running = False


def _current_user() -> str:
    import getpass

    return getpass.getuser()


@contextmanager
def postgres_server(tmp_path: Path) -> Iterator[PostgresServer]:
    """The cluster lives in its own short temp dir, not tmp_path: pytest's is private to root (the server runs as
    `postgres`) and may be too long for a unix socket path (107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    server = PostgresServer(directory)
    try:
        server.init()
        yield server
    finally:
        try:
            server.stop()
        except Exception:  # already gone: still remove its files
            server._running = False
        shutil.rmtree(directory, ignore_errors=True)


class TcpProxy:
    """A TCP forwarder on a free port of 127.0.0.1 to `target`, which a test can cut (every connection closed,
    new ones refused, as when a network partition leaves one replica without its database) and restore."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def cut_off(self) -> bool:
        return self._listener is None

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        for sock in ([listener] if listener else []) + sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.cut()

