"""What the Responses and Messages doors share with Chat Completions: one chat turn (core messages, tools,
an output constraint) planned onto the route's backends as a core request, then generated whole or
started as a stream. The planning is Chat Completions' own (gateway/tools/plan.py); only the wire differs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from litestar import Request
from litestar.response import Stream

from backends.base import ChatMessage, GenerationRequest
from gateway.errors import GatewayError
from gateway.generation import Collected, Served, generate_whole, tokenize_prompt, unless_disconnected
from gateway.params.constraints import describe_backend
from gateway.params.openai import check_common, check_context, core_request, max_new_tokens
from gateway.params.openai_constraints import AskedConstraint
from gateway.protocol.openai import SamplingExtras
from gateway.routes.openai import authorized_route, blamed_on, start_streams, stream_response, tool_parsing
from gateway.routing.admission import Admission
from gateway.routing.router import ModelRoute
from gateway.state import Gateway
from gateway.tools.plan import ChatPlan, plan_chat
from gateway.tools.request import ToolRequest


@dataclass
class ChatTurn:
    route: ModelRoute  # narrowed to the backends that enforce the turn's constraint
    plan: ChatPlan
    core: GenerationRequest
    input_tokens: int | None  # known when the gateway rendered and tokenized the prompt


async def plan_turn(gw: Gateway, request: Request, *, model: str | None, user: str | None,
                    messages: list[ChatMessage], tools: ToolRequest | None, asked: AskedConstraint | None,
                    sampling: SamplingExtras, max_tokens: int | None, max_tokens_param: str,
                    messages_param: str) -> ChatTurn:
    """Route, key and limits checked; tools and constraint planned; prompt tokenized where the gateway renders it."""
    route = authorized_route(gw, request, model, user)
    server = gw.config.server
    check_common(sampling, server)
    plan = plan_chat(route, messages, tools, asked, True)
    route = plan.route
    ids = None if plan.prompt is None else await tokenize_prompt(route, plan.prompt, add_special_tokens=False)
    n_input = len(ids) if ids is not None else None
    new = max_new_tokens(route, max_tokens, n_input, max_tokens_param)
    check_context(route, n_input, new, messages_param, messages_param)
    core = plan.apply(core_request(sampling, route, server, prompt=plan.prompt, ids=ids, messages=plan.messages,
                                   new_tokens=new, logprobs=False, top_logprobs=0,
                                   traceparent=request.headers.get("traceparent"), constraint=plan.constraint))
    return ChatTurn(route, plan, core, n_input)


async def generate_turn(gw: Gateway, request: Request, turn: ChatTurn) -> Collected:
    """The whole answer (tool calls parsed out of the text where the gateway drives the tools)."""
    async with gw.admit(turn.route):
        with blamed_on(turn.plan.blame):
            return await unless_disconnected(
                request.receive, generate_whole(gw, turn.route, turn.core, tool_parsing(turn.plan)))


async def start_turn(gw: Gateway, turn: ChatTurn) -> tuple[Admission, Served]:
    """Admitted and started before the answer begins, so a failure before the first token is an HTTP error."""
    with blamed_on(turn.plan.blame):
        admission, served = await start_streams(gw, turn.route, [turn.core])
    wrap = tool_parsing(turn.plan)
    if wrap is not None:
        served[0].events = wrap(served[0].events)
    return admission, served[0]


async def sse_stream(events: AsyncIterator[bytes], served: Served, route: ModelRoute) -> Stream:
    """`events` starts with an empty priming item (its cleanup then runs however the response ends)."""
    return await stream_response(events, [served], route)


def named_sse(name: str, payload: bytes) -> bytes:
    """`event: <name>` then `data: <json>`: both the Responses and the Messages streams name each event."""
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


async def count_prompt_tokens(gw: Gateway, request: Request, *, model: str | None, messages: list[ChatMessage],
                              tools: ToolRequest | None) -> int:
    """The tokens the turn's prompt would take, tools included, where the gateway renders that prompt.
    A backend that takes chat messages itself renders its own prompt, which the gateway cannot count."""
    route = authorized_route(gw, request, model, None)
    plan = plan_chat(route, messages, tools, None, True)
    ids = None if plan.prompt is None else await tokenize_prompt(plan.route, plan.prompt, add_special_tokens=False)
    if ids is None:
        raise GatewayError(f"counting tokens needs a backend whose prompt the gateway renders and tokenizes; "
                           f"{describe_backend(route)} renders its own", param="model")
    return len(ids)
