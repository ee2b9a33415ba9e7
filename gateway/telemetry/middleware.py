"""One ASGI middleware per request: request id in and out, the request record in a context
variable, and when the response ends, its metrics, access log line and trace span."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from gateway.telemetry.logging import log_request
from gateway.telemetry.record import RequestRecord, current_record

if TYPE_CHECKING:
    from gateway.state import Gateway

QUIET_PATHS = ("/metrics", "/health", "/ping")  # probes and scrapes: neither counted nor logged
STORED_RESPONSE = "/v1/responses/"


def route_label(path: str) -> str:
    """The path as a metric label: a stored response's id is folded away, or each id would be a series."""
    return f"{STORED_RESPONSE}{{id}}" if path.startswith(STORED_RESPONSE) else path


class TelemetryMiddleware:
    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        request_id, traceparent = "", None
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
            elif key == b"traceparent":
                traceparent = value.decode("latin-1")
        rec = RequestRecord(request_id or uuid.uuid4().hex, scope["method"], scope["path"])
        rec.route = route_label(scope["path"])
        self.gateway.tracing.start_request(rec, traceparent)
        token = current_record.set(rec)
        metrics = self.gateway.metrics
        metrics.child(metrics.in_flight, rec.route).inc()
        done = False

        async def send_recorded(message: dict[str, Any]) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-request-id", rec.request_id.encode())]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not done:
                done = True
                self._finish(rec)

        try:
            await self.app(scope, receive, send_recorded)
        finally:
            if not done:
                done = True
                rec.status = rec.status or 499  # the client left before the end
                self._finish(rec)
            current_record.reset(token)

    def _finish(self, rec: RequestRecord) -> None:
        rec.ended = time.perf_counter()
        gw = self.gateway
        gw.metrics.child(gw.metrics.in_flight, rec.route).dec()
        gw.metrics.observe_request(rec)
        gw.accounts.record(rec)
        for observe in gw.request_observers:
            observe(rec)
        gw.tracing.end_request(rec)
        fields: dict[str, Any] = {
            "request_id": rec.request_id, "method": rec.method, "route": rec.route, "model": rec.model or None,
            "backend": rec.backend or None, "status": rec.status, "finish_reason": rec.finish_reason or None,
            "prompt_tokens": rec.prompt_tokens, "generated_tokens": rec.generated_tokens,
            "ttft_ms": round(rec.ttft * 1000, 2) if rec.ttft is not None else None,
            "duration_ms": round((rec.ended - rec.started) * 1000, 2)}
        if rec.replica:
            fields["replica"], fields["balance"] = rec.replica, rec.balance
        if (handover := rec.handover) is not None:
            fields.update(pd_path=handover.path, decode_replica=handover.decode_replica,
                          prefill_replica=handover.prefill_replica, kv_transfer_bytes=handover.num_bytes,
                          kv_transfer_ms=round(handover.seconds * 1000, 2), pd_fallback=handover.fallback)
        if rec.adapter:
            fields["adapter"] = rec.adapter
        if rec.key_name:
            fields["key"] = rec.key_name
        if rec.error:
            fields["error"] = rec.error
        if gw.config.server.log_text:
            fields["prompt"] = rec.prompt_text
            fields["output"] = rec.output_text
        log_request(fields)
