"""The `llmgw` command line: `serve`, `check-config`, `migration-report` and the parser (`commands.py`),
`state` and `keys` (`state.py`), `rollout` (`rollout.py`), the admin requests they share (`admin.py`);
`bench` is llmgw_bench's."""

from gateway.cli.commands import main

__all__ = ["main"]
