"""Output constraints through both doors, end to end against the embedded SmolLM2: OpenAI
`response_format` (and the SDK's `parse` with a pydantic model), vLLM's `structured_outputs` and the
old `guided_*` fields, TGI's `parameters.grammar` (and InferenceClient's `grammar` / `response_format`),
the protocols' errors for bad constraints, and one bad request among good ones changing nothing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from pydantic import BaseModel

from tests.spec import validate

TIMEOUT = 120.0
# bounded, so that even a small model's output ends: an integer or a free string could run to max_tokens
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "enum": ["France", "Italy", "Spain"]}},
        "required": ["city", "country"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Name a big city in France, and its country, as JSON."}]


class Capital(BaseModel):
    country: str
    capital: str


@pytest.fixture(scope="module")
def client(gateway_url: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def chat(url: str, **body: Any) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT,
                   json={"model": "smollm2", "messages": ASK, "temperature": 0, "max_tokens": 60, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_response_format(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=60,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "city", "schema": CITY, "strict": True}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), CITY)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=ASK, temperature=0, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}))
    assert streamed == resp.choices[0].message.content


def test_sdk_parse_with_a_pydantic_model(client: OpenAI) -> None:
    done = client.chat.completions.parse(model="smollm2", temperature=0, max_tokens=60, response_format=Capital,
                                         messages=[{"role": "user", "content": "What is the capital of Italy?"}])
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital


@pytest.mark.parametrize("field", [{"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"json_object": True}}], ids=["response_format", "so"])
def test_json_object_mode(gateway_url: str, field: dict) -> None:
    # any JSON object: the model picks its size, so the question asks for a small one
    body = chat(gateway_url, max_tokens=100, **field, messages=[
        {"role": "user", "content": "Give a JSON object with the name and country of a French city."}])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    validate("openai", "CreateChatCompletionResponse", body)


def test_tgi_forms_of_response_format_on_chat(gateway_url: str) -> None:
    """huggingface_hub sends a json_schema format as TGI's `{"type": "json_object", "value": schema}`."""
    for fmt in ({"type": "json_object", "value": CITY}, {"type": "json", "value": json.dumps(CITY)},
                {"type": "json_schema", "value": {"name": "c", "schema": CITY}}):
        content = chat(gateway_url, response_format=fmt)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), CITY)
    assert chat(gateway_url, response_format={"type": "regex", "value": "(yes|no)"},
                max_tokens=5)["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize(("field", "value", "check"), [
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("guided_choice", ["Paris", "Lyon", "Nice"], lambda t: t in ("Paris", "Lyon", "Nice")),
    ("structured_outputs", {"regex": "[A-Z][a-z]{1,12}, France"},
     lambda t: re.fullmatch("[A-Z][a-z]{1,12}, France", t)),
    ("guided_regex", "[0-9]{3}-[0-9]{4}", lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
    ("structured_outputs", {"grammar": 'root ::= "It is " ("sunny" | "rainy") "."'},
     lambda t: t in ("It is sunny.", "It is rainy.")),
    ("guided_grammar", 'root ::= ("red" | "green" | "blue") " " [0-9]',
     lambda t: re.fullmatch("(red|green|blue) [0-9]", t)),
    ("structured_outputs", {"json": json.dumps(CITY)}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ("guided_json", CITY, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
], ids=["so-choice", "guided_choice", "so-regex", "guided_regex", "so-grammar", "guided_grammar", "so-json",
        "guided_json"])
def test_vllm_fields_on_chat_and_completions(gateway_url: str, field: str, value: Any, check: Any) -> None:
    text = chat(gateway_url, **{field: value})["choices"][0]["message"]["content"]
    assert check(text), text
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "prompt": "Answer: ", "temperature": 0, "max_tokens": 60, field: value})
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["text"]), r.json()


def test_completions_response_format(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "prompt": "A French city as JSON:", "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), CITY)


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": CITY},
    {"type": "json", "value": json.dumps(CITY)},  # a string is re-parsed, as TGI does
    {"type": "json_object", "value": CITY},
    {"type": "json_schema", "value": {"name": "city", "schema": CITY}},
], ids=["json", "json-string", "json_object-alias", "json_schema"])
def test_tgi_json_grammar_on_every_route(gateway_url: str, grammar: dict) -> None:
    params = {"max_new_tokens": 60, "grammar": grammar}
    whole = httpx.post(f"{gateway_url}/generate", timeout=TIMEOUT,
                       json={"inputs": "A French city as JSON:", "parameters": params}).json()
    jsonschema.validate(json.loads(whole["generated_text"]), CITY)
    raw = httpx.post(f"{gateway_url}/generate_stream", timeout=TIMEOUT,
                     json={"inputs": "A French city as JSON:", "parameters": params}).text
    events = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1]["generated_text"] == whole["generated_text"]
    compat = httpx.post(f"{gateway_url}/", timeout=TIMEOUT, json={
        "inputs": "A French city as JSON:", "parameters": {**params, "return_full_text": False}}).json()
    assert compat == [{"generated_text": whole["generated_text"]}]


def test_inference_client_grammar_and_response_format(gateway_url: str) -> None:
    tgi = InferenceClient(model=gateway_url, timeout=TIMEOUT)
    text = tgi.text_generation("A French city as JSON:", max_new_tokens=60, return_full_text=False,
                               grammar={"type": "json", "value": CITY})
    jsonschema.validate(json.loads(text), CITY)
    events = list(tgi.text_generation("The answer is", max_new_tokens=10, stream=True, details=True,
                                      return_full_text=False, grammar={"type": "regex", "value": "(yes|no)"}))
    assert events[-1].generated_text in ("yes", "no") and events[-1].details.finish_reason == "eos_token"
    chat_client = InferenceClient(base_url=gateway_url, timeout=TIMEOUT)
    out = chat_client.chat_completion(messages=ASK, model="smollm2", max_tokens=60, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "city", "schema": CITY}})
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
OPENAI_BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function", "`name`"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "length >= 1"),
    ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].type", "custom tools"),
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
     "tools[0].function.parameters", "not a valid JSON Schema"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": [TOOL], "tool_choice": "f"}, "tool_choice", "Invalid value for `tool_choice`: f!"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.function", "Invalid value for `function`: `None`"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
     "Expected field `name`"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "either use constraints for structured outputs or tools"),
    ({"functions": [{"name": "f"}]}, "functions", "use `tools`"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "`tool_call_id`"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[0].content[0]", "only text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": CITY}}}, "response_format.json_schema",
     "`name`"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "Invalid value"),
    ({"structured_outputs": {}}, "structured_outputs", "You must use one kind of structured outputs constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "You can only use one kind of structured outputs constraint but multiple are specified"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "not a valid regular expression"),
    ({"guided_regex": "a{2,1}"}, "guided_regex", "not a valid regular expression"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "at least one choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "multiple are specified"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag", "not supported"),
]


@pytest.mark.parametrize(("extra", "param", "needle"), OPENAI_BAD, ids=[p + ":" + n[:24] for _, p, n in OPENAI_BAD])
def test_openai_bad_constraints_and_tools_name_the_field(gateway_url: str, extra: dict, param: str,
                                                         needle: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={**CHAT, **extra}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    validate("openai", "ErrorResponse", r.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format"),
], ids=["ebnf-syntax", "dangling-ref"])
def test_constraints_the_library_refuses_name_the_field(gateway_url: str, extra: dict, param: str,
                                                        stream: bool) -> None:
    """Past the door's checks, the engine's grammar library refuses these before the first token."""
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={**CHAT, **extra, "stream": stream}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


TGI_BAD = [
    ({"type": "json", "value": {"type": "object"}}, "grammar is not valid: Grammar must have a 'properties' field"),
    ({"type": "json_schema", "value": {"schema": {"type": "object"}}},
     "grammar is not valid: Grammar must have a 'properties' field"),
    ({"type": "json", "value": 5}, "grammar is not supported"),
    ({"type": "json", "value": "{nope"}, "grammar is not valid: "),
    ({"type": "json", "value": {"properties": {}, "type": "thing"}}, "grammar is not valid: "),
    ({"type": "json", "value": {"properties": 7}}, "grammar is not valid: "),
    ({"type": "regex", "value": "(unclosed"}, "Input validation error: "),  # refused by the engine's library
]


@pytest.mark.parametrize(("grammar", "needle"), TGI_BAD, ids=[n[:40] for _, n in TGI_BAD])
def test_tgi_bad_grammar_gets_tgi_errors(gateway_url: str, grammar: dict, needle: str) -> None:
    body = {"inputs": "x", "parameters": {"grammar": grammar}}
    r = httpx.post(f"{gateway_url}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"] and r.json()["error_type"] == "validation"
    if needle.startswith("grammar"):
        assert r.json()["error"] == f"Input validation error: {needle}" or needle.endswith(": ")
    streamed = httpx.post(f"{gateway_url}/generate_stream", json=body, timeout=TIMEOUT)
    assert streamed.status_code == 200 and needle in json.loads(streamed.text[6:])["error"]


@pytest.mark.parametrize("grammar", [{"type": "json_object"}, {"type": "json_schema", "value": {"name": "x"}},
                                     {"type": "regex"}, {"type": "regex", "value": 5}, {"type": "xml", "value": "a"},
                                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}])
def test_tgi_grammar_that_does_not_deserialize_is_a_422(gateway_url: str, grammar: dict) -> None:
    r = httpx.post(f"{gateway_url}/generate", json={"inputs": "x", "parameters": {"grammar": grammar}})
    assert r.status_code == 422
    assert r.json()["error"].startswith("Failed to deserialize the JSON body into the target type: parameters.grammar")


def test_one_bad_request_among_good_ones_changes_nothing(gateway_url: str) -> None:
    good = [("/v1/chat/completions", {**CHAT, "messages": ASK, "temperature": 0, "max_tokens": 40,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": CITY}}}),
            ("/v1/chat/completions", {**CHAT, "messages": ASK, "temperature": 0, "max_tokens": 20}),
            ("/generate", {"inputs": "The answer is",
                           "parameters": {"max_new_tokens": 8, "grammar": {"type": "regex", "value": "(yes|no)"}}}),
            ("/v1/completions", {"model": "smollm2", "prompt": "Once upon", "temperature": 0, "max_tokens": 12})]
    bad = ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "(a"}})

    def send(req: tuple[str, dict]) -> tuple[int, Any]:
        r = httpx.post(gateway_url + req[0], json=req[1], timeout=TIMEOUT)
        body = r.json()
        if r.status_code == 200:
            body.pop("id", None), body.pop("created", None)
        return r.status_code, body

    alone = [send(g) for g in good]
    with ThreadPoolExecutor(len(good) * 2 + 1) as pool:
        futures = [pool.submit(send, g) for g in good] + [pool.submit(send, bad)] + \
            [pool.submit(send, g) for g in good]
        together = [f.result() for f in futures]
    assert together[len(good)][0] == 400
    assert together[:len(good)] == alone and together[len(good) + 1:] == alone
