"""Admin routes (behind the admin key): the migration parity report and hot reload."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Controller, Request, get, post

from gateway.config import ConfigError
from gateway.errors import GatewayError
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
                "pairs": gateway.shadows.report()}

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
        try:
            config = await gateway.reload()
        except ConfigError as exc:
            raise GatewayError(f"config refused, nothing changed: {exc}", kind="config") from None
        return {"config_version": config.version, "previous_version": previous, "changed": config.version != previous}
