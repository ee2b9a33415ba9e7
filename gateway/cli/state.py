"""`llmgw state migrate|check` (the state database's schema) and `llmgw keys create|list|revoke`
(a running gateway's `/admin/keys`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from gateway.cli.admin import admin_request
from gateway.config import ConfigError, load_config


def _state_url(args: argparse.Namespace) -> str:
    if args.database_env:
        if not os.environ.get(args.database_env):
            raise ConfigError(f"--database-env: environment variable {args.database_env} is not set")
        return os.environ[args.database_env]
    if args.database:
        return args.database
    config = load_config(args.config)
    if config.state is None:
        raise ConfigError(f"{args.config}: no [state] table (or give --database URL)")
    return config.state.resolved_database()


def _state(args: argparse.Namespace) -> int:
    from gateway.store.database import SchemaError, check_schema, connect, migrate

    url = _state_url(args)

    async def run() -> int:
        engine = connect(url)
        try:
            if args.action == "migrate":
                before, now = await migrate(engine)
                print(f"state database: {before or 'empty'} -> {now}" if before != now
                      else f"state database: at {now}, nothing to do")
            else:
                await check_schema(engine)
                print("state database: schema current")
            return 0
        except SchemaError as exc:
            print(f"llmgw: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:
            print(f"llmgw: cannot use the state database: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _keys(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if (args.action == "create" and not args.name) or (args.action == "revoke" and not args.id):
        print(f"llmgw: keys {args.action} needs --{'name' if args.action == 'create' else 'id'}", file=sys.stderr)
        return 2
    if args.action == "create":
        body = {"name": args.name, "models": args.model or [], "metadata": dict(kv.split("=", 1) for kv in args.meta)}
        for field in ("rpm", "tpm", "max_tokens_per_day", "max_tokens_per_month", "expires_at"):
            if getattr(args, field) is not None:
                body[field] = getattr(args, field)
        answer = admin_request(args, "POST", "/admin/keys", json=body)
    elif args.action == "list":
        answer = admin_request(args, "GET", "/admin/keys", params={"include_revoked": str(args.all).lower()})
    else:
        answer = admin_request(args, "DELETE", f"/admin/keys/{args.id}")
    if answer is None:
        return 1
    if args.json or args.action != "list":
        print(json.dumps(answer, indent=2))
        if args.action == "create":
            print("The secret (\"key\") is shown only once: store it now.", file=sys.stderr)
        return 0
    print(f"{'id':<30} {'name':<24} {'source':<7} {'rpm':>8} {'tpm':>10} {'tokens/day':>12} {'tokens/month':>13}")
    for k in answer["data"]:
        cells = [k["rpm"], k["tpm"], k["max_tokens_per_day"], k["max_tokens_per_month"]]
        rpm, tpm, day, month = ("-" if c is None else str(c) for c in cells)
        revoked = " (revoked)" if k.get("revoked_at") else ""
        print(f"{k['id']:<30} {k['name']:<24} {k['source']:<7} {rpm:>8} {tpm:>10} {day:>12} {month:>13}{revoked}")
    return 0


def add_parsers(sub: Any) -> None:
    state = sub.add_parser("state", help="the state database: `migrate` applies the schema, `check` verifies it")
    state.add_argument("action", choices=["migrate", "check"])
    state.add_argument("--config", default="config.toml", help="its [state] database is used")
    state.add_argument("--database", default=None, help="a database URL instead of the config's")
    state.add_argument("--database-env", default=None,
                       help="the environment variable holding that URL (keeps a password off the command line)")
    state.set_defaults(func=_state)

    keys = sub.add_parser("keys", help="manage a running gateway's stored API keys (/admin/keys)")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("--url", default="http://127.0.0.1:8080")
    keys.add_argument("--admin-key", default=None, help="default: $LLMGW_ADMIN_KEY")
    keys.add_argument("--name", help="create: the key's name")
    keys.add_argument("--model", action="append", help="create: a model it may use (repeat); default: all")
    keys.add_argument("--rpm", type=int)
    keys.add_argument("--tpm", type=int)
    keys.add_argument("--max-tokens-per-day", type=int)
    keys.add_argument("--max-tokens-per-month", type=int)
    keys.add_argument("--expires-at", help="create: RFC 3339 time, e.g. 2027-01-01T00:00:00Z")
    keys.add_argument("--meta", action="append", default=[], help="create: KEY=VALUE metadata (repeat)")
    keys.add_argument("--id", help="revoke: the key's id")
    keys.add_argument("--all", action="store_true", help="list: revoked keys too")
    keys.add_argument("--json", action="store_true")
    keys.set_defaults(func=_keys)
