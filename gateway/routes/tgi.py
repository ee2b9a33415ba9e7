"""TGI's routes: /generate, /generate_stream, / (compat), /info, /health, /tokenize,
and the per-model mounts /models/{model}/generate[_stream]."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from backends.base import TokenEvent, TokenLogprob
from gateway import __version__
from gateway.closing import close_detached
from gateway.errors import GatewayError
from gateway.generation import Collected, Served, generate_whole, start, unless_disconnected
from gateway.params.tgi import ValidTgiRequest, validate_tgi
from gateway.policy.auth import KeyRing, current_principal
from gateway.protocol.tgi import (
    BestOfSequence,
    CompatGenerateRequest,
    Details,
    GenerateRequest,
    GenerateResponse,
    Info,
    PrefillToken,
    SimpleToken,
    StreamDetails,
    StreamResponse,
    Token,
)
from gateway.routing.admission import Admission
from gateway.routing.router import ModelRoute
from gateway.sse import SSEStream, sse_event
from gateway.state import Gateway
from gateway.telemetry.record import current_record

COMPUTE_TYPE = os.environ.get("COMPUTE_TYPE", "llm-gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "x-compute-type": COMPUTE_TYPE}


def _token(e: TokenEvent) -> Token:
    return Token(id=e.token_id, text=e.token_text, logprob=e.logprob, special=e.special)


def _top(entries: list[TokenLogprob]) -> list[Token]:
    return [Token(id=t.token_id, text=t.text, logprob=t.logprob, special=False) for t in entries]


def _generated_text(v: ValidTgiRequest, result: Collected) -> str:
    # TGI decodes every generated token, so a stop sequence is part of the text
    text = result.text + (result.last.stop_string or "")
    return v.core.prompt + text if v.return_full_text and v.core.prompt else text


def _details(v: ValidTgiRequest, result: Collected) -> Details:
    p = v.params
    prefill = [PrefillToken(id=t.token_id, text=t.text, logprob=t.logprob) for t in result.prompt_tokens or []]
    details = Details(
        finish_reason=str(result.last.finish_reason), generated_tokens=result.usage.completion_tokens,
        seed=result.last.seed if v.sampling else None, prefill=prefill if p.decoder_input_details else [],
        tokens=[_token(e) for e in result.events])
    if p.top_n_tokens:
        details.top_tokens = [_top(e.top_logprobs) for e in result.events]
    return details


async def _generate(gw: Gateway, route: ModelRoute, v: ValidTgiRequest) -> tuple[GenerateResponse, Collected]:
    if v.best_of == 1:
        result = await generate_whole(gw, route, v.core)
        others: list[Collected] = []
    else:  # best_of: sample several, keep the most likely
        copies = [msgspec.structs.replace(v.core, request_id=f"{v.core.request_id}-{i}",
                                          seed=random.getrandbits(63)) for i in range(v.best_of)]
        results = await asyncio.gather(*(generate_whole(gw, route, c) for c in copies))
        ranked = sorted(results, key=lambda r: r.sum_logprob, reverse=True)
        result, others = ranked[0], ranked[1:]
    response = GenerateResponse(generated_text=_generated_text(v, result))
    if v.params.details or v.params.decoder_input_details:
        response.details = _details(v, result)
        if others:
            response.details.best_of_sequences = [
                BestOfSequence(generated_text=_generated_text(v, o), finish_reason=str(o.last.finish_reason),
                               generated_tokens=o.usage.completion_tokens, seed=o.last.seed,
                               prefill=_details(v, o).prefill, tokens=[_token(e) for e in o.events])
                for o in others]
    return response, result


def _timing_headers(started: float, validated: float, result: Collected, inputs: str) -> dict[str, str]:
    now = time.perf_counter()
    queue = (result.events[0].queue_seconds or 0.0) if result.events else 0.0
    inference = max(0.0, now - validated - queue)
    n = max(1, len(result.events))
    return {
        "x-compute-type": COMPUTE_TYPE, "x-compute-time": f"{now - started:.6f}",
        "x-compute-characters": str(len(inputs)), "x-total-time": str(int((now - started) * 1000)),
        "x-validation-time": str(int((validated - started) * 1000)), "x-queue-time": str(int(queue * 1000)),
        "x-inference-time": str(int(inference * 1000)), "x-time-per-token": str(int(inference * 1000 / n)),
        "x-prompt-tokens": str(result.usage.prompt_tokens), "x-generated-tokens": str(len(result.events)),
    }


async def _stream_events(admission: Admission, served: Served, v: ValidTgiRequest) -> AsyncIterator[bytes]:
    """The SSE body. Primed to its first `yield` by the handler, so its `finally` (leaving the
    admission count, closing the backend stream) runs however the response ends."""
    index = 0
    text = ""
    try:
        yield b""
        async for e in served.events:
            index += 1
            text += e.text
            event = StreamResponse(index=index, token=_token(e))
            if v.params.top_n_tokens:
                event.top_tokens = _top(e.top_logprobs)
            if e.finished:
                full = text + (e.stop_string or "")
                event.generated_text = v.core.prompt + full if v.return_full_text and v.core.prompt else full
                if v.params.details:
                    event.details = StreamDetails(
                        finish_reason=str(e.finish_reason),
                        generated_tokens=e.usage.completion_tokens if e.usage else index,
                        seed=e.seed if v.sampling else None,
                        input_length=v.input_length if v.input_length is not None else
                        (e.usage.prompt_tokens if e.usage else 0))
            yield sse_event(event)
    except GatewayError as err:
        yield sse_event(err.tgi_body())
    finally:
        admission.release()
        await close_detached(served.events)


def _error_stream(err: GatewayError) -> AsyncIterator[bytes]:
    async def one() -> AsyncIterator[bytes]:
        yield sse_event(err.tgi_body())

    return one()


def _note_validation(started: float, validated: float) -> None:
    rec = current_record.get()
    if rec is not None:
        rec.validation = validated - started


def _route(gw: Gateway, request: Request, model: str | None) -> ModelRoute:
    route = gw.router.require(model, header_key=request.headers.get(gw.config.server.sticky_header))
    KeyRing.authorize(current_principal.get(), route.name)
    rec = current_record.get()
    if rec is not None:
        rec.model = route.name
    return route


class TgiController(Controller):
    tags = ["TGI"]

    async def _generate_response(self, gw: Gateway, route: ModelRoute, data: GenerateRequest, compat: bool,
                                 request: Request) -> Response:
        started = time.perf_counter()
        async with gw.admit(route):
            v = await validate_tgi(data, route, gw.config.server, stream=False, compat=compat,
                                   traceparent=request.headers.get("traceparent"))
            validated = time.perf_counter()
            _note_validation(started, validated)
            response, result = await unless_disconnected(request.receive, _generate(gw, v.route, v))
        headers = _timing_headers(started, validated, result, data.inputs) | v.route.served_headers(result.backend)
        return Response([response] if compat else response, headers=headers, status_code=200)

    async def _stream_response(self, gw: Gateway, route: ModelRoute, data: GenerateRequest, compat: bool,
                               request: Request) -> Stream:
        headers = {**SSE_HEADERS, "x-compute-characters": str(len(data.inputs))}
        started = time.perf_counter()
        try:
            v = await validate_tgi(data, route, gw.config.server, stream=True, compat=compat,
                                   traceparent=request.headers.get("traceparent"))
            _note_validation(started, time.perf_counter())
            admission = await gw.enter(route)
        except GatewayError as err:  # TGI streams start before validation: errors arrive as events
            return Stream(_error_stream(err), media_type="text/event-stream", headers=headers, status_code=200)
        route = v.route
        try:
            served = await start(gw, route, v.core)  # the first token decides who serves (x-backend)
        except BaseException as exc:
            admission.release()
            if not isinstance(exc, GatewayError):
                raise
            return Stream(_error_stream(exc), media_type="text/event-stream", headers=headers, status_code=200)
        body = _stream_events(admission, served, v)
        await body.__anext__()
        return SSEStream(body, headers=headers | route.served_headers(served.backend))

    @post("/generate", summary="Generate tokens", operation_id="generate")
    async def generate(self, data: GenerateRequest, gateway: Gateway, request: Request) -> Response:
        route = _route(gateway, request, None)
        return await self._generate_response(gateway, route, data, compat=False, request=request)

    @post("/generate_stream", summary="Generate a stream of tokens (SSE)", operation_id="generate_stream")
    async def generate_stream(self, data: GenerateRequest, gateway: Gateway, request: Request) -> Stream:
        route = _route(gateway, request, None)
        return await self._stream_response(gateway, route, data, compat=False, request=request)

    @post("/", summary="TGI compat: a one-element list, or a stream with `stream: true`",
          operation_id="compat_generate")
    async def compat_generate(self, data: CompatGenerateRequest, gateway: Gateway,
                              request: Request) -> Response | Stream:
        route = _route(gateway, request, None)
        if data.stream:
            return await self._stream_response(gateway, route, data, compat=True, request=request)
        return await self._generate_response(gateway, route, data, compat=True, request=request)

    @post("/models/{model:str}/generate", summary="Generate with a named model", operation_id="model_generate")
    async def model_generate(self, model: str, data: GenerateRequest, gateway: Gateway,
                             request: Request) -> Response:
        route = _route(gateway, request, model)
        return await self._generate_response(gateway, route, data, compat=False, request=request)

    @post("/models/{model:str}/generate_stream", summary="Stream with a named model",
          operation_id="model_generate_stream")
    async def model_generate_stream(self, model: str, data: GenerateRequest, gateway: Gateway,
                                    request: Request) -> Stream:
        route = _route(gateway, request, model)
        return await self._stream_response(gateway, route, data, compat=False, request=request)

    @post("/tokenize", summary="Tokenize inputs", operation_id="tokenize", status_code=200)
    async def tokenize(self, data: GenerateRequest, gateway: Gateway) -> list[SimpleToken]:
        route = gateway.router.require(None)
        if not data.inputs:
            raise GatewayError("`inputs` cannot be empty", param="inputs")
        spans = await route.backend.tokenize(data.inputs)
        truncate = data.parameters.truncate if data.parameters else None
        if truncate:
            spans = spans[-truncate:]
        return [SimpleToken(id=s.id, text=s.text, start=s.start, stop=s.stop) for s in spans]

    @get("/info", summary="Model and router info", operation_id="get_model_info")
    async def info(self, gateway: Gateway) -> Info:
        route = gateway.router.require(None)
        server = gateway.config.server
        dtype = getattr(route.backend, "dtype", lambda: None)()  # only the engine knows its weights' dtype
        speculative = getattr(route.backend, "speculative", lambda: None)()
        return Info(model_id=route.name, model_dtype=dtype[0] if dtype else None,
                    dtype_reason=dtype[1] if dtype else None, speculative=speculative,
                    max_concurrent_requests=server.max_concurrent_requests,
                    max_best_of=server.max_best_of, max_stop_sequences=server.max_stop_sequences,
                    max_input_tokens=route.max_input_tokens, max_total_tokens=route.max_total_tokens,
                    max_client_batch_size=server.max_client_batch_size, version=__version__,
                    router="llm-gateway", config_version=gateway.config.version)

    @get("/health", summary="200 when every model is ready to serve, else 503 (readiness)", operation_id="health")
    async def health(self, gateway: Gateway) -> Response:
        return _readiness(gateway)

    @get("/ping", summary="The same as /health (SageMaker's name)", operation_id="ping")
    async def ping(self, gateway: Gateway) -> Response:
        return _readiness(gateway)


def _readiness(gateway: Gateway) -> Response:
    """200, or TGI's 503 body plus what is not ready: each backend's state (a starting engine names its
    step: "starting: loading weights from ... (3 s so far)") and whether the server is draining. A state
    database that cannot be read or written does not make the gateway unready; the body says so."""
    store = gateway.accounts.status()
    usage = store and store["usage"]
    degraded = store is not None and not (store["available"] and (usage is None or usage["available"]))
    if gateway.healthy():
        if degraded:  # still serving (known keys work, usage is buffered), but someone should look
            body = {"status": "degraded", "state_store": store}
            return Response(msgspec.json.encode(body), status_code=200, media_type="application/json")
        return Response(b"", status_code=200, media_type="text/plain")
    body = {"error": "unhealthy", "error_type": "healthcheck", "draining": gateway.draining,
            "backends": gateway.backend_states(), **({"state_store": store} if degraded else {})}
    return Response(msgspec.json.encode(body), status_code=503, media_type="application/json")
