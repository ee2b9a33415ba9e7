"""Driving the admin console (/console) in a real browser: Debian's chromium through Selenium and the system
chromedriver (package chromium-driver). Nothing is downloaded: the driver and browser paths are given, and
SE_OFFLINE keeps Selenium Manager from fetching either. Shared by tests/test_console.py and
benchmarks/console_screenshots.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx

from tests.server import CLIENT_TIMEOUT, WAIT, wait_until

PAGES = ["models", "rollouts", "charts", "shadow", "keys"]
ADMIN = "console-admin-key-0123"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")

ENGINE = """
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 64
max_num_seqs = 8
"""


def console_config(tmp: Path) -> str:
    """Two engines of the embedded model: `local` serves both models, `candidate` is the rollout's candidate
    for smollm2 and mirrors every request to `mirror`. A state database for keys, usage and the rollout."""
    return f"""
default_model = "smollm2"

[server]
admin_key = "{ADMIN}"

[state]
database = "sqlite:///{tmp / 'state.db'}"

[backends.local]{ENGINE}
[backends.candidate]{ENGINE}
[models.smollm2]
backend = "local"
aliases = ["SmolLM2-135M-Instruct"]

[models.mirror]
backend = "local"
shadow = {{ backend = "candidate", sample = 1.0 }}
"""


def feed(url: str) -> dict[str, str]:
    """Traffic for every page, with a stored key (with a state database, every request needs one; its header is
    returned): greedy requests to the model under rollout, sampled ones to the mirrored model until the shadow
    report holds a diverging pair (two samples of 16 tokens at temperature 1.5 differ; the loop only bounds the
    wait)."""
    created = httpx.post(f"{url}/admin/keys", headers=ADMIN_HEADERS, json={"name": "console-test", "rpm": 600},
                         timeout=CLIENT_TIMEOUT)
    assert created.status_code == 201, created.text
    auth = {"authorization": f"Bearer {created.json()['key']}"}
    for _ in range(4):
        r = httpx.post(f"{url}/generate", headers=auth, timeout=CLIENT_TIMEOUT,
                       json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text

    def diverged() -> bool:
        r = httpx.post(f"{url}/models/mirror/generate", headers=auth, timeout=CLIENT_TIMEOUT, json={
            "inputs": "Tell me a story", "parameters": {"max_new_tokens": 16, "do_sample": True, "temperature": 1.5}})
        assert r.status_code == 200, r.text
        report = httpx.get(f"{url}/admin/migrations", headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT).json()
        return bool(report["divergences"])

    wait_until(diverged, "a diverging mirrored answer", interval=0.5)
    return auth


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) from PATH (or LLMGW_CHROMIUM / LLMGW_CHROMEDRIVER); None when either is missing."""
    browser = os.environ.get("LLMGW_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM)), None)
    driver = os.environ.get("LLMGW_CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser(width: int = 1400, height: int = 1000) -> Any:
    """A headless chromium that keeps every console message for `severe_logs`."""
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager: never download a browser or a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = browser_paths()
    if paths is None:
        raise RuntimeError("no chromium and chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox",  # root in CI: chromium's sandbox needs a user namespace
                "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    driver.set_page_load_timeout(WAIT)
    driver.set_script_timeout(WAIT)
    return driver


def wait_for(driver: Any, condition: Any, what: str, timeout: float = WAIT) -> Any:
    """Poll `condition(driver)` until truthy; on time out, say what the page said went wrong, if anything."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)
    except TimeoutException:
        said = driver.execute_script("const e = document.getElementById('page-error'); return e && e.textContent")
        raise AssertionError(f"not within {timeout:g} s: {what} (the page's error: {said or 'none'}; "
                             f"the browser's log: {driver.get_log('browser')})") from None


def css(selector: str) -> Any:
    """A condition: the elements matching `selector`, once there is at least one."""
    from selenium.webdriver.common.by import By

    return lambda driver: driver.find_elements(By.CSS_SELECTOR, selector) or False


def open_console(driver: Any, url: str, key: str) -> None:
    """The console's first load, with the key given once in the address (the page keeps it in sessionStorage and
    takes it out of the address)."""
    driver.get(f"{url}/console?key={key}#/models")
    wait_for(driver, css("#page-models[data-loaded]"), "the models page")


def show(driver: Any, page: str) -> None:
    """Go to a page and wait until it has drawn its data once (the page sets data-loaded)."""
    driver.execute_script("window.location.hash = arguments[0]", f"#/{page}")
    wait_for(driver, css(f"#page-{page}[data-loaded]"), f"the {page} page drawn")


def severe_logs(driver: Any) -> list[dict[str, Any]]:
    """The browser's console messages of level SEVERE since the last call (JS errors, failed requests)."""
    return [entry for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def screenshot(driver: Any, path: Path) -> Path:
    """A PNG of the whole page, not only the window: the window grows to the page's height first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    size = driver.get_window_size()
    height = driver.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    driver.set_window_size(size["width"], max(600, min(int(height) + 120, 6000)))
    try:
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(size["width"], size["height"])
    return path
