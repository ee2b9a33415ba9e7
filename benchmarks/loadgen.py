"""A lean HTTP/1.1 load generator (raw asyncio, keep-alive) so the client costs little CPU.

`run(url_host, port, raw_request, concurrency, count|duration)` sends the same request over
`concurrency` persistent connections and returns per-request latency, TTFT (time until a marker
byte string first appears in the body) and the achieved request rate.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def p(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, float]:
        return {"requests": len(self.latencies), "errors": self.errors, "req_per_s": self.rate,
                "latency_p50_ms": 1000 * self.p(self.latencies, 0.5),
                "latency_p90_ms": 1000 * self.p(self.latencies, 0.9),
                "latency_mean_ms": 1000 * statistics.fmean(self.latencies) if self.latencies else float("nan"),
                "ttft_p50_ms": 1000 * self.p(self.ttfts, 0.5), "ttft_p90_ms": 1000 * self.p(self.ttfts, 0.9)}


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes,
               marker: bytes | None) -> tuple[bool, float, float | None]:
    started = time.perf_counter()
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    ok = head.startswith(b"HTTP/1.1 200")
    lower = head.lower()
    ttft = None
    if b"transfer-encoding: chunked" in lower:
        seen = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            if marker is not None and ttft is None:
                seen = seen[-64:] + data
                if marker in seen:
                    ttft = time.perf_counter() - started
    else:
        start = lower.index(b"content-length:") + 15
        length = int(lower[start:lower.index(b"\r\n", start)])
        data = await reader.readexactly(length)
        if marker is not None and marker in data:
            ttft = time.perf_counter() - started
    return ok, time.perf_counter() - started, ttft


async def run(host: str, port: int, raw: bytes, concurrency: int, *, count: int | None = None,
              duration: float | None = None, marker: bytes | None = None) -> Result:
    result = Result()
    remaining = [count if count is not None else 10**9]
    deadline = time.perf_counter() + (duration or 10**9)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while remaining[0] > 0 and time.perf_counter() < deadline:
                remaining[0] -= 1
                try:
                    ok, latency, ttft = await _one(reader, writer, raw, marker)
                except (asyncio.IncompleteReadError, ConnectionError):
                    result.errors += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                    continue
                if ok:
                    result.latencies.append(latency)
                    if ttft is not None:
                        result.ttfts.append(ttft)
                else:
                    result.errors += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result
