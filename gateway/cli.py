"""`llmgw serve`, `llmgw check-config`."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.config import ConfigError, load_config


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    config = load_config(args.config)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is noise
    print(config.describe(), file=sys.stderr)
    uvicorn.run(create_app(config), host=host, port=port, log_level=args.log_level, timeout_graceful_shutdown=30)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = load_config(args.path)
    print(config.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw", description="LLM serving gateway (TGI and OpenAI protocols)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the models in a config file")
    serve.add_argument("--config", default="config.toml")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate a config file and print what it would serve")
    check.add_argument("path")
    check.set_defaults(func=_check_config)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"llmgw: invalid config: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
