"""TGI's wire types (router/src/lib.rs), field names and order as TGI sends them."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

UInt = Annotated[int, Meta(ge=0)]


class JsonGrammar(msgspec.Struct, tag_field="type", tag="json"):
    value: Any  # a schema object, or a JSON text of one (re-parsed); anything else: "grammar is not supported"


class JsonObjectGrammar(msgspec.Struct, tag_field="type", tag="json_object"):
    value: Any  # TGI's serde alias of `json`: the same `value`, which is required here too


class RegexGrammar(msgspec.Struct, tag_field="type", tag="regex"):
    value: str


class JsonSchemaConfig(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: Any  # TGI's JsonSchemaConfig has no `strict`: one sent is ignored, as there


class JsonSchemaGrammar(msgspec.Struct, tag_field="type", tag="json_schema"):
    value: JsonSchemaConfig


# TGI's `#[serde(tag = "type", content = "value")] enum GrammarType` (router/src/lib.rs)
GrammarType = JsonGrammar | JsonObjectGrammar | RegexGrammar | JsonSchemaGrammar


class GenerateParameters(msgspec.Struct, kw_only=True):
    best_of: UInt | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: GrammarType | None = None
    max_new_tokens: UInt | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: UInt | None = None
    stop: list[str] = []
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: UInt | None = None
    top_p: float | None = None
    truncate: UInt | None = None
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: GenerateParameters | None = None  # absent: TGI's default_parameters() (do_sample=true)


class CompatGenerateRequest(GenerateRequest, kw_only=True):
    stream: bool = False


class Token(msgspec.Struct):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(msgspec.Struct):
    id: int
    text: str
    logprob: float | None


class BestOfSequence(msgspec.Struct, kw_only=True):
    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | UnsetType = UNSET


class Details(msgspec.Struct, kw_only=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | UnsetType = UNSET  # left out when empty, as TGI does
    best_of_sequences: list[BestOfSequence] | UnsetType = UNSET


class GenerateResponse(msgspec.Struct, kw_only=True):
    generated_text: str
    details: Details | UnsetType = UNSET


class StreamDetails(msgspec.Struct, kw_only=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(msgspec.Struct, kw_only=True):
    index: int
    token: Token
    top_tokens: list[Token] | UnsetType = UNSET
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(msgspec.Struct):
    error: str
    error_type: str


class SimpleToken(msgspec.Struct):
    id: int
    text: str
    start: int
    stop: int


class Info(msgspec.Struct, kw_only=True):
    model_id: str
    model_sha: str | None = None
    model_pipeline_tag: str | None = "text-generation"
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int = 2
    max_client_batch_size: int
    router: str = "text-generation-router"
    version: str
    sha: str | None = None
    docker_label: str | None = None
    config_version: str | None = None  # llm-gateway's: the active config (as in x-config-version)
    model_dtype: str | None = None  # as older TGIs reported it; the engine's weights dtype
    dtype_reason: str | None = None  # llm-gateway's: why that dtype ("auto: the CPU has native bf16 ...")
    speculative: str | None = None  # llm-gateway's: the engine's speculative decoding ("ngram: up to 5 ..."); None: off
