"""`llmgw serve`, `llmgw check-config`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from gateway.cli.admin import admin_request
from gateway.cli.migration_report import format_report
from gateway.cli.rollout import add_parsers as add_rollout_parsers
from gateway.cli.state import add_parsers as add_state_parsers
from gateway.config import ConfigError, load_config
from gateway.serving.fronts import FrontSupervisor, front, resolved_workers, reuse_port_socket
from gateway.telemetry.logging import configure_logging


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.serving.draining_server import DrainingServer

    config = load_config(args.config)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    here = front()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s{_front_tag(here)}: "
                        "%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is noise
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the state store logs its own migration line
    configure_logging(config.server.log_format)
    if here is None:
        print(config.describe(), file=sys.stderr)
        if resolved_workers(config) > 1:
            return FrontSupervisor(config, args.config, host, port, args.log_level).run()
    app = create_app(config, config_path=args.config)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, access_log=False),  # our own access log
                            app.state.gateway)
    # a front listens on a socket of its own beside the other fronts' (SO_REUSEPORT)
    server.run(sockets=[reuse_port_socket(host, port)] if here is not None else None)
    return 0


def _front_tag(here: tuple[int, int] | None) -> str:
    return f" [front {here[0]} pid %(process)d]" if here is not None else ""


def _check_config(args: argparse.Namespace) -> int:
    config = load_config(args.path)
    print(config.describe())
    return 0


def _migration_report(args: argparse.Namespace) -> int:
    report = admin_request(args, "GET", "/admin/migrations")
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `llmgw` parser. `bench` is only listed here: main() hands the rest of its line to llmgw_bench's."""
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
    report = sub.add_parser("migration-report", help="show a running gateway's shadow-traffic parity report")
    report.add_argument("--url", required=True)
    report.add_argument("--admin-key", default=None, help="default: $LLMGW_ADMIN_KEY")
    report.add_argument("--json", action="store_true")
    report.set_defaults(func=_migration_report)
    add_state_parsers(sub)
    add_rollout_parsers(sub)
    # listed for --help; its own parser reads the rest of the line
    sub.add_parser("bench", help="TTFT and tokens/s of any TGI or OpenAI endpoint; `bench compare A.json B.json`")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from llmgw_bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"llmgw: invalid config: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
