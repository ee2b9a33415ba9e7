"""OpenAI's chat and completions wire types (openapi spec 2.3.0) with vLLM's extra parameters."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: Any


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    input_audio: Any


class FilePart(msgspec.Struct, tag_field="type", tag="file"):
    file: Any


class RefusalPart(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


ContentPart = TextPart | ImageUrlPart | InputAudioPart | FilePart | RefusalPart


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class SamplingExtras(msgspec.Struct, kw_only=True):
    """Parameters shared by chat and completions, including vLLM's extras."""

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    skip_special_tokens: bool | None = None


class ChatCompletionRequest(SamplingExtras, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    response_format: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingExtras, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: Annotated[int, Meta(ge=0)] | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    suffix: str | None = None


# responses


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    refusal: None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    system_fingerprint: str


class Delta(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: UsageOut | None | UnsetType = UNSET  # present (null or set) only with include_usage


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageOut | None | UnsetType = UNSET


class OpenAIError(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(msgspec.Struct):
    error: OpenAIError


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "llm-gateway"


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
