"""Model name → the backends that serve it: a weighted (optionally sticky) choice, then fallback
tiers, skipping ejected backends; plus the shadow candidate and the model's limits."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from backends.base import Backend, ChatMessage
from gateway.chat_template import TemplateError, render_chat
from gateway.config import GatewayConfig, ModelConfig, WeightedRoute, primary_routes
from gateway.errors import GatewayError
from gateway.routing.health import HealthTracker

DEFAULT_CONTEXT = 4096  # when neither config nor backend says how long the context is


@dataclass(frozen=True)
class ModelRoute:
    """One request's route: the chosen backend first, then the fallback tiers."""

    name: str
    config: ModelConfig
    tiers: list[tuple[str, Backend]]
    shadow: tuple[str, Backend] | None = None
    config_version: str = "0"
    shadow_limit: int = 4  # mirrored requests in flight at once for this model
    shadow_topk: int = 0  # top logprobs the mirror asks the candidate for (a rollout's containment check)
    adapter: str | None = None  # the LoRA adapter the request runs with; every tier serves it

    @property
    def backend_name(self) -> str:
        return self.tiers[0][0]

    @property
    def backend(self) -> Backend:
        return self.tiers[0][1]

    def served_headers(self, backend: str) -> dict[str, str]:
        """Who served a response, streaming included: what a migration's dashboards and clients check."""
        return {"x-backend": backend, "x-config-version": self.config_version}

    @property
    def max_total_tokens(self) -> int:
        if self.config.max_total_tokens:
            return self.config.max_total_tokens
        return self.backend.info().max_model_len or DEFAULT_CONTEXT

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_input_tokens or self.max_total_tokens - 1

    def default_new_tokens(self, input_tokens: int) -> int:
        """What a request that names no limit gets: the configured default, or what the context allows."""
        room = max(1, self.max_total_tokens - input_tokens)
        default = self.config.default_max_new_tokens
        return min(default, room) if default else min(room, self.config.max_new_tokens or room)

    @property
    def chat_template(self) -> str | None:
        return self.config.chat_template or self.backend.info().chat_template

    def render_chat(self, messages: list[ChatMessage] | list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """Plain messages, or (for a template that knows tools) messages in its own shape with `tools`."""
        info = self.backend.info()
        shaped = [m if isinstance(m, dict) else {"role": m.role, "content": m.content or ""} for m in messages]
        try:
            return render_chat(self.chat_template, shaped, add_generation_prompt=add_generation_prompt,
                               bos_token=info.bos_token, eos_token=info.eos_token, tools=tools)
        except TemplateError as exc:
            raise GatewayError(str(exc), kind="template", param="messages") from None


def backend_adapters(backend: Backend) -> dict[str, str]:
    """The LoRA adapters a backend serves (name -> its directory or upstream name); {} for one without."""
    adapters = getattr(backend, "adapters", None)
    return adapters() if callable(adapters) else {}


def with_adapter(route: ModelRoute, adapter: str, param: str) -> ModelRoute:
    """The route narrowed to the tiers that serve the LoRA adapter; a 404 in the door's shape when none
    does (TGI itself would run an unknown adapter_id on the base model without a word)."""
    tiers = [(n, b) for n, b in route.tiers if adapter in backend_adapters(b)]
    if not tiers:
        known = sorted({a for _, b in route.tiers for a in backend_adapters(b)})
        raise GatewayError(f"model `{route.name}` has no LoRA adapter `{adapter}` (loaded: {known})",
                           kind="model_not_found", param=param, code="adapter_not_found")
    shadow = route.shadow if route.shadow and adapter in backend_adapters(route.shadow[1]) else None
    return dataclasses.replace(route, tiers=tiers, shadow=shadow, adapter=adapter)


def weighted_choice(routes: list[WeightedRoute], key: str | None, rng: random.Random) -> str:
    """A backend by weight: at random, or (with a key) the same one for the same key every time."""
    total = sum(r.weight for r in routes)
    if key is None:
        point = rng.random() * total
    else:  # a stable hash, not Python's salted one: stickiness survives restarts and replicas
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        point = int.from_bytes(digest, "big") / 2**64 * total
    for route in routes:
        point -= route.weight
        if point < 0:
            return route.backend
    return routes[-1].backend


class Rollouts(Protocol):
    """What routing reads from the rollouts (gateway/rollout/manager.py)."""

    def routes_for(self, name: str, model: ModelConfig) -> list[WeightedRoute] | None: ...

    def mirror_for(self, name: str, chosen: str) -> tuple[str, float] | None: ...


MIRROR_TOPK = 5  # top-k asked of a rollout's mirror: where greedy answers diverge, is the token in it


class Router:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend], health: HealthTracker,
                 rng: random.Random | None = None, failed: Mapping[int, str] | None = None,
                 rollouts: Rollouts | None = None) -> None:
        self.config = config
        self.rollouts = rollouts
        self.backends = backends
        self.health = health
        self.rng = rng or random.Random()
        self.failed = failed if failed is not None else {}  # by id(backend): why its start failed (the gateway's)

    def _failure(self, name: str) -> str | None:
        return self.failed.get(id(self.backends[name]))

    def resolve(self, name: str | None, header_key: str | None = None,
                user_key: str | None = None) -> ModelRoute | None:
        """The route for a model name or alias; `header_key` and `user_key` feed `sticky` models."""
        found = self.config.resolve_model(name)
        if found is None and name == "tgi":  # TGI's docs tell clients to call the default model "tgi"
            found = self.config.resolve_model(None)
        adapter = None
        if found is None and name is not None:  # vLLM's way: a LoRA adapter's name is a model name
            found = self.adapter_owner(name)
            adapter = name
        if found is None:
            return None
        canonical, model = found
        # a backend whose start failed will not serve until a reload replaces it: leave it out, and when every
        # backend of the model failed, say so (rather than a template or tokenizer error from a model not there)
        staged = self.rollouts.routes_for(canonical, model) if self.rollouts is not None else None
        routes = [r for r in staged or primary_routes(model) if self._failure(r.backend) is None]
        fallback = [b for b in model.fallback if self._failure(b) is None]
        if not routes and not fallback:
            raise self._all_failed(canonical, model)
        healthy = [r for r in routes if self.health.available(r.backend)]
        sticky_key = {"header": header_key, "user": user_key}.get(model.sticky or "")
        chosen = weighted_choice(healthy or routes, sticky_key, self.rng) if routes else fallback[0]
        order = [chosen] + [b for b in fallback if b != chosen]
        available = [b for b in order if self.health.available(b)]
        # every tier ejected: try them all anyway rather than refuse outright
        tiers = [(b, self.backends[b]) for b in (available or order)]
        shadow, limit, topk = None, model.shadow.max_concurrency if model.shadow else 4, 0
        if model.shadow and model.shadow.backend != chosen and self._failure(model.shadow.backend) is None \
                and self.rng.random() < model.shadow.sample:
            shadow = (model.shadow.backend, self.backends[model.shadow.backend])
        elif self.rollouts is not None and (mirror := self.rollouts.mirror_for(canonical, chosen)) is not None:
            candidate, sample = mirror
            if self._failure(candidate) is None and self.rng.random() < sample:
                shadow, topk = (candidate, self.backends[candidate]), MIRROR_TOPK
        route = ModelRoute(canonical, model, tiers, shadow, self.config.version, limit, topk)
        return with_adapter(route, adapter, "model") if adapter is not None else route

    def _all_failed(self, canonical: str, model: ModelConfig) -> GatewayError:
        names = dict.fromkeys([r.backend for r in primary_routes(model)] + list(model.fallback))
        reasons = "; ".join(f"backend `{n}` failed to start: {self._failure(n)}" for n in names)
        return GatewayError(f"model `{canonical}` cannot serve: {reasons}", kind="unavailable", code="backend_failed")

    def adapter_owner(self, adapter: str) -> tuple[str, ModelConfig] | None:
        """The model whose backends serve a LoRA adapter of this name (the first, in config order)."""
        for canonical, model in self.config.models.items():
            if any(adapter in backend_adapters(self.backends[r.backend]) for r in primary_routes(model)):
                return canonical, model
        return None

    def adapter_cards(self) -> list[tuple[str, str, str]]:
        """(adapter, parent model, its directory or upstream name) for every adapter a model's backends serve."""
        cards: dict[str, tuple[str, str, str]] = {}
        for canonical, model in self.config.models.items():
            for r in primary_routes(model):
                for adapter, root in backend_adapters(self.backends[r.backend]).items():
                    if adapter not in cards and self.config.resolve_model(adapter) is None:
                        cards[adapter] = (adapter, canonical, root)
        return list(cards.values())

    def require(self, name: str | None, header_key: str | None = None, user_key: str | None = None) -> ModelRoute:
        route = self.resolve(name, header_key, user_key)
        if route is None:
            raise GatewayError(f"The model `{name}` does not exist.", kind="model_not_found", param="model",
                               code="model_not_found")
        return route

    def model_names(self) -> list[str]:
        return list(self.config.models)
