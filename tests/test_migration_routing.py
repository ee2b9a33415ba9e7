"""Routing decisions and hot reload, in process: split ratios, stickiness, ejection, reload rules."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import gateway.routing.health
from backends.registry import register_backend
from gateway.config import ConfigError, parse_config
from gateway.routing.health import HealthTracker
from gateway.routing.router import Router
from gateway.state import Gateway
from tests.plugin.echo_backend import EchoBackend
from tests.server import WAIT

register_backend(EchoBackend)  # type: ignore[arg-type]

SPLIT = """
[backends.old]
type = "echo-test"
[backends.new]
type = "echo-test"
[backends.spare]
type = "echo-test"

[models.llama]
routes = [{backend = "old", weight = 90}, {backend = "new", weight = 10}]
fallback = ["spare"]
sticky = "header"
"""


def router(text: str = SPLIT, cooldown: float = 30.0) -> Router:
    config = parse_config(text)
    backends = {name: EchoBackend(name, entry.settings) for name, entry in config.backends.items()}
    return Router(config, backends, HealthTracker(3, cooldown), random.Random(7))  # type: ignore[arg-type]


def test_weighted_split_is_within_statistical_bounds() -> None:
    r, n = router(), 4000
    chosen = [r.require("llama").backend_name for _ in range(n)]
    new = chosen.count("new")
    sigma = math.sqrt(n * 0.1 * 0.9)
    assert abs(new - 0.1 * n) < 4 * sigma and chosen.count("old") == n - new


def test_sticky_key_keeps_a_conversation_on_one_backend() -> None:
    r = router()
    keys = [f"session-{i}" for i in range(2000)]
    first = {k: r.require("llama", header_key=k).backend_name for k in keys}
    for k in keys[:200]:
        assert {r.require("llama", header_key=k).backend_name for _ in range(5)} == {first[k]}
    share = sum(v == "new" for v in first.values()) / len(keys)
    assert abs(share - 0.1) < 4 * math.sqrt(0.1 * 0.9 / len(keys))  # keys still split by weight
    assert router().require("llama", header_key="session-1").backend_name == first["session-1"]  # stable hash


def test_fallback_tiers_follow_the_chosen_backend() -> None:
    route = router().require("llama", header_key="x")
    assert [name for name, _ in route.tiers] == [route.backend_name, "spare"]


def test_consecutive_failures_eject_a_backend_until_the_cooldown_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]  # the tracker's clock, moved on by the test: however slow the machine, no time passes
    monkeypatch.setattr(gateway.routing.health, "time", SimpleNamespace(monotonic=lambda: now[0]))
    r = router(cooldown=30.0)
    for _ in range(3):
        r.health.record_failure("old")
    assert {r.require("llama").backend_name for _ in range(200)} == {"new"}
    assert r.health.describe("old") == "ejected"
    now[0] += 29.9
    assert r.health.describe("old") == "ejected"
    now[0] += 0.1
    assert "old" in {r.require("llama").backend_name for _ in range(200)}
    r.health.record_failure("old")  # half-open: one more failure ejects it again at once
    assert not r.health.available("old")
    now[0] += 30.0
    r.health.record_success("old")  # a success closes the circuit
    r.health.record_failure("old")
    assert r.health.available("old")


def test_failed_health_check_ejects_until_it_passes() -> None:
    r = router()
    r.health.record_check("new", healthy=False)
    assert {r.require("llama").backend_name for _ in range(300)} == {"old"}
    r.health.record_check("new", healthy=True)
    assert "new" in {r.require("llama").backend_name for _ in range(300)}


@pytest.mark.parametrize(("text", "message"), [
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nbackend = "a"\nroutes = [{backend = "a"}]\n', "either"),
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nroutes = [{backend = "b", weight = 1}]\n',
     "models.m.routes[0].backend: no backend named 'b'"),
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nroutes = [{backend = "a", weight = 0}]\n',
     "models.m.routes[0].weight: must be > 0"),
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nbackend = "a"\nfallback = ["z"]\n', "models.m.fallback[0]"),
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nbackend = "a"\nshadow = {backend = "a", sample = 2}\n',
     "models.m.shadow.sample: must be in [0, 1]"),
    ('[backends.a]\ntype = "echo-test"\n[models.m]\nbackend = "a"\nsticky = "cookie"\n', "models.m.sticky"),
])
def test_bad_routing_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text)


def test_reload_keeps_unchanged_backends_replaces_changed_ones_and_refuses_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    base = '[backends.engine-like]\ntype = "echo-test"\n[backends.remote]\ntype = "echo-test"\n' \
           '[models.m]\nbackend = "engine-like"\nfallback = ["remote"]\n'
    path.write_text(base)

    async def scenario() -> None:
        gw = Gateway(parse_config(base, str(path)), config_path=path)
        gw.start_backends()
        deadline = time.monotonic() + WAIT
        while not all(gw.started.get(id(b)) for b in gw.backends.values()):
            assert time.monotonic() < deadline, "the backends never started"
            await asyncio.sleep(0.01)
        kept, replaced = gw.backends["engine-like"], gw.backends["remote"]
        version = gw.config.version
        path.write_text(base.replace('[backends.remote]\ntype = "echo-test"\n',
                                     '[backends.remote]\ntype = "echo-test"\naccepts_chat = true\n'))
        new = await gw.reload()
        assert new.version != version and gw.config.version == new.version
        assert gw.backends["engine-like"] is kept and gw.backends["remote"] is not replaced
        for bad in ("[models.m]\nbackend = 3\n", base + "[backends.x]\ntype = \"echo-test\"\nfail_start = true\n"):
            path.write_text(bad)
            with pytest.raises(ConfigError):
                await gw.reload()
            assert gw.config.version == new.version
        await asyncio.sleep(0)  # the replaced backend is closed once idle, after a grace period
        await gw.aclose()

    asyncio.run(scenario())


def test_requests_to_a_backend_still_starting_do_not_eject_it() -> None:
    """Traffic that arrives while a model loads fails, but must not keep the backend out for the
    cool-down once it is up; failures of a started backend still eject it."""
    import asyncio

    from backends.base import GenerationRequest
    from gateway.config import parse_config
    from gateway.errors import GatewayError
    from gateway.generation import start
    from gateway.state import Gateway

    config = parse_config('[server]\neject_after_failures = 2\n[backends.up]\ntype = "openai"\n'
                          'base_url = "http://127.0.0.1:9"\nmodel = "m"\n[models.m]\nbackend = "up"\n')
    gateway = Gateway(config)
    route = gateway.router.require("m")

    async def fail(times: int) -> None:
        for i in range(times):
            with pytest.raises(GatewayError):
                await start(gateway, route, GenerationRequest(request_id=str(i), model="m", prompt="Hi"))

    async def scenario() -> None:
        await fail(4)  # refused while "loading"
        assert gateway.health.describe("up") == "healthy"
        gateway.started[id(gateway.backends["up"])] = True
        await fail(2)
        assert gateway.health.describe("up") == "ejected"
        await gateway.aclose()

    asyncio.run(scenario())
