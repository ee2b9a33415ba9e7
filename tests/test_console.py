"""The admin console (/console): its bundle against the pinned npm libraries, the admin routes it reads
(/admin/models, /admin/series, the shadow report's divergences), and every page driven in a real browser
(Debian's chromium through Selenium) against a gateway with two engine backends, a rollout and mirrored traffic.

Screenshots of each page land in tests/artifacts/console/ (gitignored); benchmarks/console_screenshots.py makes
the README's."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import AsyncTestClient

from gateway.app import create_app
from gateway.config import parse_config
from gateway.console import HERE, MANIFEST, STATIC
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.series import MAX_SAMPLES, BackendSeries
from tests import console_driver as cd
from tests.console_driver import ADMIN, ADMIN_HEADERS, console_config, feed
from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, ROOT, START_TIMEOUT, running_gateway, wait_until
from tests.upstream import scripted_upstream

ARTIFACTS = ROOT / "tests" / "artifacts" / "console"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# the bundle: built by `make console`, committed, checked here without node

def test_bundle_is_built_from_the_pinned_libraries_and_the_current_sources() -> None:
    package = json.loads((HERE / "package.json").read_text())
    lock = json.loads((HERE / "package-lock.json").read_text())
    manifest = json.loads(MANIFEST.read_text())
    pinned = {**package["dependencies"], **package["devDependencies"]}
    for name, version in pinned.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name}: pin an exact version, not {version!r}"
        assert lock["packages"][f"node_modules/{name}"]["version"] == version, f"{name}: package-lock.json differs"
    assert manifest["packages"] == package["dependencies"], "static/ was built from other versions: make console"
    assert manifest["esbuild"] == package["devDependencies"]["esbuild"]
    stale = [p for p, digest in manifest["inputs"].items() if sha256(HERE / p) != digest]
    assert not stale, f"changed since static/ was built (run `make console`): {stale}"
    sources = {str(p.relative_to(HERE)) for p in (HERE / "src").rglob("*") if p.is_file()}
    assert sources <= set(manifest["inputs"]), f"new sources not in the bundle (run `make console`): {sources}"
    built = {p.name for p in STATIC.iterdir()} - {MANIFEST.name}
    assert built == set(manifest["outputs"]), "static/ holds other files than the build wrote"
    edited = [p for p, digest in manifest["outputs"].items() if sha256(STATIC / p) != digest]
    assert not edited, f"edited by hand (edit src/ and run `make console`): {edited}"
    banner = (STATIC / "console.js").read_text().splitlines()[0]
    for name, version in package["dependencies"].items():
        assert f"{name} {version}" in banner
    assert (STATIC / "console.js").stat().st_size < 150_000  # small: uPlot, jsdiff's word diff, the pages


def test_series_buckets_rates_and_percentiles() -> None:
    now = [1000.0]
    series = BackendSeries(bucket_s=5.0, horizon_s=60.0, clock=lambda: now[0])

    def finished(backend: str, status: int = 200, ttft: float | None = 0.1, tokens: int = 11,
                 seconds: float = 1.1, error: str = "") -> RequestRecord:
        rec = RequestRecord("r", "POST", "/generate", started=50.0, backend=backend, status=status, ttft=ttft,
                            generated_tokens=tokens, error=error)
        rec.ended = rec.started + seconds
        return rec

    series.observe(finished("a"))
    series.observe(finished("a", status=503, ttft=None, tokens=0))
    series.observe(finished("a", error="UpstreamError: reset"))
    series.observe(finished("a", status=429, ttft=None, tokens=0))  # the client's fault: not an error
    series.observe(finished(""))  # not a generation: not counted
    now[0] = 1007.0
    series.observe(finished("b", ttft=0.3, tokens=1))  # one token: no TPOT
    snap = series.snapshot(15.0, backends=["c"])
    assert snap["bucket_s"] == 5.0 and set(snap["backends"]) == {"a", "b", "c"}
    a, b, c = (snap["backends"][n] for n in "abc")
    assert a["t"] == [995.0, 1000.0, 1005.0]
    assert a["requests_per_s"] == [0.0, 4 / 5, 0.0] and a["error_rate"] == [None, 0.5, None]
    assert a["tokens_per_s"] == [0.0, 22 / 5, 0.0]
    assert a["ttft_p50_s"][1] == pytest.approx(0.1) and a["tpot_p50_s"][1] == pytest.approx(0.1)  # (1.1-0.1)/10
    assert b["requests_per_s"] == [0.0, 0.0, 0.2] and b["tpot_p50_s"] == [None, None, None]
    assert c["requests_per_s"] == [0.0, 0.0, 0.0] and c["ttft_p95_s"] == [None, None, None]
    for _ in range(3 * MAX_SAMPLES):  # a busy bucket keeps a bounded sample
        series.observe(finished("b"))
    assert len(series.buckets["b"][-1].ttft) == MAX_SAMPLES
    now[0] = 1100.0  # past the horizon: forgotten
    series.observe(finished("a"))
    assert set(series.buckets) == {"a"} and len(series.buckets["a"]) == 1


async def test_admin_routes_the_console_reads_and_its_door(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path))  # nothing of the machine's state directory
    with scripted_upstream(openai_text_routes("Hello from afar")) as upstream:
        config = f"""
[backends.far]
type = "openai"
base_url = "{upstream.url}"
model = "m"

[backends.spare]
type = "openai"
base_url = "{upstream.url}"
model = "m"

[models.remote]
routes = [{{backend = "far", weight = 3}}, {{backend = "spare", weight = 1}}]
fallback = ["spare"]
aliases = ["r"]

[auth]
keys = [{{name = "user", key = "user-key-0123456789"}}]
"""
        async with AsyncTestClient(create_app(parse_config(config))) as client:
            page = await client.get("/console")  # no admin key configured: nothing to show, and it says how
            assert page.status_code == 403 and "admin_key" in page.text
        async with AsyncTestClient(create_app(parse_config(f"[server]\nadmin_key = \"{ADMIN}\"\n" + config))) as client:
            page = await client.get("/console")  # open without an API key: it holds no data
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in page.headers["content-security-policy"]
            script = await client.get("/console/static/console.js")
            assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
            assert (await client.get("/console/static/nothing.js")).status_code == 404
            assert (await client.get("/console/static/..%2F__init__.py")).status_code == 404
            assert (await client.get("/admin/models")).status_code == 401
            assert (await client.get("/admin/series")).status_code == 401
            deadline = time.monotonic() + START_TIMEOUT
            while (await client.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, "the backends never became healthy"
                await asyncio.sleep(0.05)
            for _ in range(4):
                r = await client.post("/v1/chat/completions", headers={"authorization": "Bearer user-key-0123456789"},
                                      json={"model": "r", "messages": [{"role": "user", "content": "Hi"}]})
                assert r.status_code == 200
            models = (await client.get("/admin/models", headers=ADMIN_HEADERS)).json()
            assert models["state_store"] is False
            [remote] = models["models"]
            assert remote["name"] == "remote" and remote["aliases"] == ["r"] and remote["fallback"] == ["spare"]
            assert remote["routes"] == [{"backend": "far", "weight": 3.0, "share": 0.75},
                                        {"backend": "spare", "weight": 1.0, "share": 0.25}]
            assert remote["backends"] == {"far": "healthy", "spare": "healthy"}
            assert models["backends"]["far"] == {"type": "openai", "state": "healthy"}
            series = (await client.get("/admin/series?seconds=60", headers=ADMIN_HEADERS)).json()
            assert set(series["backends"]) == {"far", "spare"}
            served = sum(sum(s["requests_per_s"]) * series["bucket_s"] for s in series["backends"].values())
            assert served == pytest.approx(4)
            assert all(len(s["t"]) == 12 for s in series["backends"].values())  # 60 s of 5 s buckets
            report = (await client.get("/admin/migrations", headers=ADMIN_HEADERS)).json()
            assert report["pairs"] == [] and report["divergences"] == []


# every page in a real browser

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if cd.browser_paths() is None:
        pytest.skip("no chromium and chromedriver (apt-get install chromium chromium-driver; deploy/ci/setup.sh)")
    driver = cd.start_browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def console(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("console")
    with running_gateway(console_config(tmp), tmp, env={"LLMGW_STATE_DIR": str(tmp / "state")}) as url:
        feed(url)
        yield url


def rollout(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/admin/rollouts/smollm2", headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_page_in_a_browser(console: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    url, driver = console, browser
    # a rollout held at its first step (it needs an hour there), to show and to pause
    started = httpx.post(f"{url}/admin/rollouts", headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT, json={
        "model": "smollm2", "candidate": "candidate", "steps": [1, 5, 25, 50, 100], "step_min_seconds": 3600})
    assert started.status_code == 201, started.text
    errors: dict[str, list[dict[str, Any]]] = {}
    cd.open_console(driver, url, ADMIN)
    assert "key=" not in driver.current_url  # taken out of the address once kept

    # models and their backends, weights and health
    models = driver.find_element(By.ID, "models")
    assert {row.get_attribute("data-model") for row in models.find_elements(By.CSS_SELECTOR, "tr.model")} == \
        {"smollm2", "mirror"}
    # the rollout's live split (a 1% sliver shows only part of its label: its text content has all of it)
    split = models.find_element(By.CSS_SELECTOR, 'tr.model[data-model="smollm2"] .split').get_attribute("textContent")
    assert "local 99%" in split and "candidate 1%" in split
    assert "rollout running: candidate at 1" in models.text
    backends = {row.get_attribute("data-backend"): row.text for row in
                driver.find_elements(By.CSS_SELECTOR, "#backends tr.backend-row")}
    assert set(backends) == {"local", "candidate"} and all("healthy" in text for text in backends.values())
    errors["models"] = cd.severe_logs(driver)
    cd.screenshot(driver, ARTIFACTS / "models.png")

    # the rollout: steps with the current one highlighted, the gates, the log; pause through the button
    cd.show(driver, "rollouts")
    card = '.rollout[data-model="smollm2"]'
    current = cd.wait_for(driver, cd.css(f"{card} .step.current"), "the current step")
    assert current[0].text == "1%" and current[0].get_attribute("data-step") == "0"
    assert driver.find_element(By.CSS_SELECTOR, card).get_attribute("data-state") == "running"
    assert "start" in driver.find_element(By.CSS_SELECTOR, f"{card} table.decisions").text
    driver.find_element(By.CSS_SELECTOR, f'{card} button[data-action="pause"]').click()
    cd.wait_for(driver, cd.css(f'{card}[data-state="paused"]'), "the card showing the rollout paused")
    wait_until(lambda: rollout(url)["state"] == "paused", "the API saying the rollout is paused")
    assert any(d["action"] == "pause" and d["by"] for d in rollout(url)["decisions"])
    cd.wait_for(driver, cd.css(f"{card} tr.decision.pause"), "the pause in the decision log")
    assert driver.find_element(By.CSS_SELECTOR, f'{card} button[data-action="resume"]').is_enabled()
    assert not driver.find_element(By.CSS_SELECTOR, f'{card} button[data-action="pause"]').is_enabled()
    errors["rollouts"] = cd.severe_logs(driver)
    cd.screenshot(driver, ARTIFACTS / "rollouts.png")

    # charts per backend, drawn by uPlot
    cd.show(driver, "charts")
    for chart in ("ttft", "tpot", "errors", "requests", "tokens"):
        cd.wait_for(driver, cd.css(f"#chart-{chart} .uplot canvas"), f"the {chart} chart")
    legend = driver.find_element(By.CSS_SELECTOR, "#chart-ttft .u-legend").text
    assert "local p50" in legend and "candidate p95" in legend
    errors["charts"] = cd.severe_logs(driver)
    cd.screenshot(driver, ARTIFACTS / "charts.png")

    # the shadow parity report with a diverging answer diffed
    cd.show(driver, "shadow")
    pair = driver.find_element(By.CSS_SELECTOR, '#pairs tr.pair[data-model="mirror"]')
    assert "local → candidate" in pair.text
    cd.wait_for(driver, cd.css(".divergence .diff del, .divergence .diff ins"), "a diff of diverging answers")
    errors["shadow"] = cd.severe_logs(driver)
    cd.screenshot(driver, ARTIFACTS / "shadow.png")

    # keys and usage from the state database
    cd.show(driver, "keys")
    assert "console-test" in driver.find_element(By.CSS_SELECTOR, '#keys tr[data-key="console-test"]').text
    assert driver.find_elements(By.CSS_SELECTOR, "#usage tr.usage")
    errors["keys"] = cd.severe_logs(driver)
    cd.screenshot(driver, ARTIFACTS / "keys.png")

    assert not any(errors.values()), f"the browser logged errors: {errors}"


def test_key_form_and_empty_pages_in_a_browser(browser: Any, tmp_path: Path) -> None:
    """A gateway with no state database, no rollout and no mirrored traffic (a scripted upstream behind it): the
    key typed into the form (a wrong one first), and each page saying there is nothing rather than failing."""
    from selenium.webdriver.common.by import By

    driver = browser
    with scripted_upstream(openai_text_routes("Hello from afar")) as upstream:
        config = f"""
[server]
admin_key = "{ADMIN}"

[backends.far]
type = "openai"
base_url = "{upstream.url}"
model = "m"

[models.remote]
backend = "far"
"""
        # no [state]: rollouts would go to the machine's state directory; this test's own instead
        with running_gateway(config, tmp_path, env={"LLMGW_STATE_DIR": str(tmp_path / "state")}) as url:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                           json={"model": "remote", "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
            driver.get(f"{url}/console#/rollouts")  # another origin than the first test's: no key kept
            form = cd.wait_for(driver, cd.css("#login:not([hidden])"), "the key form")[0]
            form.find_element(By.ID, "key").send_keys("not-the-key")
            form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            cd.wait_for(driver, lambda d: "refused" in d.find_element(By.ID, "login-error").text, "the refusal")
            refused = cd.severe_logs(driver)  # the browser logs the 401 it was answered
            assert refused and all("401" in entry["message"] for entry in refused), refused
            form.find_element(By.ID, "key").send_keys(ADMIN)
            form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            cd.wait_for(driver, cd.css("#page-rollouts[data-loaded] #no-rollouts"), "no rollouts")
            assert driver.find_element(By.ID, "login").get_attribute("hidden") is not None
            cd.show(driver, "models")
            assert driver.find_element(By.CSS_SELECTOR, '#models tr.model[data-model="remote"]')
            cd.show(driver, "shadow")
            assert driver.find_element(By.ID, "no-pairs")
            cd.show(driver, "keys")
            assert "config.toml" in driver.find_element(By.ID, "keys-in-config").text
            cd.show(driver, "charts")
            cd.wait_for(driver, cd.css("#chart-requests .uplot canvas"), "the requests chart")
            assert "far" in driver.find_element(By.CSS_SELECTOR, "#chart-requests .u-legend").text
            assert cd.severe_logs(driver) == []
            driver.find_element(By.ID, "forget").click()  # the key leaves the tab
            cd.wait_for(driver, cd.css("#login:not([hidden])"), "the key form again")
            assert driver.execute_script("return sessionStorage.length") == 0
