"""TGI's own metric names, types and buckets (protocols.md §1.10), rendered as TGI renders them:
counters without a `_total` suffix, which prometheus_client would add, so this set is written by hand."""

from __future__ import annotations

import threading

from gateway.telemetry.record import RequestRecord

DURATION_BUCKETS = [0.00015 * 1.5**k for k in range(35)]  # TGI: every *duration histogram


class _Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{bound:g}"}} {count}' for bound, count in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum}", f"{name}_count {self.total}"]
        return lines


class TgiMetrics:
    def __init__(self, max_total_tokens: int = 4096) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.success = 0
        self.failures: dict[str, int] = {}
        step = max(1, max_total_tokens // 100)
        token_buckets = [float(step * (i + 1)) for i in range(100)]
        self.histograms = {name: _Histogram(DURATION_BUCKETS) for name in (
            "tgi_request_duration", "tgi_request_validation_duration", "tgi_request_queue_duration",
            "tgi_request_inference_duration", "tgi_request_mean_time_per_token_duration")}
        self.histograms["tgi_request_generated_tokens"] = _Histogram(token_buckets)
        self.histograms["tgi_request_input_length"] = _Histogram(token_buckets)
        self.queue_size = 0
        self.batch_size = 0

    def observe(self, rec: RequestRecord) -> None:
        with self.lock:
            self.count += 1
            if 200 <= rec.status < 300 and not rec.error:
                self.success += 1
                duration = (rec.ended or rec.started) - rec.started
                queue = rec.queue or 0.0
                inference = max(0.0, duration - queue)
                h = self.histograms
                h["tgi_request_duration"].observe(duration)
                if rec.validation is not None:
                    h["tgi_request_validation_duration"].observe(rec.validation)
                h["tgi_request_queue_duration"].observe(queue)
                h["tgi_request_inference_duration"].observe(inference)
                h["tgi_request_mean_time_per_token_duration"].observe(inference / max(1, rec.generated_tokens))
                h["tgi_request_generated_tokens"].observe(rec.generated_tokens)
                h["tgi_request_input_length"].observe(rec.prompt_tokens)
            else:
                kind = {422: "validation", 429: "overloaded", 404: "validation"}.get(rec.status, "generation")
                self.failures[kind] = self.failures.get(kind, 0) + 1

    def render(self) -> bytes:
        with self.lock:
            lines = ["# TYPE tgi_request_count counter", f"tgi_request_count {self.count}",
                     "# TYPE tgi_request_success counter", f"tgi_request_success {self.success}",
                     "# TYPE tgi_request_failure counter"]
            lines += [f'tgi_request_failure{{err="{k}"}} {v}' for k, v in sorted(self.failures.items())]
            for name, histogram in self.histograms.items():
                lines += histogram.render(name)
            lines += ["# TYPE tgi_queue_size gauge", f"tgi_queue_size {self.queue_size}",
                      "# TYPE tgi_batch_current_size gauge", f"tgi_batch_current_size {self.batch_size}"]
        return ("\n".join(lines) + "\n").encode()
