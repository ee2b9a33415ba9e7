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


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # a JSON text, as OpenAI sends it; an object is taken too


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A call an earlier assistant turn made, sent back as history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None


# tools and output formats


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: the function takes no parameters
    strict: bool | None = None


class FunctionTool(msgspec.Struct, tag_field="type", tag="function", kw_only=True):
    function: FunctionDefinition


class CustomTool(msgspec.Struct, tag_field="type", tag="custom", kw_only=True):
    custom: Any = None  # decoded only to be refused by name


Tool = FunctionTool | CustomTool


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    pass


class TgiSchemaValue(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: Any


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    """OpenAI's JSON mode; with a `value`, TGI's alias of its `json` type (huggingface_hub sends
    `json_schema` formats this way)."""

    value: Any | UnsetType = UNSET


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    json_schema: JsonSchemaSpec | UnsetType = UNSET  # OpenAI's form
    value: TgiSchemaValue | UnsetType = UNSET  # TGI's form of the same


class TgiJsonFormat(msgspec.Struct, tag_field="type", tag="json"):
    """TGI's chat form of a JSON grammar: a schema object, or a JSON text of one."""

    value: Any


class TgiRegexFormat(msgspec.Struct, tag_field="type", tag="regex"):
    value: str


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | TgiJsonFormat | TgiRegexFormat


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: exactly one constraint field, checked at the door."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # about vLLM's choice of library: nothing to enforce


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
    # output constraints (chat and completions alike)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # removed from vLLM in 0.12 (it now ignores them); this gateway still honours them
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # a choice of library, not a constraint: ignored
    guided_whitespace_pattern: str | None = None


class ChatCompletionRequest(SamplingExtras, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any | None = None  # checked by hand, for vLLM's messages
    parallel_tool_calls: bool | None = None
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


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET  # left out when the model made no calls


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


class FunctionChunk(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str


class ToolCallChunk(msgspec.Struct, kw_only=True):
    """The first chunk of a call has id, type, name and `arguments: ""`; later ones only argument text."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionChunk


class Delta(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


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
    # a LoRA adapter's card, as vLLM's: `parent` is the base model, `root` the adapter's directory or upstream name
    root: str | UnsetType = UNSET
    parent: str | UnsetType = UNSET


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
