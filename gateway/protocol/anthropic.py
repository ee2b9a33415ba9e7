"""Anthropic's Messages API wire types (`/v1/messages`, `/v1/messages/count_tokens`), the subset this
gateway serves. Field names and shapes follow the `anthropic` SDK's own types (`anthropic/types/`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# request


class TextBlockIn(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ToolUseBlockIn(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockIn(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None  # text blocks; others are refused by name
    is_error: bool | None = None


class ImageBlockIn(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    """Decoded only to be refused by name."""


class DocumentBlockIn(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    """Decoded only to be refused by name."""


class ThinkingBlockIn(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    """An earlier turn's thinking: this gateway's models do not think, so it is refused by name."""


BlockIn = TextBlockIn | ToolUseBlockIn | ToolResultBlockIn | ImageBlockIn | DocumentBlockIn | ThinkingBlockIn


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[BlockIn]


class ToolIn(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools (bash, web_search...) are refused by name
    strict: bool | None = None
    cache_control: Any | None = None


class ToolChoiceIn(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: JsonOutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    system: str | list[TextBlockIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]  # required, as Anthropic has it
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None  # its `format` is an output constraint


# response


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str
    citations: None = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


Block = TextBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[Block]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class TokensCount(msgspec.Struct, kw_only=True):
    input_tokens: int


# stream events: `type` is also the SSE `event:` name


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start", kw_only=True):
    message: Message


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start", kw_only=True):
    index: int
    content_block: Block


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta", kw_only=True):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta", kw_only=True):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta", kw_only=True):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop", kw_only=True):
    index: int


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: StopReason | None
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct, kw_only=True):
    output_tokens: int
    input_tokens: int | None = None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta", kw_only=True):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


# errors


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
    error: ErrorDetail


StreamEvent = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
               | MessageStop | ErrorResponse)


def event_name(event: StreamEvent) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]
