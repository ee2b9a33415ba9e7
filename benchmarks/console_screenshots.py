"""Screenshots of every admin console page for the README: a gateway with two engine backends of the embedded
model, a rollout of one model to the other backend with live traffic (so the charts and the rollout's gates have
figures), mirrored traffic with diverging answers, a stored key with usage; then chromium, as in
tests/test_console.py (tests/console_driver.py), saves one PNG per page.

    .venv/bin/python benchmarks/console_screenshots.py            # docs/console/*.png
    .venv/bin/python benchmarks/console_screenshots.py --seconds 120 --out /tmp/shots
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import console_driver as cd  # noqa: E402
from tests.server import CLIENT_TIMEOUT, ROOT, running_gateway, wait_until  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain what a KV cache is in one sentence.", "Say hello in Spanish."]


def traffic(url: str, auth: dict[str, str], seconds: float, concurrency: int) -> int:
    """Greedy requests to the model under rollout (and a few sampled ones to the mirrored model) for `seconds`."""
    deadline = time.monotonic() + seconds

    def worker(i: int) -> int:
        sent = 0
        with httpx.Client(timeout=CLIENT_TIMEOUT, headers=auth) as client:
            while time.monotonic() < deadline:
                model = "mirror" if (i + sent) % 5 == 4 else "smollm2"
                client.post(f"{url}/models/{model}/generate", json={
                    "inputs": PROMPTS[(i + sent) % len(PROMPTS)],
                    "parameters": {"max_new_tokens": 16, **({"do_sample": True, "temperature": 1.2}
                                                            if model == "mirror" else {})}})
                sent += 1
        return sent

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(worker, range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "console")
    parser.add_argument("--seconds", type=float, default=60.0, help="of traffic before the screenshots")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with running_gateway(cd.console_config(tmp), tmp, env={"LLMGW_STATE_DIR": str(tmp / "state")}) as url:
            auth = cd.feed(url)
            started = httpx.post(f"{url}/admin/rollouts", headers=cd.ADMIN_HEADERS, timeout=CLIENT_TIMEOUT, json={
                "model": "smollm2", "candidate": "candidate", "steps": [25, 50, 100], "step_min_seconds": 3600,
                "analysis_interval": 1})
            started.raise_for_status()
            print(f"{traffic(url, auth, args.seconds, args.concurrency)} requests in {args.seconds:g} s")

            def looked() -> bool:
                r = httpx.get(f"{url}/admin/rollouts/smollm2", headers=cd.ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
                return bool(r.json()["gates"])

            try:
                wait_until(looked, "the rollout's first look", timeout=60)
            except AssertionError as exc:
                print(f"{exc}: the rollout page shows no gate figures")
            driver = cd.start_browser(width=1400, height=900)
            try:
                cd.open_console(driver, url, cd.ADMIN)
                for page in cd.PAGES:
                    cd.show(driver, page)
                    if page == "charts":  # the traffic's minutes fill the narrowest window
                        driver.execute_script("document.querySelector('button[data-seconds=\"300\"]').click()")
                    print(cd.screenshot(driver, args.out / f"{page}.png"))
                    if errors := cd.severe_logs(driver):
                        print(f"{page}: the browser logged errors: {errors}")
            finally:
                driver.quit()


if __name__ == "__main__":
    main()
