"""The tables of config.toml as frozen structs, each key with its doc string (the configuration reference is
generated from them: docs/hooks/reference_pages/config_page.py). gateway/config.py reads a file into them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from gateway.rollout.spec import RolloutSpec


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[server]`: where the gateway listens, its request limits, health checks, telemetry and timeouts."""

    host: str = "127.0.0.1"
    """Address to listen on (`llmgw serve --host` overrides it)."""
    port: int = 8080
    """Port to listen on (`llmgw serve --port` overrides it)."""
    max_concurrent_requests: int = 128
    """Requests the whole gateway serves at once; over it: 429 at once (as TGI). Models may set a lower limit
    of their own."""
    max_stop_sequences: int = 4
    """Stop sequences one request may give (TGI `stop`, OpenAI `stop`); more: 422."""
    max_top_n_tokens: int = 5
    """Largest TGI `top_n_tokens` a request may ask for."""
    max_best_of: int = 2
    """Largest TGI `best_of` a request may ask for."""
    max_client_batch_size: int = 4
    """What TGI's /info reports as `max_client_batch_size`."""
    max_n: int = 16
    """Largest OpenAI `n` (choices per request)."""
    admin_key: str | None = None
    """The key of /admin/* (as `Bearer <key>`); or the name of an environment variable in admin_key_env.
    None (and no admin_key_env): the admin routes are off."""
    admin_key_env: str | None = None
    """The environment variable holding the admin key; when it is set, it wins over admin_key."""
    health_check_interval: float = 10.0
    """Seconds between active health checks of every backend."""
    eject_after_failures: int = 3
    """Consecutive failures that open a backend's circuit (for eject_cooldown seconds)."""
    eject_cooldown: float = 30.0
    """Seconds a backend's circuit stays open after eject_after_failures consecutive failures."""
    watch_config: bool = False
    """Reload when the config file changes (polled once a second)."""
    sticky_header: str = "x-session-id"
    """The request header that `sticky = "header"` reads."""
    telemetry: bool = True
    """Metrics, access log and request ids (off only to measure what they cost)."""
    tgi_metrics: bool = False
    """Also expose TGI's metric names on /metrics (dashboards built for TGI)."""
    traces: Literal["none", "console", "otlp"] = "none"
    """OpenTelemetry exporter; otlp needs its package."""
    log_format: Literal["json", "console"] = "json"
    """Format of the access log lines."""
    log_text: bool = False
    """Put prompt and output text in the access log (off: never logged)."""
    metrics_per_key: bool = False
    """Per-API-key request and token counters (labels: key names, never secrets)."""
    max_key_series: int = 100
    """With metrics_per_key: at most this many keys by name; the rest count under "other"."""
    max_body_bytes: int = 2_000_000
    """Largest request body, in bytes (TGI's default --payload-limit); over it: 413."""
    body_timeout: float = 30.0
    """Seconds a client may take to send its request body; over it: 408."""
    send_timeout: float = 60.0
    """Seconds one response write may wait on a client that does not read."""
    drain_timeout: float = 30.0
    """On SIGTERM: seconds requests in flight get to finish before exit."""
    sse_keepalive: float = 15.0
    """Seconds a stream may go without an event before it gets a keep-alive comment (`:`), as TGI's axum."""
    workers: int | Literal["auto"] = 1
    """Front-end processes serving the port, as vLLM's `--api-server-count` ("auto": one per core this process
    may use). Over 1, they share the engine workers, the `[state]` store (required) and /metrics."""

    def resolved_admin_key(self) -> str | None:
        """The admin key: from the environment variable named in admin_key_env, else admin_key."""
        return (os.environ.get(self.admin_key_env) if self.admin_key_env else None) or self.admin_key


class WeightedRoute(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[[models.<name>.routes]]`: one backend of a weighted split."""

    backend: str
    """The backend (a `[backends.<name>]` table) that serves this share."""
    weight: float = 1.0
    """Relative weight: this route's share is its weight over the sum of the model's weights (> 0)."""


class ShadowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[models.<name>.shadow]`: mirror requests to a candidate backend and compare its answers."""

    backend: str
    """The candidate backend that mirrored requests go to; its answers are compared, never returned."""
    sample: float = 1.0
    """Share of requests mirrored, 0-1."""
    max_concurrency: int = 4
    """Mirrored requests in flight at once; over it they are dropped (and counted)."""


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[models.<name>]`: one model clients call by name, the backends that serve it, and its limits."""

    backend: str | None = None
    """The one backend that serves the model; or give routes."""
    routes: list[WeightedRoute] = []
    """A weighted split across backends, instead of backend."""
    sticky: str | None = None
    """Either "header" (server.sticky_header) or "user" (OpenAI `user`): same key, same backend of the split."""
    fallback: list[str] = []
    """Backends tried in order when the chosen backend fails before the first token."""
    shadow: ShadowConfig | None = None
    """Mirror a sample of requests to a candidate backend."""
    aliases: list[str] = []
    """Other names clients may call the model by."""
    max_input_tokens: int | None = None
    """Longest prompt, in tokens; default: max_total_tokens - 1."""
    max_total_tokens: int | None = None
    """Prompt + generated tokens; default: the backend's context length (4096 when it does not say)."""
    default_max_new_tokens: int | None = None
    """Tokens to generate when a request gives no limit; default: what the context allows."""
    max_new_tokens: int | None = None
    """Cap on the tokens a request may ask to generate; None: no cap but the context."""
    chat_template: str | None = None
    """A Jinja chat template that overrides the model's own."""
    max_concurrent_requests: int | None = None
    """Requests generating on this model at once; None: only the server's limit."""
    max_queued_requests: int = 0
    """Over the model's concurrency limit, up to this many wait (for max_queue_wait seconds); 0: 429 at once."""
    max_queue_wait: float = 30.0
    """Seconds a queued request waits for a place at most, then 429."""
    request_timeout: float | None = None
    """Seconds for a whole generation, whatever the backend; None: the backend's own timeouts only."""
    retries: int = 0
    """Retries of the same backend before its first token (then the next fallback tier)."""
    retry_backoff: float = 0.1
    """Base of the exponential backoff between retries, in seconds, with full jitter."""
    rollout: RolloutSpec | None = None
    """A staged move to another backend (gateway/rollout/)."""


class ApiKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[[auth.keys]]`: one API key, the models it may use and its limits."""

    name: str
    """Shown in logs and metrics instead of the key."""
    key: str | None = None
    """The key itself (at least 8 characters); or give key_env."""
    key_env: str | None = None
    """The environment variable holding the key."""
    models: list[str] = []
    """Models (or aliases) it may use; empty: all."""
    requests_per_minute: int | None = None
    """Requests a minute; None: unlimited."""
    tokens_per_minute: int | None = None
    """Prompt + generated tokens a minute; None: unlimited."""
    max_tokens_per_day: int | None = None
    """Token budget of a UTC day: prompt + generated tokens; None: unlimited."""
    max_tokens_per_month: int | None = None
    """Token budget of a UTC month: prompt + generated tokens; None: unlimited."""


class AuthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[auth]`: API keys and which routes need one."""

    keys: list[ApiKey] = []
    """The API keys; none (and no stored keys): the generation routes are open."""
    protect_health: bool = False
    """/health, /ping, /info need a key too."""
    protect_metrics: bool = False
    """/metrics needs a key (any key, or the admin key)."""


class StateConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[state]`: keys, usage and stored Responses in a database; limits shared through Redis."""

    database: str | None = None
    """sqlite:///PATH or postgresql://...; default: state.db in the state directory."""
    database_env: str | None = None
    """Or the environment variable holding that URL (it may carry a password)."""
    redis: str | None = None
    """redis://host:port/db: rate limits and budgets shared by every replica; None: each replica counts its own."""
    redis_env: str | None = None
    """Or the environment variable holding the Redis URL."""
    fail_open: bool = True
    """Redis unreachable: serve without shared limits (true) or answer 503 (false)."""
    lease_fraction: float = 0.01
    """With redis: each replica takes this share of a key's requests- and tokens-per-minute limits from Redis
    at a time and admits from it in memory (at most this much over the limit per replica); 0: every request
    asks Redis. Keys with a day or month budget, or limits too small for a lease of 10 requests, always ask."""
    auto_migrate: bool = True
    """Upgrade the schema at start (false: `llmgw state migrate` must have run)."""
    key_refresh_interval: float = 2.0
    """Seconds between key snapshot refreshes (Postgres also notifies)."""
    record_usage: bool = True
    """One usage row per request (needs server.telemetry)."""
    log_content: bool = False
    """Usage rows carry prompt and output text."""
    usage_buffer_rows: int = 100_000
    """Usage rows held while the database is unreachable; then the oldest go."""
    usage_batch_rows: int = 500
    """Usage rows written in one statement; a full batch is written at once, without waiting for the interval."""
    usage_flush_interval: float = 1.0
    """Seconds between usage writes; after a failed write the wait doubles, up to 10 s."""
    responses_ttl: float = 30 * 86400.0
    """Seconds stored Responses are kept (OpenAI keeps them 30 days)."""

    def resolved_database(self) -> str:
        if self.database_env:
            return os.environ.get(self.database_env, "")
        if self.database:
            return self.database
        return f"sqlite:///{state_directory() / 'state.db'}"

    def resolved_redis(self) -> str | None:
        return os.environ.get(self.redis_env) or None if self.redis_env else self.redis


def state_directory() -> Path:
    """$LLMGW_STATE_DIR, else /var/lib/llmgw for root, else $XDG_STATE_HOME/llmgw (~/.local/state/llmgw)."""
    if os.environ.get("LLMGW_STATE_DIR"):
        return Path(os.environ["LLMGW_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/lib/llmgw")
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"
