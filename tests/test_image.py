"""The container image, built (`make image`'s script) and run as a user would: read-only root
filesystem (only /tmp writable), no network at all (`--network none`), the image's own non-root user
and shipped config. The HTTP checks run inside the container (`exec` of the image's python against
127.0.0.1:8080), since a container with no network has no port to publish: one container shows both
that it serves and that it needs no network. Then SIGTERM, with a stream in flight: it finishes, the
server drains and exits 0.

Skipped only where there is no container engine (a docker daemon, or podman: deploy/ci/setup.sh
installs podman on machines of our kind, and makes the offline build possible there). No check
depends on how long anything takes; the waits are bounds to fail instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.server import ROOT

IMAGE = os.environ.get("LLMGW_TEST_IMAGE", "llm-gateway:cpu")
BUILD_TIMEOUT = 3600.0  # seconds: a cold build took 9-12 minutes on 2 busy cores
START_TIMEOUT = 900.0  # seconds for /health to turn 200 (no conversion at start: the model is in the image)
WAIT = 300.0  # seconds, for anything else
UID = 10001  # the image's user (Dockerfile)
# the ISA levels the image prebuilds the kernels for (the Dockerfile's KERNEL_ISAS): each is there, and
# checked where this CPU can run it
IMAGE_ISAS = tuple(re.search(r'^ARG KERNEL_ISAS="([^"]+)"', (ROOT / "Dockerfile").read_text(), re.M)[1].split())


def container_engine() -> str | None:
    wanted = os.environ.get("ENGINE")
    if wanted:
        return wanted
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return "docker"
    return "podman" if shutil.which("podman") else None


ENGINE = container_engine()
pytestmark = pytest.mark.skipif(ENGINE is None, reason="no container engine here (a docker daemon, or podman); "
                                                       "deploy/ci/setup.sh installs podman")


def engine(*args: str, timeout: float = WAIT, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert ENGINE is not None
    done = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{ENGINE} {' '.join(args)} -> {done.returncode}\n{done.stdout[-4000:]}\n"
                             f"{done.stderr[-4000:]}")
    return done


# runs inside the container with the image's python: one HTTP request to the gateway on its loopback
CLIENT = r"""
import json, sys, urllib.error, urllib.request
method, path, body, headers = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
request = urllib.request.Request("http://127.0.0.1:8080" + path, method=method, headers=headers,
                                 data=body.encode() if body else None)
try:
    with urllib.request.urlopen(request, timeout=120) as r:
        status, text = r.status, r.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
except OSError as e:
    status, text = 0, repr(e)
print(json.dumps({"status": status, "body": text}))
"""

# a chat stream, printing "first" after its first token and then every SSE line as it comes
STREAM_CLIENT = r"""
import json, sys, urllib.request
body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": int(sys.argv[2]), "ignore_eos": True,
                   "messages": [{"role": "user", "content": "Count to one hundred."}]}).encode()
request = urllib.request.Request("http://127.0.0.1:8080/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "x-request-id": sys.argv[1]})
first = False
with urllib.request.urlopen(request, timeout=300) as r:
    for line in r:
        if line.startswith(b"data: {") and not first:
            first = True
            print("first", flush=True)
        print(line.decode().rstrip(), flush=True)
"""


@dataclass
class Container:
    name: str

    def exec(self, *argv: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        flags = [f for k, v in (env or {}).items() for f in ("-e", f"{k}={v}")]
        return engine("exec", *flags, self.name, *argv, check=check).stdout

    def python(self, code: str, *args: str, env: dict[str, str] | None = None) -> Any:
        """Run `code` with the image's python; it prints one JSON value, returned."""
        return json.loads(self.exec("python", "-c", code, *args, env=env).strip().splitlines()[-1])

    def http(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, str]:
        got = self.python(CLIENT, method, path, json.dumps(body) if body is not None else "",
                          json.dumps({"Content-Type": "application/json", **(headers or {})}))
        return got["status"], got["body"]

    def state(self) -> str:
        return engine("inspect", "--format", "{{.State.Status}}", self.name).stdout.strip()

    def logs(self) -> str:
        """stdout (the access log) and stderr (the rest) as one stream, in the order they were written."""
        assert ENGINE is not None
        return subprocess.run([ENGINE, "logs", self.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=WAIT).stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`make image`'s script: cached layers make every build after the first quick."""
    log = tmp_path_factory.mktemp("image") / "build.log"
    with log.open("w") as out:
        done = subprocess.run([str(ROOT / "deploy" / "build-image.sh")], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT,
                              env={**os.environ, "IMAGE": IMAGE, "VARIANT": "cpu", "ENGINE": ENGINE or ""})
    text = log.read_text()
    assert done.returncode == 0, f"the image build failed ({log}):\n{text[-8000:]}"
    print(text.splitlines()[-1])  # its time and size, in pytest's -s/-rP output
    return IMAGE


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    name = f"llmgw-image-test-{uuid.uuid4().hex[:8]}"
    tmpfs = ["--read-only-tmpfs=false"] if ENGINE == "podman" else []  # only the /tmp below is writable
    engine("run", "-d", "--name", name, "--read-only", *tmpfs, "--tmpfs", "/tmp:rw,size=512m",
           "--network", "none", image)
    box = Container(name)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if box.state() != "running":
                raise AssertionError(f"the container stopped before it was healthy:\n{box.logs()[-8000:]}")
            status, _ = box.http("GET", "/health")
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"/health not 200 within {START_TIMEOUT:g} s:\n{box.logs()[-8000:]}")
            time.sleep(2)
        yield box
    finally:
        engine("rm", "-f", name, check=False)


def test_the_image_runs_as_its_own_user_with_a_read_only_root_and_no_network(container: Container) -> None:
    probe = container.python(r"""
import errno, json, os, socket
status = dict(line.split(":\t", 1) for line in open("/proc/1/status").read().splitlines() if ":\t" in line)
try:
    open("/opt/venv/written-by-test", "w")
    root = "writable"
except OSError as e:
    root = errno.errorcode[e.errno]
open("/tmp/written-by-test", "w").write("ok")
try:
    socket.create_connection(("192.0.2.1", 80), timeout=5)  # TEST-NET-1: unreachable, or no route at all
    outside = "reached"
except OSError as e:
    outside = errno.errorcode.get(e.errno, str(e))
print(json.dumps({"uid": os.getuid(), "pid1_uid": status["Uid"].split()[0], "root": root,
                  "interfaces": sorted(os.listdir("/sys/class/net")), "outside": outside}))
""")
    assert probe["uid"] == UID and probe["pid1_uid"] == str(UID)  # the server (PID 1) too, not only exec
    assert probe["root"] == "EROFS"
    assert probe["interfaces"] == ["lo"] and probe["outside"] in ("ENETUNREACH", "EHOSTUNREACH", "ETIMEDOUT")
    mode = engine("inspect", "--format", "{{.HostConfig.NetworkMode}}", container.name).stdout.strip()
    assert mode == "none"


def test_the_image_keeps_its_healthcheck_and_does_not_force_a_kernel_target(image: str) -> None:
    (inspected,) = json.loads(engine("image", "inspect", image).stdout)
    config = inspected["Config"]
    healthcheck = config.get("Healthcheck") or inspected.get("Healthcheck")  # docker's place, podman's
    assert healthcheck and "/live" in " ".join(healthcheck["Test"])  # podman kept it: --format docker
    env = dict(e.split("=", 1) for e in config["Env"])
    assert "LLMGW_KERNEL_MARCH" not in env  # each CPU takes its own level's build
    assert env["HF_HUB_OFFLINE"] == "1" and config["User"].startswith(str(UID))


def test_healthcheck_passes(container: Container) -> None:
    if ENGINE == "podman":  # podman runs it from systemd timers, absent here: by hand
        engine("healthcheck", "run", container.name)
        return
    deadline = time.monotonic() + WAIT  # docker runs it every 10 s
    while (health := engine("inspect", "--format", "{{.State.Health.Status}}", container.name).stdout.strip()) \
            != "healthy":
        assert health in ("starting", "healthy") and time.monotonic() < deadline, health
        time.sleep(2)


def test_generate_chat_completions_and_metrics(container: Container) -> None:
    status, body = container.http("POST", "/generate", {"inputs": "The capital of France is",
                                                        "parameters": {"max_new_tokens": 8}})
    assert status == 200, body
    assert json.loads(body)["generated_text"].strip()

    status, body = container.http("POST", "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["choices"][0]["message"]["content"].strip()
    assert 0 < reply["usage"]["completion_tokens"] <= 8

    # the shipped config has no API keys, so /metrics is open (with keys and auth.protect_metrics it
    # would need the admin key): checked here so that a change to it shows up in this test
    shipped = tomllib.loads((ROOT / "deploy" / "config.toml").read_text())
    assert not shipped.get("auth", {}).get("keys")
    status, text = container.http("GET", "/metrics")
    assert status == 200, text
    served = {(m.group(1), m.group(2)) for m in
              re.finditer(r'^llmgw_requests_total\{[^}]*route="([^"]+)"[^}]*status="(\d+)"', text, re.M)}
    assert {("/generate", "200"), ("/v1/chat/completions", "200")} <= served, served


def test_the_compiled_kernels_come_from_the_image(container: Container) -> None:
    logs = container.logs()
    assert re.search(r"loading the compiled CPU kernels: done in [\d.]+ s; imported the prebuilt module in ", logs), \
        logs[-6000:]
    assert "compiling for this CPU" not in logs and "CPU kernels unavailable" not in logs
    check = r"""
import json
from engine_core.cpu import kernels as k
from engine_core.cpu.features import cpu_features
b = k.kernel_build()
print(json.dumps({"isa": cpu_features().isa, "target": k.target_march(), "source": b and b.source,
                  "march": b and b.march, "compiled_for": b and b.isa, "file": b and b.module.__file__}))
"""
    mine = container.python(check)
    assert mine["source"] == "prebuilt" and mine["march"] == mine["target"], mine
    assert mine["file"].startswith("/opt/venv/lib/python3.11/site-packages/llmgw_cpu_kernels_"), mine
    levels = ("scalar", "avx2", "avx512", "avx512_bf16")
    for isa in IMAGE_ISAS:  # a CPU of a lesser level (LLMGW_CPU_ISA caps it) takes that level's build
        if levels.index(isa) > levels.index(mine["isa"]):
            continue  # this CPU cannot run that build; it is there, but not checked here
        got = container.python(check, env={"LLMGW_CPU_ISA": isa})
        assert got["source"] == "prebuilt" and got["compiled_for"] == isa, got
    names = container.python(r"""
import glob, json, os, sys
from engine_core.cpu import kernels as k
print(json.dumps({"have": sorted(os.path.basename(p).split(".")[0] for p in
                                 glob.glob("/opt/venv/lib/python3.11/site-packages/llmgw_cpu_kernels_*.so")),
                  "want": sorted(k.module_name(k.MARCH_FOR_ISA[i]) for i in sys.argv[1:])}))
""", *IMAGE_ISAS)
    assert names["have"] == names["want"], names


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(container: Container) -> None:
    """Last in this module: it stops the container."""
    assert ENGINE is not None
    request_id, tokens = f"drain-{uuid.uuid4().hex[:8]}", 128
    stream = subprocess.Popen([ENGINE, "exec", container.name, "python", "-u", "-c", STREAM_CLIENT, request_id,
                               str(tokens)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert stream.stdout is not None
        first = stream.stdout.readline()  # blocks until the first token has arrived
        assert first.strip() == "first", first + stream.stdout.read()
        engine("kill", "--signal", "TERM", container.name)
        exit_code = engine("wait", container.name, timeout=WAIT).stdout.strip()
    finally:
        if stream.poll() is None:
            stream.kill()
        stream.wait(60)
    logs = container.logs()
    assert exit_code == "0", logs[-6000:]
    assert "draining: 1 request(s) in flight" in logs, logs[-6000:]
    assert "drained: every request finished; shutting down" in logs, logs[-6000:]
    finished = [json.loads(line[line.index("{"):]) for line in logs.splitlines() if request_id in line and "{" in line]
    records = [r for r in finished if r.get("request_id") == request_id]
    assert records, logs[-6000:]
    assert records[-1]["status"] == 200 and records[-1]["generated_tokens"] == tokens, records
    assert logs.index("draining: 1 request(s)") < logs.index(request_id)  # it finished during the drain
