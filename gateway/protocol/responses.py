"""OpenAI's Responses API wire types (`/v1/responses`), the subset this gateway serves. Field names and
shapes follow the `openai` SDK's own types (`openai/types/responses/`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# request


class InputText(msgspec.Struct, tag_field="type", tag="input_text", kw_only=True):
    text: str


class OutputTextIn(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    """An earlier answer's text, sent back as history."""

    text: str


class RefusalIn(msgspec.Struct, tag_field="type", tag="refusal", kw_only=True):
    refusal: str


class InputImage(msgspec.Struct, tag_field="type", tag="input_image", kw_only=True):
    """Decoded only to be refused by name."""


class InputFile(msgspec.Struct, tag_field="type", tag="input_file", kw_only=True):
    """Decoded only to be refused by name."""


class InputAudio(msgspec.Struct, tag_field="type", tag="input_audio", kw_only=True):
    """Decoded only to be refused by name."""


ContentIn = InputText | OutputTextIn | RefusalIn | InputImage | InputFile | InputAudio


class MessageItem(msgspec.Struct, kw_only=True):
    """`{"role", "content"}` with or without `"type": "message"` (EasyInputMessage, or an output message)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentIn]
    type: Literal["message"] = "message"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    """A call an earlier response made, sent back as history."""

    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[ContentIn]
    type: Literal["function_call_output"] = "function_call_output"


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem}


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FormatText(msgspec.Struct, tag_field="type", tag="text", frozen=True):
    pass


class FormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class FormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True, omit_defaults=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=FormatText)
    verbosity: str | None = None


class ResponseCreateRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]  # items are told apart by `type` by hand: EasyInputMessage has none
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked by hand, to name an unsupported tool type
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None


# response


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"]
    role: str = "assistant"


class FunctionCallOut(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallOut


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    created_at: float
    model: str
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    output: list[OutputItem]
    tools: list[FunctionTool]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: TextConfig
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = {}
    usage: ResponseUsage | None = None
    completed_at: float | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


# stream events: each has `type` and `sequence_number`; `type` is also the SSE `event:` name


class ResponseEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(ResponseEvent, tag="response.created"):
    response: Response


class ResponseInProgress(ResponseEvent, tag="response.in_progress"):
    response: Response


class ResponseCompleted(ResponseEvent, tag="response.completed"):
    response: Response


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"):
    response: Response


class ResponseFailed(ResponseEvent, tag="response.failed"):
    response: Response


class OutputItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ItemEvent(ResponseEvent):
    """About one output item: the stream's `output_index`-th, `item_id`."""

    item_id: str
    output_index: int


class PartEvent(ItemEvent):
    """About one content part of an output item."""

    content_index: int


class ContentPartAdded(PartEvent, tag="response.content_part.added"):
    part: OutputText


class ContentPartDone(PartEvent, tag="response.content_part.done"):
    part: OutputText


class OutputTextDelta(PartEvent, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(PartEvent, tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = []


class ArgumentsDelta(ItemEvent, tag="response.function_call_arguments.delta"):
    delta: str


class ArgumentsDone(ItemEvent, tag="response.function_call_arguments.done"):
    name: str
    arguments: str


class StreamError(ResponseEvent, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None


def event_name(event: ResponseEvent) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]

