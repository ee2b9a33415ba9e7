"""Upstream wire traffic as each server sends it (shapes from ../shared/reference/protocols.md §1, §3, §4)."""

from __future__ import annotations

import json

from tests.upstream import CUT, Hold, Reply, by_stream, split_every, sse

TOKENS = [(9, "Hello", -0.1), (10, " world", -0.2), (11, "!", -0.3)]
TEXT = "Hello world!"


def tgi_stream_events(finish: str = "length") -> list[dict]:
    events = [{"index": i + 1, "token": {"id": t, "text": s, "logprob": lp, "special": False},
               "generated_text": None, "details": None} for i, (t, s, lp) in enumerate(TOKENS)]
    events[-1]["generated_text"] = TEXT
    events[-1]["details"] = {"finish_reason": finish, "generated_tokens": 3, "seed": None, "input_length": 4}
    return events


def tgi_chat_chunks() -> list[dict]:
    base = {"object": "chat.completion.chunk", "id": "", "created": 1, "model": "tgi",
            "system_fingerprint": "3.3.6-dev0-native"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": s}, "logprobs": None,
                                    "finish_reason": None}], "usage": None} for _, s, _ in TOKENS]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}})
    return chunks


def tgi_routes() -> dict:
    """TGI 3.3: events split into 7-byte reads; chat in TGI's dialect (role on every delta)."""
    return {
        ("GET", "/health"): Reply([], 200, "text/plain"),
        ("GET", "/info"): Reply([b'{"model_id":"recorded/tgi","max_total_tokens":2048,"max_input_tokens":1024}'],
                                200, "application/json"),
        ("POST", "/generate_stream"): Reply(split_every(sse(*tgi_stream_events()), 7)),
        ("POST", "/v1/chat/completions"): Reply(split_every(sse(*tgi_chat_chunks(), b"[DONE]"), 11)),
        ("POST", "/tokenize"): Reply([b'[{"id":9,"text":"Hello","start":0,"stop":5}]'], 200, "application/json"),
    }


def triton_ensemble_routes(model: str = "ensemble") -> dict:
    """The ensemble's decoupled stream: text deltas, every output tensor, no finish reason, no [DONE]."""
    events = [{"model_name": model, "model_version": "1", "sequence_end": False, "sequence_id": 0,
               "sequence_start": False, "text_output": s, "num_input_tokens": 4, "num_output_tokens": i + 1}
              for i, (_, s, _) in enumerate(TOKENS)]
    return {
        ("GET", f"/v2/models/{model}/ready"): Reply([], 200, "text/plain"),
        ("POST", f"/v2/models/{model}/generate_stream"): Reply([sse(*events, crlf=True)]),
    }


def triton_llmapi_routes(model: str = "tensorrt_llm") -> dict:
    events = [{"model_name": model, "model_version": "1", "text_output": s, "finish_reason": [""],
               "stop_reason": [""]} for _, s, _ in TOKENS]
    events[-1]["finish_reason"] = ["length"]
    return {
        ("GET", f"/v2/models/{model}/ready"): Reply([], 200, "text/plain"),
        ("POST", f"/v2/models/{model}/generate_stream"): Reply([sse(*events)]),
    }


def trtllm_chunks(kind: str) -> list[dict]:
    """trtllm-serve (adapted from vLLM): a role-only first chunk, content deltas, usage, [DONE]."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    base = {"id": "chatcmpl-7", "object": obj, "created": 1, "model": "llama"}

    def choice(text: str, finish: str | None = None) -> dict:
        body = {"delta": {"content": text}} if kind == "chat" else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    chunks = []
    if kind == "chat":
        chunks.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
    chunks += [{**base, "choices": [choice(s, "stop" if i == 2 else None)]} for i, (_, s, _) in enumerate(TOKENS)]
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}})
    return chunks


def trtllm_whole(kind: str) -> bytes:
    """A non-streamed answer: the whole message, finish reason and usage in one JSON object."""
    usage = {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": TEXT}, "logprobs": None,
                  "finish_reason": "stop", "stop_reason": None}
    else:
        choice = {"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    return json.dumps({"id": "cmpl-7", "object": "chat.completion" if kind == "chat" else "text_completion",
                       "created": 1, "model": "llama", "choices": [choice], "usage": usage}).encode()


def trtllm_routes() -> dict:
    return {
        ("GET", "/v1/models"): Reply([b'{"object":"list","data":[{"id":"llama","object":"model"}]}'], 200,
                                     "application/json"),
        ("POST", "/v1/chat/completions"): by_stream(Reply([sse(*trtllm_chunks("chat"), b"[DONE]")]),
                                                    Reply([trtllm_whole("chat")], 200, "application/json")),
        ("POST", "/v1/completions"): by_stream(
            Reply(split_every(sse(*trtllm_chunks("completions"), b"[DONE]"), 5)),
            Reply(split_every(trtllm_whole("completions"), 9), 200, "application/json")),
    }


def vllm_held_back_routes() -> dict:
    """vLLM holds text back while it may still end in a stop string or a split multi-byte character, then sends
    it in one chunk: three tokens in two chunks, and the usage chunk counts three."""
    def chunks(kind: str) -> list[dict]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def choice(text: str, finish: str | None) -> dict:
            body = {"delta": {"content": text}} if kind == "chat" else {"text": text}
            return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

        base = {"id": "cmpl-1", "object": obj, "created": 1, "model": "llama"}
        return [{**base, "choices": [choice("Hello world", None)]}, {**base, "choices": [choice("!", "length")]},
                {**base, "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}}]

    return both_openai_routes(lambda kind: Reply([sse(*chunks(kind), b"[DONE]")]))


def both_openai_routes(reply) -> dict:  # noqa: ANN001
    return {("POST", "/v1/chat/completions"): reply("chat"), ("POST", "/v1/completions"): reply("completions")}


FAILURES = {
    # status and body before the stream starts
    "tgi_overloaded": {(method, path): Reply([b'{"error":"Model is overloaded","error_type":"overloaded"}'], 429,
                                             "application/json")
                       for method, path in [("POST", "/generate_stream"), ("POST", "/v1/chat/completions")]},
    "tgi_plain_text_422": {("POST", "/generate_stream"): Reply(
        [b"Failed to deserialize the JSON body into the target type: inputs: invalid type"], 422, "text/plain")},
    "trtllm_flat_400": both_openai_routes(lambda kind: Reply(
        [b'{"object":"error","message":"max_tokens is too large","type":"BadRequestError","param":null,'
         b'"code":400}'], 400, "application/json")),
    "vllm_nested_404": {("POST", "/v1/chat/completions"): Reply(
        [b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}'],
        404, "application/json")},
    # errors after the stream started
    "tgi_error_event": {("POST", "/generate_stream"): Reply([sse(
        tgi_stream_events()[0], {"error": "Request failed during generation: CUDA out of memory",
                                 "error_type": "generation"})])},
    "triton_error_in_200": {("POST", "/v2/models/ensemble/generate_stream"): Reply([sse(
        {"model_name": "ensemble", "model_version": "1", "text_output": "Hello"},
        {"error": "in-flight batcher failed"})])},
    "trtllm_cut": both_openai_routes(lambda kind: by_stream(Reply([sse(*trtllm_chunks(kind)[:2]), CUT]),
                                                            Reply([trtllm_whole(kind)[:20], CUT], 200,
                                                                  "application/json"))),
    # after one token: keep-alive comments every 0.1 s (not events, so the idle timeout still runs)
    "hang": both_openai_routes(lambda kind: Reply([sse(*trtllm_chunks(kind)[:2])] + [0.1, b":\n\n"] * 300)),
    "trtllm_truncated": both_openai_routes(lambda kind: Reply([sse(*trtllm_chunks(kind)[:2])])),
    "slow_first_token": both_openai_routes(lambda kind: Reply([30.0])),
}


def openai_text_routes(text: str, *, first_delay: float = 0.0, gap: float = 0.0, status: int = 200,
                       hold: Hold | None = None, hold_after: int = 0) -> dict:
    """An OpenAI-compatible upstream that answers `text` (word by word when streaming), after
    `first_delay` seconds and with `gap` seconds between chunks; or an error `status`. With `hold`,
    each answer also waits there until the test opens it: after `hold_after` streamed words, or
    before the whole answer."""
    words = [w if i == 0 else " " + w for i, w in enumerate(text.split(" "))]
    usage = {"prompt_tokens": 4, "completion_tokens": len(words), "total_tokens": 4 + len(words)}

    def stream(kind: str) -> Reply:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        pieces: list = [first_delay] if first_delay else []
        for i, w in enumerate(words):
            if hold is not None and i == hold_after:
                pieces.append(hold)
            body = {"delta": {"content": w}} if kind == "chat" else {"text": w}
            finish = "stop" if i == len(words) - 1 else None
            pieces.append(sse({"id": "x", "object": obj, "created": 1, "model": "m",
                               "choices": [{"index": 0, **body, "finish_reason": finish}]}))
            if gap:
                pieces.append(gap)
        pieces.append(sse({"id": "x", "object": obj, "created": 1, "model": "m", "choices": [], "usage": usage},
                          b"[DONE]"))
        return Reply(pieces)

    def whole(kind: str) -> Reply:
        choice = {"index": 0, "finish_reason": "stop",
                  **({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})}
        body = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
                           "usage": usage}).encode()
        return Reply(([first_delay] if first_delay else []) + ([hold] if hold is not None else []) + [body], 200,
                     "application/json")

    def reply(kind: str):  # noqa: ANN202
        if status != 200:
            return Reply([json.dumps({"error": {"message": f"upstream says {status}", "type": "x",
                                                "code": status}}).encode()], status, "application/json")
        return by_stream(stream(kind), whole(kind))

    return {("GET", "/v1/models"): Reply([b'{"data":[]}'], 200, "application/json"),
            ("POST", "/v1/chat/completions"): reply("chat"), ("POST", "/v1/completions"): reply("completions")}
