"""Rollout admin routes (behind the admin key): start one, watch it, and steer it.

`GET /admin/rollouts/{model}/analysis` is the gate for teams that already run Argo Rollouts or Flagger:
Argo's `web` metric provider reads `$.results.ok` from the GET; Flagger's webhooks POST to the same path
and read the status (200: go on, 412: halt)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import Parameter

from gateway.errors import GatewayError
from gateway.rollout.manager import RolloutError
from gateway.rollout.rollout import Rollout
from gateway.rollout.spec import RolloutSpec
from gateway.routes.admin import require_admin
from gateway.state import Gateway

ACTIONS = {"pause": "pause", "resume": "resume", "promote": "promote", "abort": "abort", "step-back": "step_back"}
ModelName = Annotated[str, Parameter(pattern=r"^[^\s/]{1,200}$", description="A model's name")]
Action = Annotated[str, Parameter(pattern=f"^({'|'.join(ACTIONS)})$", description="What to do with the rollout")]


class RolloutStart(RolloutSpec, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str


def view(rollout: Rollout, decisions: list[dict[str, Any]] | None = None, leader: bool = False) -> dict[str, Any]:
    return {"model": rollout.model, "baseline": rollout.baseline, "candidate": rollout.spec.candidate,
            "state": rollout.state, "step": rollout.step, "steps": rollout.spec.steps, "weight": rollout.weight,
            "epoch": rollout.epoch, "step_started": rollout.step_started, "looks": rollout.looks,
            "gates": rollout.gates, "window": rollout.window, "spec": msgspec.to_builtins(rollout.spec),
            "decisions": decisions or [], "leader": leader}


def analysis(rollout: Rollout) -> dict[str, Any]:
    failed = [g["name"] for g in rollout.gates if g["status"] == "fail"]
    waiting = [g["name"] for g in rollout.gates if g["status"] == "inconclusive"]
    ok = rollout.state == "promoted" or (rollout.active and rollout.state != "paused" and not failed and not waiting
                                         and bool(rollout.gates))
    return {"model": rollout.model, "state": rollout.state, "step": rollout.step, "weight": rollout.weight,
            "results": {"ok": 1.0 if ok else 0.0, "failed": 1.0 if failed or rollout.state == "rolled_back" else 0.0,
                        "failed_gates": failed, "inconclusive_gates": waiting},
            "gates": {g["name"]: {"value": g["value"], "threshold": g["threshold"], "status": g["status"]}
                      for g in rollout.gates}}


def _refused(exc: RolloutError) -> GatewayError:
    kind = {404: "model_not_found", 409: "validation"}.get(exc.status, "validation")
    return GatewayError(str(exc), kind=kind, status=exc.status, code="rollout_conflict" if exc.status == 409 else None)


class RolloutsAdminController(Controller):
    path = "/admin/rollouts"
    tags = ["Admin"]

    @get("", summary="Every rollout: state, step, weights, the last gate figures", operation_id="list_rollouts")
    async def list_rollouts(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        require_admin(gateway, request)
        m = gateway.rollouts
        return {"rollouts": [view(r, leader=m.leading) for r in m.status()]}

    @post("", summary="Start a rollout of a model to a candidate backend", operation_id="start_rollout",
          status_code=201)
    async def start(self, gateway: Gateway, request: Request) -> dict[str, Any]:
        require_admin(gateway, request)
        try:
            body = msgspec.json.decode(await request.body(), type=RolloutStart, strict=True)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise GatewayError(f"invalid rollout: {exc}", kind="validation", status=400) from None
        spec = msgspec.convert({k: v for k, v in msgspec.to_builtins(body).items() if k != "model"}, RolloutSpec)
        try:
            rollout = await gateway.rollouts.start(body.model, spec, by="admin API")
        except RolloutError as exc:
            raise _refused(exc) from None
        return view(rollout, await gateway.rollouts.decisions(rollout.model))

    @get("/{model:str}", summary="One rollout, with its decision log", operation_id="get_rollout")
    async def get_one(self, gateway: Gateway, request: Request, model: ModelName) -> dict[str, Any]:
        require_admin(gateway, request)
        try:
            rollout = gateway.rollouts.get(model)
            return view(rollout, await gateway.rollouts.decisions(model), gateway.rollouts.leading)
        except RolloutError as exc:
            raise _refused(exc) from None

    @get("/{model:str}/analysis", summary="The gates as Argo Rollouts' web provider reads them ($.results.ok)",
         operation_id="rollout_analysis")
    async def analysis_get(self, gateway: Gateway, request: Request, model: ModelName) -> dict[str, Any]:
        require_admin(gateway, request)
        try:
            return analysis(gateway.rollouts.get(model))
        except RolloutError as exc:
            raise _refused(exc) from None

    @post("/{model:str}/analysis", summary="Flagger webhook: 200 while every gate passes, 412 otherwise",
          operation_id="rollout_webhook", status_code=200)
    async def analysis_post(self, gateway: Gateway, request: Request, model: ModelName) -> Response:
        result = await self.analysis_get.fn(self, gateway, request, model)
        return Response(result, status_code=200 if result["results"]["ok"] else 412)

    @post("/{model:str}/{action:str}", summary="pause, resume, promote, abort or step-back",
          operation_id="rollout_action", status_code=200)
    async def act(self, gateway: Gateway, request: Request, model: ModelName, action: Action) -> dict[str, Any]:
        require_admin(gateway, request)
        try:
            rollout = await gateway.rollouts.act(model, ACTIONS[action], by="admin API")
            return view(rollout, await gateway.rollouts.decisions(model), gateway.rollouts.leading)
        except RolloutError as exc:
            raise _refused(exc) from None
