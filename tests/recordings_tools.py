"""Upstream traffic with output constraints and tool calls, as each server sends it.

TGI 3.3 (../shared/reference/api-surface.md §2, §4): a grammar changes only which tokens come; the
event shapes are those of tests/recordings.py. trtllm-serve (tensorrt_llm/serve/postprocess_handlers.py):
chunks dumped with exclude_none (so `content` and `reasoning_content` are "" and the first chunk's
line ends in " \\n\\n"), and a named tool_choice streams every piece with the name and no id.
"""

from __future__ import annotations

import json

from backends.base import TokenEvent
from tests.upstream import Reply, by_stream, split_every, sse

JSON_TOKENS = [(90, '{"', -0.1), (91, "city", -0.1), (92, '":"', -0.2), (93, "Paris", -0.3), (94, '"}', -0.1)]
JSON_TEXT = '{"city":"Paris"}'
# the gateway's forced tool calls (a JSON list, gateway/tools/schema.py) as TGI streams them
CALL_TOKENS = [(80, '[{"', -0.1), (81, "name", -0.1), (82, '":"', -0.1), (83, "get_weather", -0.2),
               (84, '","', -0.1), (85, "arguments", -0.1), (86, '":{"', -0.1), (91, "city", -0.1),
               (92, '":"', -0.2), (93, "Paris", -0.3), (87, '"}}]', -0.1)]
CALL_TEXT = '[{"name":"get_weather","arguments":{"city":"Paris"}}]'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALLS = [("chatcmpl-tool-6f1c2a", "get_weather", ['{"city": ', '"Paris"}']),
         ("chatcmpl-tool-9b0d4e", "get_time", ['{"zone": ', '"CET"}'])]


def tgi_json_events() -> list[dict]:
    events = [{"index": i + 1, "token": {"id": t, "text": s, "logprob": lp, "special": False},
               "generated_text": None, "details": None, "top_tokens": None} for i, (t, s, lp) in enumerate(JSON_TOKENS)]
    events.append({"index": 6, "token": {"id": 2, "text": "<|im_end|>", "logprob": -0.01, "special": True},
                   "generated_text": JSON_TEXT, "top_tokens": None,
                   "details": {"finish_reason": "eos_token", "generated_tokens": 6, "seed": None, "input_length": 7}})
    return events


def tgi_json_whole() -> bytes:
    tokens = [{"id": t, "text": s, "logprob": lp, "special": False} for t, s, lp in JSON_TOKENS]
    tokens.append({"id": 2, "text": "<|im_end|>", "logprob": -0.01, "special": True})
    return json.dumps({"generated_text": JSON_TEXT, "details": {
        "finish_reason": "eos_token", "generated_tokens": 6, "seed": None,
        "prefill": [{"id": 1, "text": "<s>", "logprob": None}], "tokens": tokens, "top_tokens": None}}).encode()


def tgi_json_chat_chunks(tokens: list[tuple[int, str, float]] = JSON_TOKENS) -> list[dict]:
    base = {"object": "chat.completion.chunk", "id": "", "created": 1, "model": "tgi",
            "system_fingerprint": "3.3.6-dev0-native"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": s}, "logprobs": None,
                                    "finish_reason": None}], "usage": None} for _, s, _ in tokens]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(tokens),
                                                    "total_tokens": 7 + len(tokens)}})
    return chunks


def tgi_grammar_routes() -> dict:
    return {
        ("GET", "/health"): Reply([], 200, "text/plain"),
        ("POST", "/generate_stream"): Reply(split_every(sse(*tgi_json_events()), 9)),
        ("POST", "/generate"): Reply([tgi_json_whole()], 200, "application/json"),
        # a regex grammar here is the gateway's forced tool calls, compiled (backends/constraints.py)
        ("POST", "/v1/chat/completions"): lambda body: Reply(split_every(sse(*tgi_json_chat_chunks(
            CALL_TOKENS if (body.get("response_format") or {}).get("type") == "regex" else JSON_TOKENS),
            b"[DONE]"), 13)),
    }


_TRT = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "llama"}
_TRT_USAGE = {**_TRT, "choices": [], "usage": {"prompt_tokens": 12, "total_tokens": 20, "completion_tokens": 8,
                                               "prompt_tokens_details": {"cached_tokens": 0}}}


def _trt_line(payload: dict, trailing_space: bool = False) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return b"data: " + body + (b" \n\n" if trailing_space else b"\n\n")


def _trt_choice(delta: dict, finish: str | None = None) -> dict:
    choice: dict = {"index": 0, "delta": delta}
    if finish:
        choice["finish_reason"] = finish
    return {**_TRT, "choices": [choice]}


def trtllm_auto_tool_stream() -> bytes:
    """A tool parser's stream: per call a first piece with id and name, then argument pieces."""
    lines = [_trt_line(_trt_choice({"role": "assistant"}), trailing_space=True)]
    for index, (call_id, name, pieces) in enumerate(CALLS):
        first = {"id": call_id, "type": "function", "index": index, "function": {"name": name, "arguments": ""}}
        lines.append(_trt_line(_trt_choice({"content": "", "reasoning_content": "", "tool_calls": [first]})))
        for piece in pieces:
            call = {"type": "function", "index": index, "function": {"arguments": piece}}
            lines.append(_trt_line(_trt_choice({"content": "", "reasoning_content": "", "tool_calls": [call]})))
    lines.append(_trt_line(_trt_choice({"content": "", "reasoning_content": ""}, "tool_calls")))
    lines.append(_trt_line({**_TRT_USAGE}) + b"data: [DONE]\n\n")
    return b"".join(lines)


def trtllm_named_tool_stream() -> bytes:
    """tool_choice naming a function: the model's text is the arguments; every piece repeats the name."""
    lines = [_trt_line(_trt_choice({"role": "assistant"}), trailing_space=True)]
    pieces = CALLS[0][2]
    for i, piece in enumerate(pieces):
        call = {"type": "function", "index": 0, "function": {"name": "get_weather", "arguments": piece}}
        lines.append(_trt_line(_trt_choice({"tool_calls": [call]}, "stop" if i == len(pieces) - 1 else None)))
    lines.append(_trt_line({**_TRT_USAGE}) + b"data: [DONE]\n\n")
    return b"".join(lines)


def trtllm_tool_whole(named: bool) -> bytes:
    calls = CALLS[:1] if named else CALLS
    tool_calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": "".join(pieces)}}
                  for call_id, name, pieces in calls]
    message = {"role": "assistant", "content": "", "reasoning_content": None if named else "", "reasoning": None,
               "tool_calls": tool_calls}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop" if named else "tool_calls",
              "stop_reason": None, "mm_embedding_handle": None, "disaggregated_params": None,
              "avg_decoded_tokens_per_iter": None}
    return json.dumps({"id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "llama",
                       "choices": [choice], "usage": _TRT_USAGE["usage"], "prompt_token_ids": None}).encode()


def trtllm_json_stream(kind: str) -> bytes:
    """A `response_format` answer: plain content (chat) or text (completions) that is the JSON."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    base = {**_TRT, "object": obj}
    lines = [_trt_line({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}, True)] \
        if kind == "chat" else []
    for i, (_, s, _) in enumerate(JSON_TOKENS):
        finish = "stop" if i == len(JSON_TOKENS) - 1 else None
        body = {"delta": {"content": s, "reasoning_content": ""}} if kind == "chat" else {"text": s}
        lines.append(_trt_line({**base, "choices": [{"index": 0, **body, **({"finish_reason": finish}
                                                                             if finish else {})}]}))
    lines.append(_trt_line({**_TRT_USAGE, "object": obj}) + b"data: [DONE]\n\n")
    return b"".join(lines)


def trtllm_tool_routes() -> dict:
    def chat(body: dict) -> Reply:
        if "response_format" in body:
            return Reply([trtllm_json_stream("chat")])
        named = isinstance(body.get("tool_choice"), dict)
        if body.get("stream"):
            return Reply(split_every(trtllm_named_tool_stream() if named else trtllm_auto_tool_stream(), 17))
        return Reply([trtllm_tool_whole(named)], 200, "application/json")

    return {("GET", "/v1/models"): Reply([b'{"object":"list","data":[{"id":"llama","object":"model"}]}'], 200,
                                         "application/json"),
            ("POST", "/v1/chat/completions"): chat,
            ("POST", "/v1/completions"): by_stream(Reply([trtllm_json_stream("completions")]),
                                                   Reply([b"{}"], 500, "application/json"))}


def fold_tool_calls(events: list[TokenEvent]) -> dict[int, dict]:
    """Tool-call deltas folded as an OpenAI client folds them, checking the normalised form on the way:
    a call's first piece has its id and name, later pieces only argument text."""
    calls: dict[int, dict] = {}
    for delta in (d for e in events for d in e.tool_calls):
        if delta.index not in calls:
            assert delta.id and delta.name, delta
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": delta.arguments}
        else:
            assert delta.id is None and delta.name is None, delta
            calls[delta.index]["arguments"] += delta.arguments
    return calls
