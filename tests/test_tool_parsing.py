"""The gateway's own tool calling, piece by piece: the incremental call reader, the content/markup
split (streamed in any cut, it gives what the whole text gives), the forced-call schema, and the
prompt rewriting for templates with and without tools."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import ChatMessage, ToolCall, ToolChoice, ToolFunction
from gateway.chat_template import render_chat, uses_tools
from gateway.tools.calls import ToolCallAccumulator
from gateway.tools.parser import ToolCallParser
from gateway.tools.prompt import plain_messages, template_messages, template_tools
from gateway.tools.request import ToolRequest
from gateway.tools.schema import forced_calls_schema

WEATHER = ToolFunction(name="get_weather", description="Weather in a city",
                       parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = ToolFunction(name="get_time", parameters={"type": "object", "properties": {"zone": {"type": "string"}}})
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
TOOLS_TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                  "{{ m.content }}{% if m.tool_calls %} CALLS {{ m.tool_calls | tojson }}{% endif %}"
                  "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")


def parse(text: str, cuts: list[int] | None = None, **kw) -> tuple[str, list[ToolCall], int]:
    """Feed `text` cut at `cuts`; the content, the calls and how many content pieces came out."""
    parser = ToolCallParser(forced=kw.pop("forced", False), new_id=iter(f"call_{i}" for i in range(99)).__next__,
                            **kw)
    acc = ToolCallAccumulator()
    content, pieces, start = "", 0, 0
    for end in [*(cuts or []), len(text)]:
        piece, deltas = parser.feed(text[start:end])
        start = end
        content += piece
        pieces += bool(piece)
        acc.add(deltas)
    content += parser.finish()
    return content, acc.calls(), pieces


CASES = [
    ('Sure.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>', "Sure.",
     [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"arguments": {"x": [1, "}"]}, '
     '"name": "b"}\n</tool_call>', "", [("a", "{}"), ("b", '{"x": [1, "}"]}')]),
    ('<tool_call>[{"name": "f"}, {"name": "g", "parameters": {"q": "a\\"b"}}]</tool_call>', "",
     [("f", "{}"), ("g", '{"q": "a\\"b"}')]),
    ("<tool_call>[]</tool_call>", "", []),
    ("No tools needed: 2 < 3 and <b>bold</b>.\n\n", "No tools needed: 2 < 3 and <b>bold</b>.\n\n", []),
    ("a <tool", "a <tool", []),
    ("<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text", []),
    ('<tool_call>[{"name": "f", "arguments": {"x": 1}}] and then some text', "and then some text",
     [("f", '{"x": 1}')]),
    ('<tool_call>[{"name": "f", "arguments": {"x": 1}}, oops]</tool_call> after', " after", [("f", '{"x": 1}')]),
    ('<tool_call>[{"name": "f", "arguments": {}}]</tool_call>\nDone.', "\nDone.", [("f", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[c[0][:40] for c in CASES])
def test_auto_mode_splits_content_and_calls(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    for cuts in ([], list(range(1, len(text))), list(range(3, len(text), 4))):
        got_content, got_calls, _ = parse(text, cuts)
        assert got_content == content, cuts
        assert [(c.name, c.arguments) for c in got_calls] == calls
        assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]


def test_markup_is_never_streamed_as_content() -> None:
    text = 'Let me check.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    parser = ToolCallParser(forced=False)
    shown = "".join(parser.feed(c)[0] for c in text) + parser.finish()
    assert shown == "Let me check." and "<" not in shown


def test_parallel_false_keeps_only_the_first_call() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>' \
           '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    _, calls, _ = parse(text, parallel=False)
    assert [c.name for c in calls] == ["a"]


def test_forced_mode_reads_the_bare_list() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    content, calls, pieces = parse(text, list(range(1, len(text))), forced=True)
    assert content == "" and pieces == 0
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]


def test_forced_mode_cut_by_length_keeps_what_was_shown() -> None:
    content, calls, _ = parse('[{"name": "get_weather", "arguments": {"ci', forced=True)
    assert content == "" and calls[0].name == "get_weather" and calls[0].arguments == '{"ci'
    content, calls, _ = parse('[{"na', forced=True)  # not yet a call: the text stays visible
    assert content == '[{"na' and calls == []


call_json = st.fixed_dictionaries({"name": st.sampled_from(["a", "get_weather", "f-1"]),
                                   "arguments": st.dictionaries(st.text(max_size=5),
                                                                st.one_of(st.integers(), st.text(max_size=8)),
                                                                max_size=3)})


@settings(max_examples=150, deadline=None)
@given(prefix=st.text(alphabet="ab <>/\n", max_size=12), calls=st.lists(call_json, max_size=3),
       suffix=st.text(alphabet="xy \n", max_size=6), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_cut_of_the_stream_gives_the_whole_answer(prefix: str, calls: list, suffix: str, cuts: list) -> None:
    text = f"{prefix}<tool_call>{json.dumps(calls)}</tool_call>{suffix}"
    whole = parse(text)
    streamed = parse(text, sorted({c for c in cuts if c < len(text)}))
    assert streamed[:2] == whole[:2]
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [(c["name"], c["arguments"]) for c in calls]


def test_accumulator_joins_deltas_by_index() -> None:
    from backends.base import ToolCallDelta
    acc = ToolCallAccumulator()
    acc.add([ToolCallDelta(index=1, id="call_b", name="b", arguments="{"), ToolCallDelta(index=0, id="call_a",
                                                                                         name="a", arguments="{}")])
    acc.add([ToolCallDelta(index=1, arguments='"x": 1}')])
    assert acc.calls() == [ToolCall(id="call_a", name="a", arguments="{}"),
                           ToolCall(id="call_b", name="b", arguments='{"x": 1}')]


def test_forced_schema_admits_exactly_the_valid_calls() -> None:
    nested = ToolFunction(name="order", parameters={"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
                                                    "required": ["item"],
                                                    "$defs": {"Item": {"type": "object",
                                                                       "properties": {"sku": {"type": "string"}},
                                                                       "required": ["sku"]}}})
    schema = forced_calls_schema([WEATHER, TIME, nested], parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}},
          {"name": "order", "arguments": {"item": {"sku": "1"}}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "get_weather", "arguments": {}}],
                [{"name": "order", "arguments": {"item": {}}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = forced_calls_schema([WEATHER], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([ok[0], ok[0]], single)


HISTORY = [ChatMessage(role="user", content="Weather in Paris?"),
           ChatMessage(role="assistant", content=None,
                       tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
           ChatMessage(role="tool", content="22 C, sunny", tool_call_id="call_1"),
           ChatMessage(role="tool", content="humidity 40%", tool_call_id="call_1")]


def test_plain_rewrite_renders_in_a_template_without_tools() -> None:
    assert not uses_tools(SMOLLM2_TEMPLATE)
    messages = plain_messages(HISTORY, [WEATHER])
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>" in messages[0].content and '"get_weather"' in messages[0].content
    assert messages[2].content == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    assert messages[3].content == "<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\nhumidity 40%\n" \
                                  "</tool_response>"
    rendered = render_chat(SMOLLM2_TEMPLATE, [{"role": m.role, "content": m.content} for m in messages])
    assert rendered.endswith("<|im_start|>assistant\n") and "helpful AI assistant" not in rendered
    with_system = plain_messages([ChatMessage(role="system", content="Be brief."), *HISTORY[:1]], [WEATHER])
    assert with_system[0].content.startswith("Be brief.\n\nYou are an expert in composing functions.")
    assert plain_messages(HISTORY[:1], []) == [ChatMessage(role="user", content="Weather in Paris?")]


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    assert uses_tools(TOOLS_TEMPLATE)
    rendered = render_chat(TOOLS_TEMPLATE, template_messages(HISTORY), tools=template_tools([WEATHER]))
    assert rendered.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert 'CALLS [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}}]' in rendered and "tool: 22 C, sunny FOR call_1" in rendered


def test_offered_tools_follow_the_choice() -> None:
    assert ToolRequest([WEATHER, TIME], ToolChoice(mode="none"), True).offered == []
    assert ToolRequest([WEATHER, TIME], ToolChoice(mode="function", function="get_time"), True).offered == [TIME]
    assert ToolRequest([WEATHER, TIME], ToolChoice(mode="auto"), True).offered == [WEATHER, TIME]
