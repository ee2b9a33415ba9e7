"""config.toml → a frozen, validated snapshot.

Every error names the TOML key path and what is wrong; nothing here raises anything but
ConfigError for a bad file.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from backends.registry import backend_types, get_backend_class
from gateway.rollout.spec import RolloutSpec


class ConfigError(Exception):
    pass


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


class BackendEntry(msgspec.Struct, frozen=True):
    name: str
    type: str
    settings: Any  # the backend type's own Settings struct


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The whole config.toml, validated."""

    server: ServerConfig
    """`[server]`; absent: every default."""
    auth: AuthConfig = AuthConfig()
    """`[auth]`: API keys; absent: the generation routes are open."""
    state: StateConfig | None = None
    """`[state]`; None: keys from the config only, limits and stored Responses per process."""
    backends: dict[str, BackendEntry]
    """`[backends.<name>]`: at least one; each table's `type` picks its backend type and keys."""
    models: dict[str, ModelConfig]
    """`[models.<name>]`: at least one; the name (or an alias) is what clients call."""
    default_model: str
    """The model (or alias) served when a request names none; default: the first `[models]` table."""
    source: str = "<memory>"
    version: str = "0"  # a digest of the file's text: what `x-config-version` reports

    def resolve_model(self, name: str | None) -> tuple[str, ModelConfig] | None:
        """The canonical model name and its settings for a name or alias; None if unknown."""
        if name is None:
            name = self.default_model
        if name in self.models:
            return name, self.models[name]
        for canonical, model in self.models.items():
            if name in model.aliases:
                return canonical, model
        return None

    def describe(self) -> str:
        lines = [f"config {self.source}: {len(self.models)} model(s), {len(self.backends)} backend(s)"]
        for name, model in self.models.items():
            default = " (default)" if name == self.default_model else ""
            aliases = f" aliases={model.aliases}" if model.aliases else ""
            if model.backend:
                split = f"backend {model.backend} (type {self.backends[model.backend].type})"
            else:
                split = "routes " + ", ".join(f"{r.backend} (type {self.backends[r.backend].type}) weight {r.weight:g}"
                                              for r in model.routes)
            extra = (f" fallback={model.fallback}" if model.fallback else "") + \
                (f" shadow={model.shadow.backend}@{model.shadow.sample:g}" if model.shadow else "") + \
                (f" rollout to {model.rollout.candidate} in steps {', '.join(f'{s:g}%' for s in model.rollout.steps)}"
                 if model.rollout and model.rollout.candidate != model.backend else "")
            lines.append(f"  model {name}{default} -> {split}{aliases}{extra}")
        lines.append(self._describe_keys())
        for name, entry in self.backends.items():
            described = getattr(entry.settings, "describe", None)  # a backend type may say more of itself
            if described is not None:
                lines.append(f"  backend {name} (type {entry.type}): {described()}")
        return "\n".join(lines)


    def _describe_keys(self) -> str:
        keys = f"{len(self.auth.keys)} config key(s)"
        if self.state is None:
            return f"  keys: {keys}; rate limits and budgets per replica (no [state]); stored Responses in memory"
        database = self.state.resolved_database()
        scheme, _, rest = database.partition("://")
        where = f"{scheme}://{rest.rpartition('@')[2]}"  # no credentials
        limits = ("shared by every replica through Redis" if self.state.resolved_redis() else
                  "per replica (no [state] redis: each replica admits the full limit)")
        usage = "usage rows on" if self.state.record_usage else "usage rows off"
        return f"  keys: {keys} + stored keys in {where}; {usage}; rate limits and budgets {limits}"


def primary_routes(model: ModelConfig) -> list[WeightedRoute]:
    return list(model.routes) if model.routes else [WeightedRoute(model.backend or "", 1.0)]


_TOP_LEVEL = {"server", "auth", "state", "backends", "models", "default_model"}


def _where(prefix: str, exc: msgspec.ValidationError) -> str:
    """msgspec says `... - at `$.field[0]``; turn that into a TOML key path."""
    text = str(exc)
    match = re.search(r" - at `\$(.*)`$", text)
    path = prefix
    if match:
        path += re.sub(r"\[(\d+)\]", r"[\1]", match.group(1))
        text = text[: match.start()]
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", text)
    if unknown:
        return f"{path}.{unknown.group(1)}: unknown key"
    return f"{path}: {text}"


def _convert(raw: Any, cls: type, prefix: str) -> Any:
    try:
        return msgspec.convert(raw, type=cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_where(prefix, exc)) from None


def parse_config(text: str, source: str = "<memory>") -> GatewayConfig:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    for key in raw:
        if key not in _TOP_LEVEL:
            raise ConfigError(f"{key}: unknown key (expected one of {sorted(_TOP_LEVEL)})")
    server = _convert(raw.get("server", {}), ServerConfig, "server")
    auth = _convert(raw.get("auth", {}), AuthConfig, "auth")
    state = _check_state(_convert(raw["state"], StateConfig, "state")) if "state" in raw else None
    if state is not None and state.record_usage and not server.telemetry:
        raise ConfigError("state.record_usage: needs server.telemetry = true (usage rows come from the request record)")

    raw_backends = raw.get("backends", {})
    if not isinstance(raw_backends, dict) or not raw_backends:
        raise ConfigError("backends: at least one [backends.NAME] table is required")
    backends: dict[str, BackendEntry] = {}
    known = backend_types()
    for name, table in raw_backends.items():
        if not isinstance(table, dict):
            raise ConfigError(f"backends.{name}: expected a table")
        type_name = table.get("type")
        if not isinstance(type_name, str):
            raise ConfigError(f"backends.{name}.type: required, one of {sorted(known)}")
        if type_name not in known:
            raise ConfigError(f"backends.{name}.type: unknown backend type {type_name!r} (known: {sorted(known)})")
        try:
            cls = get_backend_class(type_name)
        except Exception as exc:  # a broken third-party plugin
            raise ConfigError(f"backends.{name}.type: backend type {type_name!r} failed to load: {exc}") from None
        backends[name] = BackendEntry(name, type_name, _convert(table, cls.Settings, f"backends.{name}"))

    raw_models = raw.get("models", {})
    if not isinstance(raw_models, dict) or not raw_models:
        raise ConfigError("models: at least one [models.NAME] table is required")
    models: dict[str, ModelConfig] = {}
    seen_names: dict[str, str] = {}
    for name, table in raw_models.items():
        model = _convert(table, ModelConfig, f"models.{name}")
        _check_routing(name, model, backends)
        for i, alias in enumerate([name, *model.aliases]):
            if alias in seen_names:
                key = f"models.{name}" + (f".aliases[{i - 1}]" if i else "")
                raise ConfigError(f"{key}: name {alias!r} is already used by model {seen_names[alias]!r}")
            seen_names[alias] = name
        _check_limits(name, model)
        models[name] = model

    default_model = raw.get("default_model", next(iter(models)))
    if not isinstance(default_model, str):
        raise ConfigError("default_model: expected a string")
    if default_model not in seen_names:
        raise ConfigError(f"default_model: no model named {default_model!r} (defined: {sorted(models)})")
    _check_auth(auth, seen_names)
    return GatewayConfig(server=server, auth=auth, state=state, backends=backends, models=models,
                         default_model=seen_names[default_model], source=source,
                         version=hashlib.sha256(text.encode()).hexdigest()[:12])


def _check_auth(auth: AuthConfig, model_names: dict[str, str]) -> None:
    """Keys must be present (an environment variable that is unset is an error) and never shown."""
    names: set[str] = set()
    for i, key in enumerate(auth.keys):
        where = f"auth.keys[{i}]"
        if key.name in names:
            raise ConfigError(f"{where}.name: {key.name!r} is used twice")
        names.add(key.name)
        if (key.key is None) == (key.key_env is None):
            raise ConfigError(f"{where}: give either `key` or `key_env`")
        if key.key_env is not None and not os.environ.get(key.key_env):
            raise ConfigError(f"{where}.key_env: environment variable {key.key_env} is not set")
        if key.key is not None and len(key.key) < 8:
            raise ConfigError(f"{where}.key: too short (at least 8 characters)")
        for j, model in enumerate(key.models):
            if model not in model_names:
                raise ConfigError(f"{where}.models[{j}]: no model named {model!r}")
        for limit in ("requests_per_minute", "tokens_per_minute", "max_tokens_per_day", "max_tokens_per_month"):
            value = getattr(key, limit)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{limit}: must be >= 1, got {value}")


def _check_state(state: StateConfig) -> StateConfig:
    for key in ("database", "redis"):
        env = getattr(state, f"{key}_env")
        if env is not None and getattr(state, key) is not None:
            raise ConfigError(f"state: give either `{key}` or `{key}_env`")
        if env is not None and not os.environ.get(env):
            raise ConfigError(f"state.{key}_env: environment variable {env} is not set")
    scheme = state.resolved_database().partition("://")[0].split("+")[0]
    if scheme not in ("sqlite", "postgresql", "postgres"):
        raise ConfigError(f"state.database: expected sqlite:///PATH or postgresql://..., got a {scheme!r} URL")
    redis = state.resolved_redis()
    if redis is not None and not redis.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("state.redis: expected redis://host:port/db (or rediss://, unix://)")
    for key in ("key_refresh_interval", "usage_flush_interval", "responses_ttl"):
        if getattr(state, key) <= 0:
            raise ConfigError(f"state.{key}: must be > 0, got {getattr(state, key):g}")
    for key in ("usage_buffer_rows", "usage_batch_rows"):
        if getattr(state, key) < 1:
            raise ConfigError(f"state.{key}: must be >= 1, got {getattr(state, key)}")
    return state


def _check_routing(name: str, model: ModelConfig, backends: dict[str, BackendEntry]) -> None:
    key = f"models.{name}"
    if (model.backend is None) == (not model.routes):
        raise ConfigError(f"{key}: give either `backend` or `routes`, not both and not neither")
    named = [("backend", model.backend)] if model.backend else []
    named += [(f"routes[{i}].backend", r.backend) for i, r in enumerate(model.routes)]
    named += [(f"fallback[{i}]", b) for i, b in enumerate(model.fallback)]
    named += [("shadow.backend", model.shadow.backend)] if model.shadow else []
    for where, backend in named:
        if backend not in backends:
            raise ConfigError(f"{key}.{where}: no backend named {backend!r} (defined: {sorted(backends)})")
    for i, route in enumerate(model.routes):
        if route.weight <= 0:
            raise ConfigError(f"{key}.routes[{i}].weight: must be > 0, got {route.weight:g}")
    if model.sticky not in (None, "header", "user"):
        raise ConfigError(f"{key}.sticky: must be \"header\" or \"user\", got {model.sticky!r}")
    if model.shadow and not 0.0 <= model.shadow.sample <= 1.0:
        raise ConfigError(f"{key}.shadow.sample: must be in [0, 1], got {model.shadow.sample:g}")
    if model.rollout is not None:
        spec = model.rollout
        if spec.candidate not in backends:
            raise ConfigError(f"{key}.rollout.candidate: no backend named {spec.candidate!r} (defined: "
                              f"{sorted(backends)})")
        if model.routes:
            raise ConfigError(f"{key}.rollout: a rollout moves a model from one `backend` to another, "
                              "not from a weighted split")
        if problems := spec.problems():
            raise ConfigError(f"{key}.rollout." + "; ".join(problems))


def _check_limits(name: str, model: ModelConfig) -> None:
    for key in ("max_input_tokens", "max_total_tokens", "default_max_new_tokens", "max_new_tokens"):
        value = getattr(model, key)
        if value is not None and value < 1:
            raise ConfigError(f"models.{name}.{key}: must be >= 1, got {value}")
    if model.max_input_tokens and model.max_total_tokens and model.max_input_tokens >= model.max_total_tokens:
        raise ConfigError(f"models.{name}.max_input_tokens: must be < max_total_tokens "
                          f"({model.max_input_tokens} >= {model.max_total_tokens})")
    if model.default_max_new_tokens and model.max_new_tokens and model.default_max_new_tokens > model.max_new_tokens:
        raise ConfigError(f"models.{name}.default_max_new_tokens: must be <= max_new_tokens")
    if model.max_concurrent_requests is not None and model.max_concurrent_requests < 1:
        raise ConfigError(f"models.{name}.max_concurrent_requests: must be >= 1, got {model.max_concurrent_requests}")
    for key in ("max_queued_requests", "retries"):
        if getattr(model, key) < 0:
            raise ConfigError(f"models.{name}.{key}: must be >= 0, got {getattr(model, key)}")
    for key in ("max_queue_wait", "request_timeout", "retry_backoff"):
        value = getattr(model, key)
        if value is not None and value <= 0:
            raise ConfigError(f"models.{name}.{key}: must be > 0, got {value:g}")


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_config(text, str(path))
