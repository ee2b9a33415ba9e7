"""What a replica says about its own load, read from its Prometheus `/metrics` text.

Each server names the same three figures differently (GIE's model-server protocol table, llm-d's
metric extractors; see the reference note on replica routing): requests waiting, requests running,
and KV-cache usage in [0, 1]. Counts are summed over a series' label sets (one per model or engine),
KV usage is their mean.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from backends.base import describe

log = logging.getLogger("llmgw")

# figure → the names it goes by, first found wins
# (this gateway's own engine names before TGI's, which it also serves with `tgi_metrics = true`)
WAITING = ("vllm:num_requests_waiting", "llmgw_engine_waiting_seqs", "tgi_queue_size", "sglang:num_queue_reqs",
           "trtllm_num_requests_waiting", "nv_inference_pending_request_count")
RUNNING = ("vllm:num_requests_running", "llmgw_engine_running_seqs", "tgi_batch_current_size",
           "sglang:num_running_reqs", "trtllm_num_requests_running")
# vllm:gpu_cache_usage_perc is the name vLLM used before 0.10 (removed since); both are accepted
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llmgw_engine_kv_usage_ratio",
            "sglang:token_usage", "trtllm_kv_cache_utilization")


class ReplicaSignals(msgspec.Struct, kw_only=True):
    """One reading; None where the replica did not report the figure."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    at: float = 0.0  # time.monotonic() of the reading

    def fresh(self, stale_after: float, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) - self.at <= stale_after


def parse_metrics(text: str, at: float | None = None) -> ReplicaSignals:
    """The three figures from a /metrics body. Raises ValueError for text that is not Prometheus'."""
    sums: dict[str, float] = {}
    wanted = set(WAITING + RUNNING + KV_USAGE)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            values = [s.value for s in family.samples if s.name == family.name]
            if values:
                sums[family.name] = sum(values) / (len(values) if family.name in KV_USAGE else 1)

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    return ReplicaSignals(waiting=first(WAITING), running=first(RUNNING), kv_usage=first(KV_USAGE),
                          at=time.monotonic() if at is None else at)


def signals_of(load: Any) -> ReplicaSignals:
    """The figures of a replica that reports them itself (an engine worker's `load()`), not over HTTP."""

    def get(key: str) -> float | None:
        value = load.get(key) if isinstance(load, dict) else getattr(load, key, None)
        return float(value) if value is not None else None

    sent_at = get("sent_at")  # a worker's own monotonic time of the figures (the clock is system-wide)
    return ReplicaSignals(waiting=get("waiting"), running=get("running"), kv_usage=get("kv_usage"),
                          at=sent_at if sent_at is not None else time.monotonic())


def metrics_url(base_url: str, path: str, port: int | None = None) -> str:
    """Where a replica's /metrics is: its own address, or the same host on another port."""
    parts = urlsplit(base_url)
    netloc = parts.netloc
    if port is not None:
        netloc = f"{netloc.rsplit(':', 1)[0] if parts.port else netloc}:{port}"
    return urlunsplit((parts.scheme, netloc, path, "", ""))


class Scraper:
    """Reads each replica's figures into `replica.signals`: an engine worker's own report, else its /metrics."""

    def __init__(self, pool: str, settings: Any) -> None:
        self.pool = pool
        self.settings = settings
        self._client: httpx.AsyncClient | None = None  # made on first use, inside the running loop

    async def scrape(self, replica: Any) -> None:
        reported = getattr(replica.backend, "load", None)
        try:
            if callable(reported):
                figures = reported()
                if figures is not None:
                    replica.signals = signals_of(figures)
                return
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=min(self.settings.scrape_interval * 2, 5.0))
            url = metrics_url(replica.id, self.settings.scrape_path, self.settings.metrics_port)
            response = await self._client.get(url)
            if response.status_code == 200:
                replica.signals = parse_metrics(response.text)
        except Exception as exc:  # a replica that does not answer keeps its last figures, which go stale
            log.debug("backend %s: scraping %s failed: %s", self.pool, replica.id, describe(exc))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
