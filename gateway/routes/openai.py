"""OpenAI's routes: /v1/chat/completions, /v1/completions (streaming and not) and /v1/models."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from backends.base import GenerationRequest, TokenEvent
from gateway import __version__
from gateway.closing import close_detached
from gateway.errors import GatewayError
from gateway.generation import (
    Collected,
    Served,
    Wrap,
    gather_all,
    generate_whole,
    merge,
    start_all,
    tokenize_prompt,
    unless_disconnected,
)
from gateway.params.openai import (
    FINISH_REASONS,
    chat_finish_reason,
    chat_messages,
    check_chat_features,
    check_common,
    check_context,
    completion_prompts,
    core_request,
    max_new_tokens,
)
from gateway.params.openai_constraints import asked_constraint, openai_route
from gateway.policy.auth import KeyRing, current_principal
from gateway.protocol.openai import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTokenLogprob,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    ResponseMessage,
    TopLogprob,
    UsageOut,
)
from gateway.routing.admission import Admission
from gateway.routing.router import ModelRoute
from gateway.sse import DONE, SSEStream, sse_event
from gateway.state import Gateway
from gateway.telemetry.record import current_record
from gateway.tools.calls import parsed
from gateway.tools.plan import ChatPlan, plan_chat
from gateway.tools.request import tool_request
from gateway.tools.validity import checked
from gateway.tools.wire import call_chunks, calls_out

FINGERPRINT = f"llm-gateway-{__version__}"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _copies(core: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n choices: their own request ids, and distinct seeds so seeded choices differ."""
    if n == 1:
        return [core]
    return [msgspec.structs.replace(core, request_id=f"{core.request_id}-{i}",
                                    seed=None if core.seed is None else core.seed + i) for i in range(n)]


def _chat_logprobs(events: list[TokenEvent]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        ChatTokenLogprob(token=e.token_text, logprob=e.logprob if e.logprob is not None else 0.0,
                         bytes=list(e.token_text.encode()),
                         top_logprobs=[TopLogprob(token=t.text, logprob=t.logprob or 0.0, bytes=list(t.text.encode()))
                                       for t in e.top_logprobs])
        for e in events])


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageOut:
    return UsageOut(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens)


class OpenAIController(Controller):
    path = "/v1"
    tags = ["OpenAI"]

    @get("/models", summary="The models this gateway serves", operation_id="list_models")
    async def models(self, gateway: Gateway) -> ModelList:
        adapters = [ModelCard(id=adapter, root=root, parent=parent)
                    for adapter, parent, root in gateway.router.adapter_cards()]
        return ModelList(data=[ModelCard(id=name) for name in gateway.router.model_names()] + adapters)

    # chat

    @post("/chat/completions", summary="Chat completion (OpenAI)", operation_id="create_chat_completion",
          status_code=200)
    async def chat(self, data: ChatCompletionRequest, gateway: Gateway, request: Request) -> Response | Stream:
        route = authorized_route(gateway, request, data.model, data.user)
        server = gateway.config.server
        check_common(data, server)
        check_chat_features(data)
        messages = chat_messages(data)
        plan = plan_chat(route, messages, tool_request(data), asked_constraint(data), data.add_generation_prompt)
        route = plan.route
        ids = None if plan.prompt is None else await tokenize_prompt(route, plan.prompt, add_special_tokens=False)
        n_input = len(ids) if ids is not None else None
        new = max_new_tokens(route, data.max_completion_tokens or data.max_tokens, n_input,
                             "max_completion_tokens" if data.max_completion_tokens else "max_tokens")
        check_context(route, n_input, new, "messages", "messages")
        want_logprobs = bool(data.logprobs)
        core = plan.apply(core_request(
            data, route, server, prompt=plan.prompt, ids=ids, messages=plan.messages, new_tokens=new,
            logprobs=want_logprobs, top_logprobs=data.top_logprobs or 0, traceparent=request.headers.get("traceparent"),
            constraint=plan.constraint))
        requests = _copies(core, data.n or 1)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        wrap = tool_parsing(plan)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            with blamed_on(plan.blame):
                admission, served = await start_streams(gateway, route, requests)
            if wrap is not None:
                for s in served:
                    s.events = wrap(s.events)
            events = self._chat_stream(admission, served, data.model or route.name, response_id, created,
                                       want_logprobs, include_usage, plan)
            return await stream_response(events, served, route)
        async with gateway.admit(route):
            with blamed_on(plan.blame):
                results = await unless_disconnected(
                    request.receive, gather_all([generate_whole(gateway, route, r, wrap) for r in requests]))
        choices = [self._chat_choice(i, r, want_logprobs, plan.named) for i, r in enumerate(results)]
        body = ChatCompletionResponse(id=response_id, created=created, model=data.model or route.name,
                                      choices=choices, usage=self._total_usage(results), system_fingerprint=FINGERPRINT)
        return Response(body, status_code=200, headers=route.served_headers(results[0].backend))

    @staticmethod
    def _chat_choice(index: int, r: Collected, want_logprobs: bool, named: bool) -> ChatChoice:
        calls = r.tool_calls
        message = ResponseMessage(role="assistant", content=r.text if r.text.strip() or not calls else None)
        if calls:
            message.tool_calls = calls_out(calls)
        return ChatChoice(index=index, message=message, logprobs=_chat_logprobs(r.events) if want_logprobs else None,
                          finish_reason=chat_finish_reason(str(r.last.finish_reason), bool(calls), named))

    @staticmethod
    def _total_usage(results: list[Collected]) -> UsageOut:
        prompt = results[0].usage.prompt_tokens if results else 0
        return _usage(prompt, sum(r.usage.completion_tokens for r in results))

    @staticmethod
    def _chat_stream(admission: Admission, served: list[Served], model: str, response_id: str, created: int,
                     want_logprobs: bool, include_usage: bool, plan: ChatPlan) -> AsyncIterator[bytes]:
        chunk = _chunker(ChatCompletionChunk, response_id, created, model, include_usage)
        tools = plan.native is not None or plan.parsed is not None
        called: set[int] = set()  # the choices that made calls

        def render(index: int, e: TokenEvent) -> bytes | None:
            out = b""
            if e.tool_calls:
                called.add(index)
                out = b"".join(chunk([ChunkChoice(index=index, delta=Delta(tool_calls=[c]), logprobs=None,
                                                  finish_reason=None)]) for c in call_chunks(e.tool_calls))
            if not e.text and not e.finished and not want_logprobs:
                return out or None  # nothing to show yet (a held-back stop prefix, markup, or half a character)
            finish = chat_finish_reason(str(e.finish_reason), index in called, plan.named) if e.finished else None
            content = e.text if e.text or not tools else None  # null, not "", beside calls
            return out + chunk([ChunkChoice(index=index, delta=Delta(content=content),
                                            logprobs=_chat_logprobs([e]) if want_logprobs else None,
                                            finish_reason=finish)])

        return _sse(admission, served, render, (lambda u: chunk([], u)) if include_usage else None,
                    choices_per_prompt=len(served))

    # completions

    @post("/completions", summary="Text completion (OpenAI legacy)", operation_id="create_completion",
          status_code=200)
    async def completions(self, data: CompletionRequest, gateway: Gateway, request: Request) -> Response | Stream:
        route = authorized_route(gateway, request, data.model, data.user)
        server = gateway.config.server
        check_common(data, server)
        prompts = completion_prompts(data)
        asked = asked_constraint(data)
        route = openai_route(route, asked)
        if data.echo and any(not isinstance(p, str) for p in prompts):
            raise GatewayError("`echo` with token-id prompts is not supported", param="echo")
        n = data.n or 1
        requests: list[GenerationRequest] = []
        echoes: list[str] = []
        for p in prompts:
            ids = p if isinstance(p, list) else await tokenize_prompt(route, p)
            n_input = len(ids) if ids is not None else None
            new = max_new_tokens(route, data.max_tokens, n_input, "max_tokens")
            check_context(route, n_input, new, "prompt", "prompt")
            core = core_request(data, route, server, prompt=p if isinstance(p, str) else None, ids=ids, messages=None,
                                new_tokens=new, logprobs=data.logprobs is not None, top_logprobs=data.logprobs or 0,
                                traceparent=request.headers.get("traceparent"),
                                constraint=asked.constraint if asked is not None else None)
            requests += _copies(core, n)
            echoes += [p if data.echo and isinstance(p, str) else ""] * n
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = data.model or route.name
        blame = asked.param if asked is not None else None
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            with blamed_on(blame):
                admission, served = await start_streams(gateway, route, requests)
            events = self._completion_stream(admission, served, echoes, model, response_id, created,
                                             data.logprobs, include_usage, n)
            return await stream_response(events, served, route)
        async with gateway.admit(route):
            with blamed_on(blame):
                results = await unless_disconnected(
                    request.receive, gather_all([generate_whole(gateway, route, r) for r in requests]))
        choices = [CompletionChoice(index=i, text=echoes[i] + r.text,
                                    logprobs=self._legacy_logprobs(r.events, len(echoes[i]))
                                    if data.logprobs is not None else None,
                                    finish_reason=FINISH_REASONS[str(r.last.finish_reason)])
                   for i, r in enumerate(results)]
        prompt_tokens = sum(results[i].usage.prompt_tokens for i in range(0, len(results), n))
        usage = _usage(prompt_tokens, sum(r.usage.completion_tokens for r in results))
        body = CompletionResponse(id=response_id, created=created, model=model, system_fingerprint=FINGERPRINT,
                                  choices=choices, usage=usage)
        return Response(body, status_code=200, headers=route.served_headers(results[0].backend))

    @staticmethod
    def _legacy_logprobs(events: list[TokenEvent], offset: int) -> CompletionLogprobs:
        offsets = []
        for e in events:
            offsets.append(offset)
            offset += len(e.token_text)
        return CompletionLogprobs(
            tokens=[e.token_text for e in events], token_logprobs=[e.logprob for e in events],
            top_logprobs=[{t.text: t.logprob or 0.0 for t in e.top_logprobs} for e in events], text_offset=offsets)

    def _completion_stream(self, admission: Admission, served: list[Served], echoes: list[str], model: str,
                           response_id: str, created: int, logprobs: int | None, include_usage: bool,
                           n: int) -> AsyncIterator[bytes]:
        offsets = [len(e) for e in echoes]

        chunk = _chunker(CompletionResponse, response_id, created, model, include_usage)

        def render(index: int, e: TokenEvent) -> bytes | None:
            if not e.text and not e.finished and logprobs is None:
                return None
            lp = self._legacy_logprobs([e], offsets[index]) if logprobs is not None else None
            offsets[index] += len(e.token_text)
            finish = FINISH_REASONS[str(e.finish_reason)] if e.finished else None
            return chunk([CompletionChoice(index=index, text=e.text, logprobs=lp, finish_reason=finish)])

        preamble = [chunk([CompletionChoice(index=i, text=echo, logprobs=None, finish_reason=None)])
                    for i, echo in enumerate(echoes) if echo]
        return _sse(admission, served, render, (lambda u: chunk([], u)) if include_usage else None,
                    choices_per_prompt=n, preamble=preamble)


@contextlib.contextmanager
def blamed_on(param: str | None) -> Iterator[None]:
    """A backend's validation error names no field; with a constraint asked, the constraint is what it
    refused (the door checked everything else first): OpenAI's `param` names the field that asked."""
    try:
        yield
    except GatewayError as err:
        if param is not None and err.kind == "validation" and err.param is None:
            err.param = param
        raise


def tool_parsing(plan: ChatPlan) -> Wrap | None:
    """The gateway's tool-call parser over each choice's events (its own parser per choice), then the
    validity check of the calls and of structured output (what a rollout compares between backends)."""
    tools = plan.parsed or plan.native
    constraint = plan.constraint if tools is None else None  # a forced call's schema is the tools' own
    if tools is None and (constraint is None or constraint.kind not in ("json_schema", "json_object")):
        return None
    declared = tools.tools if tools is not None else []
    if plan.parsed is None:
        return lambda events: checked(events, declared, constraint)
    return lambda events: checked(parsed(events, plan.parser()), declared, constraint)  # type: ignore[arg-type]


def _chunker(kind: type[ChatCompletionChunk] | type[CompletionResponse], response_id: str, created: int, model: str,
             include_usage: bool) -> Callable[..., bytes]:
    """Encode one stream chunk; `usage` is on every chunk (null but the last) only with include_usage."""

    def chunk(choices: list[Any], usage: UsageOut | None = None) -> bytes:
        c = kind(id=response_id, created=created, model=model, system_fingerprint=FINGERPRINT, choices=choices)
        if include_usage:
            c.usage = usage
        return sse_event(c)

    return chunk


def authorized_route(gw: Gateway, request: Request, model: str | None, user: str | None) -> ModelRoute:
    route = gw.router.require(model, header_key=request.headers.get(gw.config.server.sticky_header), user_key=user)
    KeyRing.authorize(current_principal.get(), route.name)
    rec = current_record.get()
    if rec is not None:
        rec.model = route.name
    return route


async def start_streams(gw: Gateway, route: ModelRoute,
                         requests: list[GenerationRequest]) -> tuple[Admission, list[Served]]:
    """Admit and start every choice before answering: a failure before the first token is still an
    HTTP error, and `x-backend` can name who serves."""
    admission = await gw.enter(route)
    try:
        return admission, await start_all(gw, route, requests)
    except BaseException:
        admission.release()
        raise


async def stream_response(events: AsyncIterator[bytes], served: list[Served], route: ModelRoute) -> Stream:
    await events.__anext__()  # primed: from here its `finally` runs however the response ends
    return SSEStream(events, headers=SSE_HEADERS | route.served_headers(served[0].backend))


async def _sse(admission: Admission, served: list[Served], render: Callable[[int, TokenEvent], bytes | None],
               usage_chunk: Callable[[UsageOut], bytes] | None, *, choices_per_prompt: int,
               preamble: list[bytes] | None = None) -> AsyncIterator[bytes]:
    """The OpenAI event stream: rendered chunks, the usage chunk if asked, errors as events, then [DONE]."""
    prompt_tokens, completion_tokens = 0, 0
    events_seen = [0] * len(served)  # a choice's tokens where its backend reports no usage
    try:
        yield b""
        for event in preamble or []:
            yield event
        async for index, e in merge([s.events for s in served]):
            events_seen[index] += 1
            if e.finished:
                completion_tokens += e.usage_or_count(events_seen[index]).completion_tokens
            if e.usage and index % choices_per_prompt == 0:  # n choices of one prompt share its tokens
                prompt_tokens += e.usage.prompt_tokens
            rendered = render(index, e)
            if rendered is not None:
                yield rendered
        if usage_chunk is not None:
            yield usage_chunk(_usage(prompt_tokens, completion_tokens))
    except GatewayError as err:
        yield sse_event(err.openai_body())
    finally:
        admission.release()
        for s in served:
            await close_detached(s.events)
    yield DONE
