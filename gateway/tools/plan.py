"""How a chat request's tools and output constraint reach the backend chosen for it.

- A backend with `native_tools` (a remote vLLM) gets the tools, the choice and the messages as they
  are, and sends back tool-call deltas itself.
- Any other backend gets plain text: tools and past calls in the prompt (gateway/tools/prompt.py).
  `required` and a named tool are enforced with a JSON-schema constraint on the list of calls
  (gateway/tools/schema.py), so every answer is a valid call; `auto` lets the model choose, and the
  gateway parses its `<tool_call>` markup out of the text (gateway/tools/parser.py). Parsing works on
  every backend, even one that enforces no constraint; forcing needs the constraint.
- `none`: no tools in the prompt and no parsing (past calls in the history are still rendered).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from backends.base import ChatMessage, GenerationRequest, OutputConstraint
from gateway.chat_template import uses_tools
from gateway.errors import GatewayError
from gateway.params.constraints import describe_backend, route_for
from gateway.params.openai_constraints import AskedConstraint, openai_route
from gateway.routing.router import ModelRoute
from gateway.tools.parser import ToolCallParser
from gateway.tools.prompt import plain_messages, template_messages, template_tools
from gateway.tools.request import ToolRequest
from gateway.tools.schema import forced_calls_constraint


@dataclass(frozen=True)
class ChatPlan:
    route: ModelRoute  # narrowed to the backends that enforce the constraint
    messages: list[ChatMessage] | None  # for a backend that takes chat messages
    prompt: str | None  # the rendered template, for the others
    constraint: OutputConstraint | None
    native: ToolRequest | None  # tools the backend takes itself
    parsed: ToolRequest | None  # tools whose calls the gateway parses out of the text
    blame: str | None = None  # the field a backend's refusal of the constraint is about

    @property
    def named(self) -> bool:
        tools = self.native or self.parsed
        return tools is not None and tools.choice.mode == "function"

    def parser(self) -> ToolCallParser | None:
        if self.parsed is None:
            return None
        return ToolCallParser(forced=self.parsed.forced, parallel=self.parsed.parallel)

    def apply(self, core: GenerationRequest) -> GenerationRequest:
        if self.native is None:
            return core
        return msgspec.structs.replace(core, tools=self.native.tools, tool_choice=self.native.choice,
                                       parallel_tool_calls=self.native.parallel)


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def _forced(tools: ToolRequest, asked: AskedConstraint | None) -> AskedConstraint:
    if asked is not None:  # vLLM's message; for `required` vLLM drops response_format without one
        raise _invalid("You can only either use constraints for structured outputs or tools, not both.",
                       asked.param)
    # a named tool gets exactly one call, as in vLLM
    return AskedConstraint(forced_calls_constraint(tools.offered, tools.parallel and tools.choice.mode == "required"),
                           "tool_choice")


def _narrowed(route: ModelRoute, asked: AskedConstraint | None, tools: ToolRequest | None) -> ModelRoute:
    if asked is None or asked.param != "tool_choice" or tools is None or route_for(route, asked.constraint):
        return openai_route(route, asked)
    choice = tools.choice.function if tools.choice.mode == "function" else tools.choice.mode
    raise _invalid(f"`tool_choice` {choice!r} is enforced with a {asked.constraint.kind} constraint, which "
                   f"{describe_backend(route)} cannot enforce; use `auto`, or a backend that enforces JSON schemas",
                   "tool_choice")


def plan_chat(route: ModelRoute, messages: list[ChatMessage], tools: ToolRequest | None,
              asked: AskedConstraint | None, add_generation_prompt: bool) -> ChatPlan:
    info = route.backend.info()
    if info.native_tools:
        return ChatPlan(openai_route(route, asked), messages, None, asked.constraint if asked else None, tools, None,
                        asked.param if asked else None)
    if tools is not None and tools.forced:
        asked = _forced(tools, asked)
    narrowed = _narrowed(route, asked, tools)
    constraint = asked.constraint if asked is not None else None
    # a forced call's schema is made of the tools' parameters: a library that refuses it refuses those
    blame = None if asked is None else "tools" if asked.param == "tool_choice" else asked.param
    offered = tools.offered if tools is not None else []
    parsed = tools if tools is not None and tools.choice.mode != "none" else None
    if info.accepts_chat_messages:
        return ChatPlan(narrowed, plain_messages(messages, offered), None, constraint, None, parsed, blame)
    history = any(m.tool_calls or m.role == "tool" for m in messages)
    if (offered or history) and uses_tools(route.chat_template):
        prompt = route.render_chat(template_messages(messages), add_generation_prompt,
                                   tools=template_tools(offered) or None)
    else:
        prompt = route.render_chat(plain_messages(messages, offered), add_generation_prompt)
    return ChatPlan(narrowed, None, prompt, constraint, None, parsed, blame)
