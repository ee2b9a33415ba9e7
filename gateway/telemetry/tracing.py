"""OpenTelemetry traces: a span per request with the GenAI semantic-convention attributes, and
children for routing, the backend call, and (engine) queueing, prefill and decode. The incoming
`traceparent` is honoured; remote backends get one whose parent is our backend-call span.
Off by default, and then nothing here costs anything."""

from __future__ import annotations

import logging
import time
from typing import Any

from backends.base import GenerationRequest, TokenEvent
from gateway.telemetry.record import RequestRecord

log = logging.getLogger("llmgw")


def _now_ns() -> int:
    return time.time_ns()


class Tracing:
    def __init__(self, exporter: str = "none", provider: Any = None) -> None:
        self.enabled = exporter != "none" or provider is not None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if provider is None:
            provider = TracerProvider(resource=Resource.create({"service.name": "llm-gateway"}))
            if exporter == "console":
                provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            elif exporter == "otlp":
                try:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                except ImportError:
                    log.error("traces = \"otlp\" needs the opentelemetry-exporter-otlp package; tracing is off")
                    self.enabled = False
                    return
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.provider = provider
        self.tracer = provider.get_tracer("llm-gateway")
        self.propagator = TraceContextTextMapPropagator()

    def start_request(self, rec: RequestRecord, traceparent: str | None) -> None:
        if not self.enabled:
            return
        parent = self.propagator.extract({"traceparent": traceparent}) if traceparent else None
        rec.span = self.tracer.start_span(f"{rec.method} {rec.path}", context=parent, start_time=_now_ns())

    def _child(self, rec: RequestRecord, name: str, start_time: int | None = None) -> Any:
        from opentelemetry import trace

        context = trace.set_span_in_context(rec.span)
        return self.tracer.start_span(name, context=context, start_time=start_time or _now_ns())

    def routed(self, rec: RequestRecord | None, model: str, tiers: list[str], request: GenerationRequest) -> None:
        if not self.enabled or rec is None or rec.span is None:
            return
        span = self._child(rec, "route")
        span.set_attribute("llmgw.model", model)
        span.set_attribute("llmgw.tiers", tiers)
        span.end()
        rec.span.set_attribute("gen_ai.request.model", model)
        rec.span.set_attribute("gen_ai.request.max_tokens", request.max_new_tokens)
        rec.span.set_attribute("gen_ai.request.temperature", request.temperature)
        rec.span.set_attribute("gen_ai.request.top_p", request.top_p)
        if request.seed is not None:
            rec.span.set_attribute("gen_ai.request.seed", request.seed)

    def backend_call(self, rec: RequestRecord | None, backend: str, request: GenerationRequest
                     ) -> tuple[Any, GenerationRequest]:
        """A span for one backend attempt, and the request carrying a traceparent under it."""
        if not self.enabled or rec is None or rec.span is None:
            return None, request
        import msgspec

        span = self._child(rec, f"backend {backend}")
        span.set_attribute("llmgw.backend", backend)
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return span, msgspec.structs.replace(request, traceparent=carrier.get("traceparent"))

    def end_backend_call(self, span: Any, sent_ns: int, first: TokenEvent | None, first_ns: int | None,
                         error: str | None = None) -> None:
        """End the backend span; for the engine, add its queue, prefill and decode as children."""
        if span is None:
            return
        from opentelemetry import trace

        end_ns = _now_ns()
        if first is not None and first.queue_seconds is not None and first_ns is not None:
            context = trace.set_span_in_context(span)
            scheduled_ns = sent_ns + int(first.queue_seconds * 1e9)
            for name, start_ns, stop_ns in (("queue", sent_ns, scheduled_ns), ("prefill", scheduled_ns, first_ns),
                                            ("decode", first_ns, end_ns)):
                self.tracer.start_span(name, context=context, start_time=start_ns).end(end_time=max(start_ns, stop_ns))
        if error:
            span.set_attribute("error.type", error)
        span.end(end_time=end_ns)

    def end_request(self, rec: RequestRecord) -> None:
        if not self.enabled or rec.span is None:
            return
        span = rec.span
        span.set_attribute("gen_ai.operation.name", "chat" if rec.path.endswith("/chat/completions") else
                           "text_completion")
        span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", rec.generated_tokens)
        if rec.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [rec.finish_reason])
        if rec.backend:
            span.set_attribute("llmgw.backend", rec.backend)
        span.set_attribute("http.response.status_code", rec.status)
        span.end()
