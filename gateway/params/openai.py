"""OpenAI (and vLLM-extra) request checks and their translation into core requests."""

from __future__ import annotations

import json
import uuid

from backends.base import ChatMessage, GenerationRequest, OutputConstraint, ToolCall
from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.protocol.openai import ChatCompletionRequest, ChatMessageIn, CompletionRequest, SamplingExtras, TextPart
from gateway.routing.router import ModelRoute

# a remote backend's `tool_calls` reads as a stop here: chat_finish_reason decides what the client sees
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "stop"}


def chat_finish_reason(finish: str, made_calls: bool, named: bool) -> str:
    """vLLM's rule (serve/utils/tool_calls_utils.py): `tool_calls` when calls were made and the model
    stopped by itself; a `length` cut stays `length`; a forced named call is a plain `stop`."""
    reason = FINISH_REASONS[finish]
    return "tool_calls" if made_calls and reason == "stop" and not named else reason


def _invalid(message: str, param: str | None) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def stop_list(stop: str | list[str] | None, server: ServerConfig) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise _invalid("`stop` strings must not be empty", "stop")
    if len(stops) > server.max_stop_sequences:
        raise _invalid(f"`stop` supports up to {server.max_stop_sequences} sequences, got {len(stops)}", "stop")
    return stops


def check_common(req: SamplingExtras, server: ServerConfig) -> None:
    if req.n is not None and req.n > server.max_n:
        raise _invalid(f"`n` must be <= {server.max_n}, got {req.n}", "n")
    if req.logit_bias:
        raise _invalid("`logit_bias` is not supported by this gateway", "logit_bias")
    if req.top_k is not None and req.top_k < -1:
        raise _invalid("`top_k` must be -1 (disabled) or a positive number", "top_k")


def _text(content: str | list | None, param: str) -> str | None:
    """A message's content as text: text parts are joined; other parts (images, audio, files) are refused."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            kind = type(part).__name__.removesuffix("Part")
            raise _invalid(f"content parts of type {kind!r} are not supported; only text", f"{param}[{j}]")
        parts.append(part.text)
    return "\n".join(parts)


def _calls(m: ChatMessageIn) -> list[ToolCall]:
    return [ToolCall(id=c.id, name=c.function.name,
                     arguments=c.function.arguments if isinstance(c.function.arguments, str)
                     else json.dumps(c.function.arguments, ensure_ascii=False))
            for c in m.tool_calls or []]


def chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    """Core messages: assistant turns keep their calls (content may be None then), `tool` turns their
    `tool_call_id`. How a backend gets them (natively, or as text) is gateway/tools/plan.py's choice."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role == "function" or m.function_call is not None:
            raise _invalid("function messages (deprecated function calling) are not supported; use tools",
                           f"messages[{i}]")
        if m.tool_calls and m.role != "assistant":
            raise _invalid("only assistant messages may carry `tool_calls`", f"messages[{i}].tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise _invalid("`tool` messages need the `tool_call_id` of the call they answer",
                           f"messages[{i}].tool_call_id")
        content = _text(m.content, f"messages[{i}].content")
        calls = _calls(m)
        if content is None and not calls:
            content = ""
        role = "system" if m.role == "developer" else m.role
        messages.append(ChatMessage(role=role, content=content, tool_calls=calls,
                                    tool_call_id=m.tool_call_id if m.role == "tool" else None, name=m.name))
    return messages


def check_chat_features(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise _invalid("`top_logprobs` needs `logprobs: true`", "top_logprobs")


def max_new_tokens(route: ModelRoute, asked: int | None, n_input: int | None, param: str) -> int:
    cap = route.config.max_new_tokens
    if asked is not None and cap is not None and asked > cap:
        raise _invalid(f"`{param}` must be <= {cap} for this model, got {asked}", param)
    if asked is None:
        return route.default_new_tokens(n_input or 0)
    return asked


def check_context(route: ModelRoute, n_input: int | None, new_tokens: int, what: str, param: str) -> None:
    if n_input is None:
        return
    if n_input > route.max_input_tokens:
        raise GatewayError(f"This model's maximum input length is {route.max_input_tokens} tokens. However, your "
                           f"{what} resulted in {n_input} tokens. Please reduce the length of the {what}.",
                           param=param, code="context_length_exceeded")
    if n_input + new_tokens > route.max_total_tokens:
        raise GatewayError(f"This model's maximum context length is {route.max_total_tokens} tokens. However, you "
                           f"requested {n_input + new_tokens} tokens ({n_input} in the {what}, {new_tokens} in the "
                           f"completion). Please reduce the length of the {what} or completion.",
                           param=param, code="context_length_exceeded")


def core_request(req: SamplingExtras, route: ModelRoute, server: ServerConfig, *, prompt: str | None,
                 ids: list[int] | None, messages: list[ChatMessage] | None, new_tokens: int,
                 logprobs: bool, top_logprobs: int, traceparent: str | None = None,
                 constraint: OutputConstraint | None = None) -> GenerationRequest:
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default samples
    return GenerationRequest(
        request_id=uuid.uuid4().hex, model=route.name, prompt=prompt, prompt_token_ids=ids, messages=messages,
        temperature=temperature, top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        seed=req.seed, max_new_tokens=new_tokens, min_tokens=min(req.min_tokens or 0, new_tokens),
        stop=stop_list(req.stop, server), stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos), logprobs=logprobs, top_logprobs=top_logprobs, traceparent=traceparent,
        stream=bool(req.stream), constraint=constraint)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
        prompts = list(p)  # type: ignore[arg-type]
    else:
        raise _invalid("`prompt` must be a string, a list of strings, or token ids", "prompt")
    if not prompts or any(len(x) == 0 for x in prompts):
        raise _invalid("`prompt` must not be empty", "prompt")
    if req.suffix:
        raise _invalid("`suffix` is not supported by this gateway", "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise _invalid("`best_of` other than `n` is not supported by this gateway", "best_of")
    return prompts
