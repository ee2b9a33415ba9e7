"""Admin routes (behind the admin key): models and backends, the migration parity report, the per-backend time
series the console charts, and hot reload."""

from __future__ import annotations

import hmac
import os
import signal
from typing import Any

from litestar import Controller, Request, get, post
from litestar.params import Parameter

from gateway.config import ConfigError, primary_routes
from gateway.errors import GatewayError
from gateway.serving.fronts import front
from gateway.state import Gateway


def require_admin(gw: Gateway, request: Request) -> None:
    server = gw.config.server
    key = server.resolved_admin_key()
    if not key:
        raise GatewayError("admin routes are off: set server.admin_key or server.admin_key_env", kind="unauthorized",
                           status=403)
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), key.encode()):  # constant time: no key leaks by timing
        raise GatewayError("a valid admin key is needed (Authorization: Bearer ...)", kind="unauthorized")


class AdminController(Controller):
    path = "/admin"
    tags = ["Admin"]

    @get("/migrations", summary="Shadow-traffic parity report per model and backend pair",
         operation_id="migration_report")
    async def migrations(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        require_admin(gateway, request)
        return {"config_version": gateway.config.version, "backends": gateway.backend_states(),
                "pairs": gateway.shadows.report(), "divergences": gateway.shadows.recent_divergences()}

    @get("/models", summary="Each model's aliases, weighted routes, fallbacks, shadow and its backends' states",
         operation_id="model_routes")
    async def models(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        """The routing as configured (a rollout in progress moves live weights: see /admin/rollouts)."""
        require_admin(gateway, request)
        config, states = gateway.config, gateway.backend_states()
        models = []
        for name, model in config.models.items():
            routes = primary_routes(model)
            total = sum(r.weight for r in routes) or 1.0
            used = [r.backend for r in routes] + list(model.fallback) + ([model.shadow.backend] if model.shadow else [])
            models.append({
                "name": name, "default": name == config.default_model, "aliases": list(model.aliases),
                "routes": [{"backend": r.backend, "weight": r.weight, "share": r.weight / total} for r in routes],
                "sticky": model.sticky, "fallback": list(model.fallback),
                "shadow": {"backend": model.shadow.backend, "sample": model.shadow.sample} if model.shadow else None,
                "backends": {b: states.get(b, "unknown") for b in dict.fromkeys(used)}})
        return {"config_version": config.version, "models": models,
                "backends": {name: {"type": entry.type, "state": states.get(name, "unknown")}
                             for name, entry in config.backends.items()},
                "state_store": gateway.accounts.store is not None}

    @get("/series", summary="Per-backend request rate, tokens/s, error rate, TTFT and TPOT in 5 s buckets",
         operation_id="backend_series")
    async def series(self, gateway: Gateway, request: Request,
                     seconds: float = Parameter(default=600.0, gt=0, le=86400,
                                                description="How far back (at most the 30 minutes kept)")
                     ) -> dict[str, Any]:
        require_admin(gateway, request)
        series = request.app.state.series
        return series.snapshot(seconds, backends=list(gateway.backends))

    @get("/backends", summary="Each backend's state, and each replica's of a pool (engine workers included)",
         operation_id="backend_states")
    async def backends(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        """What /health's 503 body says, at any time: a pool that still serves (so /health is 200) names
        here the replicas that do not, e.g. an engine worker being restarted."""
        require_admin(gateway, request)
        return {"config_version": gateway.config.version, "backends": gateway.backend_states()}

    @post("/reload", summary="Validate and apply the config file", operation_id="reload", status_code=200)
    async def reload(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        require_admin(gateway, request)
        previous = gateway.config.version
        if front() is not None:  # every front reloads; the supervisor starts any new engine worker first
            os.kill(os.getppid(), signal.SIGHUP)
        try:
            config = await gateway.reload()
        except ConfigError as exc:
            raise GatewayError(f"config refused, nothing changed: {exc}", kind="config") from None
        return {"config_version": config.version, "previous_version": previous, "changed": config.version != previous}
