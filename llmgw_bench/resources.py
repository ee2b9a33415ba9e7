"""Resource samples taken during a run, on a background thread.

- `--pid`: CPU (percent of one core, summed over the process and its children, as vLLM's engine core is
  a child process) and resident memory, through psutil.
- GPUs: utilization and memory through NVML, when a driver is present.
- The server's `/metrics`: KV-cache usage, waiting and running requests, under this gateway's, vLLM's or
  TGI's names (TGI exports no KV usage); and speculative decoding's counters (this gateway's or vLLM's),
  scraped when the measured requests start and after they end.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVER_GAUGES = {
    "kv_cache_usage": ("llmgw_engine_kv_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "waiting": ("llmgw_engine_waiting_seqs", "vllm:num_requests_waiting", "tgi_queue_size"),
    "running": ("llmgw_engine_running_seqs", "vllm:num_requests_running", "tgi_batch_current_size"),
}

SPEC_COUNTERS = {
    "drafts": ("llmgw_engine_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "draft_tokens": ("llmgw_engine_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "accepted_tokens": ("llmgw_engine_spec_decode_num_accepted_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_total"),
}


def _known(text: str, table: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """The first known name present for each figure, summed over its label sets (one per backend)."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})
            key = repr(sorted(sample.labels.items()))
            found[sample.name][key] = float(sample.value)
    values = {}
    for figure, names in table.items():
        for name in names:
            if name in found:
                values[figure] = sum(found[name].values())
                break
    return values


def parse_server_gauges(text: str) -> dict[str, float]:
    return _known(text, SERVER_GAUGES)


def parse_spec_counters(text: str) -> dict[str, float]:
    """Speculative decoding's cumulative counters, summed over backends; {} where the server has none."""
    values = _known(text, SPEC_COUNTERS)
    return values if len(values) == len(SPEC_COUNTERS) else {}


def spec_acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None] | None:
    """The counters' growth between two scrapes, with vLLM's acceptance rate (accepted / draft tokens) and
    mean acceptance length (1 + accepted / drafts); None without counters."""
    if not after:
        return None
    grown = {figure: after[figure] - before.get(figure, 0.0) for figure in SPEC_COUNTERS}
    drafts, drafted, accepted = grown["drafts"], grown["draft_tokens"], grown["accepted_tokens"]
    return {**grown, "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


class ResourceSampler:
    def __init__(self, *, pid: int | None, metrics_url: str | None, interval: float = 0.5,
                 headers: dict[str, str] | None = None) -> None:
        self.pid, self.metrics_url, self.interval = pid, metrics_url, interval
        self.headers = headers or {}
        self.samples: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmgw-bench-resources", daemon=True)
        self._processes: dict[int, Any] = {}
        self._nvml: Any = None
        self._spec_before: dict[str, float] | None = None

    def __enter__(self) -> ResourceSampler:
        self._open_sources()
        self._zero = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def _open_sources(self) -> None:
        if self.pid is not None:
            import psutil

            try:
                psutil.Process(self.pid).cpu_percent(None)
            except psutil.Error as exc:
                self.notes.append(f"pid {self.pid}: {exc}")
                self.pid = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no driver or no library: no GPU figures
            self._nvml = None
        if self.metrics_url is not None:
            try:
                response = httpx.get(self.metrics_url, headers=self.headers, timeout=5)
                if response.status_code != 200 or not parse_server_gauges(response.text):
                    self.notes.append(f"{self.metrics_url}: no known gauges (status {response.status_code})")
                    self.metrics_url = None
            except (httpx.HTTPError, ValueError) as exc:
                self.notes.append(f"{self.metrics_url}: {exc}")
                self.metrics_url = None

    def mark_start(self) -> None:
        """The measured requests start (the warm-up is over): speculative decoding's counters now."""
        self._spec_before = self._spec_counters()

    def spec_decode(self) -> dict[str, float | None] | None:
        """Speculative decoding over the measured requests (call after they end); None where the server
        reports none."""
        return None if self._spec_before is None else spec_acceptance(self._spec_before, self._spec_counters())

    def _spec_counters(self) -> dict[str, float]:
        if self.metrics_url is None:
            return {}
        try:
            return parse_spec_counters(httpx.get(self.metrics_url, headers=self.headers, timeout=5).text)
        except (httpx.HTTPError, ValueError):
            return {}

    def _loop(self) -> None:
        with httpx.Client(headers=self.headers, timeout=5) as client:
            while not self._stop.wait(self.interval):
                sample: dict[str, Any] = {"t": time.perf_counter() - self._zero}
                sample.update(self._process())
                sample.update(self._gpus())
                if self.metrics_url is not None:
                    try:
                        sample.update(parse_server_gauges(client.get(self.metrics_url).text))
                    except (httpx.HTTPError, ValueError):
                        pass
                self.samples.append(sample)

    def _process(self) -> dict[str, float]:
        if self.pid is None:
            return {}
        import psutil

        try:
            root = psutil.Process(self.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        cpu = rss = 0.0
        for process in family:
            known = self._processes.setdefault(process.pid, process)  # cpu_percent needs the same object
            try:
                cpu += known.cpu_percent(None)
                rss += known.memory_info().rss
            except psutil.Error:
                continue
        return {"cpu_percent": cpu, "rss_mb": rss / 2**20}

    def _gpus(self) -> dict[str, float]:
        if self._nvml is None:
            return {}
        nvml = self._nvml
        values: dict[str, float] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            values[f"gpu{index}_util_percent"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            values[f"gpu{index}_memory_mb"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        return values

    def summary(self) -> dict[str, dict[str, float]]:
        keys = sorted({k for s in self.samples for k in s if k != "t"})
        out = {}
        for key in keys:
            values = [s[key] for s in self.samples if key in s]
            out[key] = {"mean": sum(values) / len(values), "max": max(values)}
        return out
