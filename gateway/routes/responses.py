"""OpenAI's Responses door: `POST /v1/responses` (whole or streamed as typed events), and
`GET`/`DELETE /v1/responses/{id}` for stored ones. A turn reaches every backend as one core chat
request (gateway/routes/chat_turn.py), exactly as a Chat Completions request does."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import Parameter
from litestar.response import Stream

from backends.base import ChatMessage, ToolCall, ToolCallDelta
from gateway.closing import close_detached
from gateway.errors import GatewayError
from gateway.generation import Served
from gateway.params.responses import asked_format, check_request, function_tools, input_messages, sampling, tool_request
from gateway.policy.auth import current_principal
from gateway.protocol.responses import (
    ArgumentsDelta,
    ArgumentsDone,
    ContentPartAdded,
    ContentPartDone,
    DeletedResponse,
    FunctionCallOut,
    FunctionTool,
    IncompleteDetails,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseCreateRequest,
    ResponseError,
    ResponseEvent,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseUsage,
    TextConfig,
    event_name,
)
from gateway.protocol.responses import (
    Response as ResponseObject,
)
from gateway.responses_store import MemoryResponses
from gateway.routes.chat_turn import generate_turn, named_sse, plan_turn, sse_stream, start_turn
from gateway.routing.admission import Admission
from gateway.state import Gateway
from gateway.store.responses import PersistedResponses

_encoder = msgspec.json.Encoder()
# the ids this door makes; another is refused as malformed before any lookup
ResponseId = Annotated[str, Parameter(pattern=r"^resp_[0-9a-f]{32}$", description="A stored response's id")]


def _owner() -> str | None:
    principal = current_principal.get()
    return principal.name if principal is not None else None


def _not_found(response_id: str) -> GatewayError:
    return GatewayError(f"Response with id '{response_id}' not found.", status=404, param="response_id")


class _Answer:
    """The response being built: its output items in order, whole or a piece at a time."""

    def __init__(self, data: ResponseCreateRequest, model: str, tools: list[FunctionTool]) -> None:
        self.data, self.model, self.tools = data, model, tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = time.time()
        self.items: list[OutputItem] = []

    def message(self, text: str, status: str = "completed") -> OutputMessage:
        item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", content=[OutputText(text=text)], status=status)  # type: ignore[arg-type]
        self.items.append(item)
        return item

    def call(self, call_id: str, name: str, arguments: str, status: str = "completed") -> FunctionCallOut:
        item = FunctionCallOut(id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name, arguments=arguments,
                               status=status)  # type: ignore[arg-type]
        self.items.append(item)
        return item

    def response(self, status: str, finish: str | None = None, usage: tuple[int, int] | None = None,
                 error: GatewayError | None = None) -> ResponseObject:
        d = self.data
        incomplete = IncompleteDetails(reason="max_output_tokens") if finish == "length" else None
        return ResponseObject(
            id=self.id, created_at=self.created, model=self.model, status=status,  # type: ignore[arg-type]
            output=list(self.items), tools=self.tools, tool_choice=d.tool_choice or "auto",
            parallel_tool_calls=d.parallel_tool_calls is not False, text=d.text or TextConfig(),
            instructions=d.instructions, max_output_tokens=d.max_output_tokens, temperature=d.temperature,
            top_p=d.top_p, previous_response_id=d.previous_response_id, store=d.store, metadata=d.metadata or {},
            incomplete_details=incomplete,
            usage=ResponseUsage(input_tokens=usage[0], output_tokens=usage[1], total_tokens=sum(usage))
            if usage is not None else None,
            error=ResponseError(code=error.code or error.kind, message=error.message) if error is not None else None,
            completed_at=time.time() if status == "completed" else None)

    def as_messages(self) -> list[ChatMessage]:
        """This answer as the assistant turn of the conversation a follow-up continues."""
        text = "".join(p.text for i in self.items if isinstance(i, OutputMessage) for p in i.content)
        calls = [ToolCall(id=i.call_id, name=i.name, arguments=i.arguments)
                 for i in self.items if isinstance(i, FunctionCallOut)]
        return [ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls)]


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ["OpenAI Responses"]

    @post("", summary="Create a response (OpenAI Responses)", operation_id="create_response", status_code=200)
    async def create(self, data: ResponseCreateRequest, gateway: Gateway, request: Request) -> Response | Stream:
        check_request(data)
        store = gateway.accounts.responses
        earlier: list[ChatMessage] = []
        if data.previous_response_id is not None:
            previous = await store.get(data.previous_response_id, _owner())
            if previous is None:
                raise GatewayError(f"Previous response with id '{data.previous_response_id}' not found.",
                                   status=404, param="previous_response_id")
            earlier = previous.conversation
        conversation = [*earlier, *input_messages(data, earlier)]
        system = [ChatMessage(role="system", content=data.instructions)] if data.instructions else []
        tools = function_tools(data)
        turn = await plan_turn(gateway, request, model=data.model, user=data.user, messages=[*system, *conversation],
                               tools=tool_request(data, tools), asked=asked_format(data), sampling=sampling(data),
                               max_tokens=data.max_output_tokens, max_tokens_param="max_output_tokens",
                               messages_param="input")
        answer = _Answer(data, data.model or turn.route.name, tools)
        if data.stream:
            admission, served = await start_turn(gateway, turn)
            events = self._stream(admission, served, answer, store, conversation)
            return await sse_stream(events, served, turn.route)
        result = await generate_turn(gateway, request, turn)
        calls = result.tool_calls
        if result.text.strip() or not calls:
            answer.message(result.text)
        for c in calls:
            answer.call(c.id, c.name, c.arguments)
        finish = str(result.last.finish_reason)
        body = answer.response(_status(finish), finish, (result.usage.prompt_tokens, result.usage.completion_tokens))
        if data.store:
            await store.put(body, [*conversation, *answer.as_messages()], _owner())
        return Response(body, status_code=200, headers=turn.route.served_headers(result.backend))

    @get("/{response_id:str}", summary="A stored response", operation_id="get_response")
    async def retrieve(self, response_id: ResponseId, gateway: Gateway) -> ResponseObject:
        entry = await gateway.accounts.responses.get(response_id, _owner())
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @delete("/{response_id:str}", summary="Delete a stored response", operation_id="delete_response",
            status_code=200)
    async def remove(self, response_id: ResponseId, gateway: Gateway) -> DeletedResponse:
        if not await gateway.accounts.responses.delete(response_id, _owner()):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    @staticmethod
    async def _stream(admission: Admission, served: Served, answer: _Answer,
                      store: MemoryResponses | PersistedResponses,
                      conversation: list[ChatMessage]) -> AsyncIterator[bytes]:
        """response.created, in_progress; per output item: added, its deltas, done; then completed
        (incomplete when cut by max_output_tokens; failed on an error). Every event is numbered."""
        sequence = 0
        owner = _owner()

        def emit(event: ResponseEvent) -> bytes:
            nonlocal sequence
            event.sequence_number = sequence
            sequence += 1
            return named_sse(event_name(event), _encoder.encode(event))

        text_item: OutputMessage | None = None
        calls: dict[int, FunctionCallOut] = {}  # by the core's call index
        open_call: FunctionCallOut | None = None

        def close_open() -> list[bytes]:
            nonlocal text_item, open_call
            out = []
            index = len(answer.items) - 1
            if text_item is not None:
                part = text_item.content[0]
                text_item.status = "completed"
                out += [emit(OutputTextDone(item_id=text_item.id, output_index=index, content_index=0, text=part.text)),
                        emit(ContentPartDone(item_id=text_item.id, output_index=index, content_index=0, part=part)),
                        emit(OutputItemDone(output_index=index, item=text_item))]
                text_item = None
            if open_call is not None:
                open_call.status = "completed"
                out += [emit(ArgumentsDone(item_id=open_call.id, output_index=index, name=open_call.name,
                                           arguments=open_call.arguments)),
                        emit(OutputItemDone(output_index=index, item=open_call))]
                open_call = None
            return out

        def text(delta: str) -> list[bytes]:
            nonlocal text_item
            out = []
            if text_item is None:
                out += close_open()
                text_item = answer.message("", status="in_progress")
                index = len(answer.items) - 1
                out += [emit(OutputItemAdded(output_index=index, item=text_item)),
                        emit(ContentPartAdded(item_id=text_item.id, output_index=index, content_index=0,
                                              part=OutputText(text="")))]
            if not delta:
                return out
            text_item.content[0].text += delta
            return [*out, emit(OutputTextDelta(item_id=text_item.id, output_index=len(answer.items) - 1,
                                               content_index=0, delta=delta))]

        def call(d: ToolCallDelta) -> list[bytes]:
            nonlocal open_call
            out = []
            if d.id is not None or d.index not in calls:
                out += close_open()
                open_call = calls[d.index] = answer.call(d.id or "", d.name or "", "", status="in_progress")
                out.append(emit(OutputItemAdded(output_index=len(answer.items) - 1, item=open_call)))
            item = calls[d.index]
            if d.arguments:
                item.arguments += d.arguments
                out.append(emit(ArgumentsDelta(item_id=item.id, output_index=answer.items.index(item),
                                               delta=d.arguments)))
            return out

        try:
            yield b""
            yield emit(ResponseCreated(response=answer.response("in_progress")))
            yield emit(ResponseInProgress(response=answer.response("in_progress")))
            async for e in served.events:
                out: list[bytes] = []
                if e.text:
                    out += text(e.text)
                for d in e.tool_calls:
                    out += call(d)
                if e.finished:
                    if not answer.items:  # an empty answer is still one (empty) message
                        out += text("")
                    out += close_open()
                    finish = str(e.finish_reason)
                    usage = (e.usage.prompt_tokens, e.usage.completion_tokens) if e.usage else (0, 0)
                    body = answer.response(_status(finish), finish, usage)
                    kind = ResponseIncomplete if body.status == "incomplete" else ResponseCompleted
                    out.append(emit(kind(response=body)))
                    if answer.data.store:
                        await store.put(body, [*conversation, *answer.as_messages()], owner)
                for chunk in out:
                    yield chunk
        except GatewayError as err:
            yield emit(ResponseFailed(response=answer.response("failed", error=err)))
        finally:
            admission.release()
            await close_detached(served.events)

