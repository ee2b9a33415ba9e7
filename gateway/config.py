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
from typing import Any

import msgspec

from backends.registry import backend_types, get_backend_class
from gateway.config_tables import (
    ApiKey,
    AuthConfig,
    ModelConfig,
    ServerConfig,
    ShadowConfig,
    StateConfig,
    WeightedRoute,
    state_directory,
)

__all__ = ["ApiKey", "AuthConfig", "BackendEntry", "ConfigError", "GatewayConfig", "ModelConfig", "ServerConfig",
           "ShadowConfig", "StateConfig", "WeightedRoute", "load_config", "parse_config", "primary_routes",
           "state_directory"]


class ConfigError(Exception):
    pass


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
        lease = (f", per-minute limits leased {self.state.lease_fraction:.0%} at a time"
                 if self.state.lease_fraction else "")
        limits = (f"shared by every replica through Redis{lease}" if self.state.resolved_redis() else
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
    if server.sse_keepalive <= 0:
        raise ConfigError(f"server.sse_keepalive: must be > 0, got {server.sse_keepalive:g}")
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
    _check_fronts(server, state, backends)
    return GatewayConfig(server=server, auth=auth, state=state, backends=backends, models=models,
                         default_model=seen_names[default_model], source=source,
                         version=hashlib.sha256(text.encode()).hexdigest()[:12])


def _check_fronts(server: ServerConfig, state: StateConfig | None, backends: dict[str, BackendEntry]) -> None:
    """Several front processes share the engine workers and the state store; each would have its own of the rest."""
    if server.workers == "auto" or server.workers == 1:
        if server.workers == "auto" and state is None:
            raise ConfigError("server.workers: \"auto\" runs several front processes, which need a [state] table "
                              "(keys, usage and stored Responses shared by every front; SQLite by default)")
        return
    if server.workers < 1:
        raise ConfigError(f"server.workers: must be >= 1 or \"auto\", got {server.workers}")
    if state is None:
        raise ConfigError("server.workers: more than one front process needs a [state] table (keys, usage and stored "
                          "Responses shared by every front; SQLite by default)")
    for name, entry in backends.items():
        if getattr(entry.settings, "workers", None) == "thread":
            raise ConfigError(f"backends.{name}.workers: \"thread\" loads an engine in each front process; with "
                              "server.workers > 1 the engine runs in a worker process all fronts share (\"process\")")


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
    if not 0 <= state.lease_fraction <= 0.5:
        raise ConfigError(f"state.lease_fraction: must be between 0 and 0.5, got {state.lease_fraction:g}")
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
