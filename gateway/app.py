"""The Litestar application: routes, dependency injection, lifespan, and protocol-shaped errors."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.di import Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig

from backends.base import Backend
from gateway import __version__, sse
from gateway.config import ConfigError, GatewayConfig
from gateway.errors import GatewayError
from gateway.generation import ClientGone
from gateway.policy.guards import AuthMiddleware, ClientLimitsMiddleware
from gateway.routes.admin import AdminController
from gateway.routes.console import ConsoleController
from gateway.routes.keys_admin import KeysAdminController
from gateway.routes.lora_admin import LoraAdminController
from gateway.routes.messages import MessagesController
from gateway.routes.openai import OpenAIController
from gateway.routes.responses import ResponsesController
from gateway.routes.rollouts_admin import RolloutsAdminController
from gateway.routes.tgi import TgiController
from gateway.serving.fronts import LISTEN_WAIT, listens_once_started
from gateway.state import Gateway
from gateway.telemetry.middleware import TelemetryMiddleware
from gateway.telemetry.series import BackendSeries

log = logging.getLogger("llmgw")


async def _reload_logged(gateway: Gateway) -> None:
    try:
        config = await gateway.reload()
        log.info("SIGHUP: config %s active", config.version)
    except ConfigError as exc:
        log.error("SIGHUP: config refused, nothing changed: %s", exc)


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def _respond(request: Request, err: GatewayError) -> Response:
    return Response(**err.response_args_for(request.url.path))


def _on_gateway_error(request: Request, exc: GatewayError) -> Response:
    return _respond(request, exc)


def _on_validation_error(request: Request, exc: ValidationException) -> Response:
    """A body that does not decode into the route's type: name the field and what is wrong."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    first = problems[0] if problems and isinstance(problems[0], dict) else {}
    key = first.get("key") if first.get("key") not in (None, "data") else None
    detail = first.get("message") or exc.detail
    if _is_openai(request):
        message = f"{key}: {detail}" if key else str(detail)
        return _respond(request, GatewayError(message, param=key))
    message = f"Failed to deserialize the JSON body into the target type: {f'{key}: ' if key else ''}{detail}"
    return Response({"error": message, "error_type": "validation"}, status_code=422)


def _on_http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    detail = exc.detail
    if status == 400 and "malformed" in str(detail).lower():
        detail = f"Failed to parse the request body as JSON: {detail}"
    kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 401: "unauthorized"}
    error = GatewayError(str(detail), kind="validation", status=status, code=kind.get(status))
    if _is_openai(request):
        return _respond(request, error)
    return Response({"error": str(detail), "error_type": kind.get(status, "validation")}, status_code=status)


def _on_client_gone(request: Request, exc: ClientGone) -> Response:
    # nobody reads this: the client has gone; the work was cancelled and its resources freed
    return Response(b"", status_code=499)


def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _respond(request, GatewayError(f"internal error ({type(exc).__name__})", kind="internal"))


def create_app(config: GatewayConfig, backends: dict[str, Backend] | None = None,
               config_path: str | Path | None = None, tracer_provider: Any = None) -> Litestar:
    gateway = Gateway(config, backends, config_path, tracer_provider)
    sse.keepalive_seconds = config.server.sse_keepalive
    series = BackendSeries()  # the console's charts: /admin/series
    gateway.request_observers.append(series.observe)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await gateway.accounts.open()  # a state database with a schema it does not know stops the start here
        await gateway.rollouts.open()  # a rollout in progress resumes at its stored step
        gateway.start_backends()
        if listens_once_started():
            await gateway.backends_started(LISTEN_WAIT)
        # what imports and start-up made lives as long as the process: out of the collector's way, or each full
        # collection walks some 300,000 objects (about 130 ms; a quarter of the CPU at saturation), as vLLM does
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # SIGHUP reloads the config file
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(_reload_logged(gateway)))
        try:
            yield
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
            await gateway.aclose()

    def provide_gateway() -> Gateway:
        return gateway

    @get("/metrics", summary="Prometheus metrics", operation_id="metrics", include_in_schema=True)
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/live", summary="200 while the process runs (liveness; /health is readiness)", operation_id="live")
    async def live() -> Response:
        return Response(b"", status_code=200)

    # outermost first: the access log sees every answer, limits apply before keys are checked
    middleware: list[Any] = [lambda app: TelemetryMiddleware(app, gateway)] if config.server.telemetry else []
    middleware += [lambda app: ClientLimitsMiddleware(app, gateway), lambda app: AuthMiddleware(app, gateway)]
    app = Litestar(
        route_handlers=[TgiController, OpenAIController, ResponsesController, MessagesController, AdminController,
                        KeysAdminController, LoraAdminController, RolloutsAdminController, ConsoleController,
                        metrics, live],
        middleware=middleware,
        dependencies={"gateway": Provide(provide_gateway, sync_to_thread=False)},
        lifespan=[lifespan],
        exception_handlers={
            GatewayError: _on_gateway_error,
            ClientGone: _on_client_gone,
            ValidationException: _on_validation_error,
            HTTPException: _on_http_error,
            Exception: _on_unexpected,
        },
        openapi_config=OpenAPIConfig(title="llm-gateway", version=__version__, path="/docs"),
        request_max_body_size=None,  # ClientLimitsMiddleware enforces server.max_body_bytes
        debug=False,
    )
    app.state.gateway = gateway
    app.state.series = series
    return app
