"""Load and unload LoRA adapters at run time, behind the admin key: `POST /admin/lora`, and vLLM's
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` names for clients scripted against vLLM
(which offers them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

An adapter loads into every backend of the model that can load at run time (the engine); remote
backends list theirs in config (`lora_adapters`). Unloading an adapter that requests in flight use is
refused with 409: they finish on it, and the unload can be retried then.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post

from backends.base import AdapterInUseError, Backend, BackendError
from gateway.config import primary_routes
from gateway.errors import GatewayError
from gateway.protocol.lora import LoadLoraAdapterRequest, LoraAdminRequest, LoraAdminResponse, UnloadLoraAdapterRequest
from gateway.routes.admin import require_admin
from gateway.routing.router import backend_adapters
from gateway.state import Gateway


def _targets(gw: Gateway, model: str | None, backend: str | None) -> tuple[str | None, list[tuple[str, Any]]]:
    """The backends an adapter loads into: one named, or those of a model (default: the default model)."""
    if backend is not None:
        if backend not in gw.backends:
            raise GatewayError(f"no backend named `{backend}`", kind="model_not_found", param="backend")
        names = [backend]
    else:
        found = gw.config.resolve_model(model)
        if found is None:
            raise GatewayError(f"The model `{model}` does not exist.", kind="model_not_found", param="model",
                               code="model_not_found")
        model = found[0]
        names = list(dict.fromkeys(r.backend for r in primary_routes(found[1])))
    loaders = [(n, gw.backends[n]) for n in names if hasattr(gw.backends[n], "load_adapter")]
    if not loaders:
        kinds = ", ".join(f"{n} ({gw.backends[n].type_name})" for n in names)
        raise GatewayError(f"backend(s) {kinds} cannot load LoRA adapters at run time; list them in the backend's "
                           "`lora_adapters` in config", kind="validation", status=400, param="backend")
    return model, loaders


def _backend_error(exc: BackendError, param: str) -> GatewayError:
    if isinstance(exc, AdapterInUseError):
        return GatewayError(exc.message, kind="validation", status=409, param=param, code="adapter_in_use")
    error = GatewayError.from_backend(exc)
    error.param = param
    if error.kind == "validation":
        error.status = 400  # vLLM's status for a refused load or unload, in both doors
    return error


async def load(gw: Gateway, name: str, path: str, model: str | None, backend: str | None) -> LoraAdminResponse:
    if not name:
        raise GatewayError("an adapter needs a name", status=400, param="name")
    if gw.config.resolve_model(name) is not None:
        raise GatewayError(f"`{name}` is already a model name; an adapter needs another", status=400, param="name")
    model, targets = _targets(gw, model, backend)
    done: list[Backend] = []
    try:
        for _, target in targets:
            await target.load_adapter(name, path)
            done.append(target)
    except BackendError as exc:
        for target in done:  # all or nothing: a model's backends serve the same adapters
            await target.unload_adapter(name)
        raise _backend_error(exc, "path") from None
    return LoraAdminResponse(name=name, model=model, backends=[n for n, _ in targets], loaded=True)


async def unload(gw: Gateway, name: str, model: str | None, backend: str | None) -> LoraAdminResponse:
    model, targets = _targets(gw, model, backend)
    holding = [(n, b) for n, b in targets if name in backend_adapters(b)]
    if not holding:
        raise GatewayError(f"The lora adapter '{name}' cannot be found.", kind="model_not_found", param="name",
                           code="adapter_not_found")
    for _, target in holding:
        try:
            await target.unload_adapter(name)
        except BackendError as exc:
            raise _backend_error(exc, "name") from None
    return LoraAdminResponse(name=name, model=model, backends=[n for n, _ in holding], loaded=False)


class LoraAdminController(Controller):
    tags = ["Admin"]

    @post("/admin/lora", summary="Load (path) or unload (unload: true) a LoRA adapter", operation_id="admin_lora",
          status_code=200)
    async def admin_lora(self, data: LoraAdminRequest, gateway: Gateway, request: Request) -> LoraAdminResponse:
        require_admin(gateway, request)
        if data.unload:
            return await unload(gateway, data.name, data.model, data.backend)
        if not data.path:
            raise GatewayError("`path` (a PEFT adapter directory) is needed to load an adapter", status=400,
                               param="path")
        return await load(gateway, data.name, data.path, data.model, data.backend)

    @post("/v1/load_lora_adapter", summary="vLLM's name: load a LoRA adapter into the default model",
          operation_id="load_lora_adapter", status_code=200)
    async def load_lora_adapter(self, data: LoadLoraAdapterRequest, gateway: Gateway, request: Request) -> Response:
        require_admin(gateway, request)
        if data.load_inplace and gateway.router.adapter_owner(data.lora_name) is not None:
            await unload(gateway, data.lora_name, None, None)
        await load(gateway, data.lora_name, data.lora_path, None, None)
        return Response(f"Success: LoRA adapter '{data.lora_name}' added successfully.", media_type="text/plain")

    @post("/v1/unload_lora_adapter", summary="vLLM's name: unload a LoRA adapter", operation_id="unload_lora_adapter",
          status_code=200)
    async def unload_lora_adapter(self, data: UnloadLoraAdapterRequest, gateway: Gateway,
                                  request: Request) -> Response:
        require_admin(gateway, request)
        owner = gateway.router.adapter_owner(data.lora_name)
        await unload(gateway, data.lora_name, owner[0] if owner else None, None)
        return Response(f"Success: LoRA adapter '{data.lora_name}' removed successfully.", media_type="text/plain")
