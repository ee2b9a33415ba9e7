"""Model name → the backend that serves it, with the model's limits."""

from __future__ import annotations

from dataclasses import dataclass

from backends.base import Backend, ChatMessage
from gateway.chat_template import TemplateError, render_chat
from gateway.config import GatewayConfig, ModelConfig
from gateway.errors import GatewayError

DEFAULT_CONTEXT = 4096  # when neither config nor backend says how long the context is


@dataclass(frozen=True)
class ModelRoute:
    name: str
    config: ModelConfig
    backend: Backend
    backend_name: str

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

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        info = self.backend.info()
        try:
            return render_chat(self.config.chat_template or info.chat_template,
                               [{"role": m.role, "content": m.content} for m in messages],
                               add_generation_prompt=add_generation_prompt, bos_token=info.bos_token,
                               eos_token=info.eos_token)
        except TemplateError as exc:
            raise GatewayError(str(exc), kind="template", param="messages") from None


class Router:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend]) -> None:
        self.config = config
        self.backends = backends

    def resolve(self, name: str | None) -> ModelRoute | None:
        found = self.config.resolve_model(name)
        if found is None and name == "tgi":  # TGI's docs tell clients to call the default model "tgi"
            found = self.config.resolve_model(None)
        if found is None:
            return None
        canonical, model = found
        return ModelRoute(canonical, model, self.backends[model.backend], model.backend)

    def require(self, name: str | None) -> ModelRoute:
        route = self.resolve(name)
        if route is None:
            raise GatewayError(f"The model `{name}` does not exist.", kind="model_not_found", param="model",
                               code="model_not_found")
        return route

    def model_names(self) -> list[str]:
        return list(self.config.models)
