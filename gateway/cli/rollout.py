"""`llmgw rollout start|status|pause|resume|promote|abort|step-back`: a running gateway's /admin/rollouts."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway.cli.admin import admin_request

ACTIONS = ("pause", "resume", "promote", "abort", "step-back")


def _rollout(args: argparse.Namespace) -> int:
    if args.action != "status" and not args.model:
        print(f"llmgw: rollout {args.action} needs --model", file=sys.stderr)
        return 2
    if args.action == "start":
        body: dict[str, Any] = {"model": args.model, "candidate": args.candidate}
        if args.steps:
            body["steps"] = [float(s) for s in args.steps.split(",")]
        for field in ("step_min_seconds", "step_min_requests", "shadow_seconds"):
            if getattr(args, field) is not None:
                body[field] = getattr(args, field)
        answer = admin_request(args, "POST", "/admin/rollouts", json=body)
    elif args.action == "status":
        answer = admin_request(args, "GET", f"/admin/rollouts/{args.model}" if args.model else "/admin/rollouts")
    else:
        answer = admin_request(args, "POST", f"/admin/rollouts/{args.model}/{args.action}")
    if answer is None:
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    for rollout in answer.get("rollouts", [answer]):
        print(describe(rollout))
    return 0


def describe(r: dict[str, Any]) -> str:
    """A rollout in a few lines: where it is, its gates, its last decision."""
    steps = " ".join(f"[{s:g}%]" if i == r["step"] else f"{s:g}%" for i, s in enumerate(r["steps"]))
    lines = [f"{r['model']}: {r['baseline']} -> {r['candidate']}  {r['state']}, candidate at {r['weight']:g}%  "
             f"steps {'[shadow] ' if r['step'] < 0 else ''}{steps}"]
    for g in r["gates"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        lines.append(f"  {g['name']:<22} {value:>8} (limit {g['threshold']:g})  {g['status']:<12} "
                     f"n={g['baseline_samples']}/{g['candidate_samples']}")
    if r.get("decisions"):
        d = r["decisions"][-1]
        lines.append(f"  last decision: {d['action']} by {d['by']}: {d['reason']}")
    return "\n".join(lines)


def add_parsers(sub: Any) -> None:
    rollout = sub.add_parser("rollout", help="start and steer staged rollouts on a running gateway")
    rollout.add_argument("action", choices=["start", "status", *ACTIONS])
    rollout.add_argument("--url", default="http://127.0.0.1:8080")
    rollout.add_argument("--admin-key", default=None, help="default: $LLMGW_ADMIN_KEY")
    rollout.add_argument("--model", help="the model (status: all when omitted)")
    rollout.add_argument("--candidate", help="start: the backend to move the model to")
    rollout.add_argument("--steps", help="start: candidate percents, e.g. 1,5,25,50,100")
    rollout.add_argument("--step-min-seconds", type=float)
    rollout.add_argument("--step-min-requests", type=int)
    rollout.add_argument("--shadow-seconds", type=float, help="start: mirror only, this long, before the first step")
    rollout.add_argument("--json", action="store_true")
    rollout.set_defaults(func=_rollout)
