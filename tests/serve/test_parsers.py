"""Reasoning and tool-call parsers: pure Python, no server."""

from __future__ import annotations

import json
import re

import pytest

from trnrt.serve.output.reasoning import ReasoningParser, partial_suffix_len
from trnrt.serve.output.tool_calls import ToolCallParser, convert_value

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "opts": {"type": "object"}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def stream_reasoning(text: str, forced: bool, step: int = 1, **kw) -> tuple[str, str]:
    p = ReasoningParser(forced=forced, **kw)
    r, c = [], []
    for i in range(0, len(text), step):
        a, b = p.feed(text[i:i + step])
        r.append(a)
        c.append(b)
    a, b = p.flush()
    return "".join(r) + a, "".join(c) + b


# --- reasoning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,forced,reasoning,content", [
    ("I think.</think>Paris.", True, "I think.", "Paris."),
    ("I think.</think>\n\nParis.", True, "I think.", "Paris."),
    ("<think>I think.</think>Paris.", True, "I think.", "Paris."),  # a redundant <think> is dropped
    ("<think>I think.</think>Paris.", False, "I think.", "Paris."),
    ("\n<think>hm</think>ok", False, "hm", "ok"),
    ("Paris.", False, None, "Paris."),
    ("still thinking", True, "still thinking", ""),  # cut off before </think>
    ("</think>Paris.", True, None, "Paris."),  # empty reasoning
    ("plan<tool_call>f</tool_call>", True, "plan", "<tool_call>f</tool_call>"),  # a call ends reasoning
    ("a < b </thin", True, "a < b </thin", ""),  # partial marker at the end is text
])
def test_reasoning_split(text, forced, reasoning, content):
    assert ReasoningParser.split(text, forced=forced) == (reasoning, content)
    for step in (1, 2, 3, 7):
        r, c = stream_reasoning(text, forced, step)
        assert (r or None, c) == (reasoning, content)


def test_reasoning_holds_back_partial_markers():
    p = ReasoningParser(forced=True)
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>X") == ("", "X")
    assert not p.in_reasoning


def test_reasoning_tool_start_optional():
    # Without tools the <tool_call> marker is ordinary reasoning text.
    assert ReasoningParser.split("a<tool_call>b</think>c", forced=True, tool_start=None) == ("a<tool_call>b", "c")


def test_partial_suffix_len():
    assert partial_suffix_len("abc</th", ("</think>",)) == 4
    assert partial_suffix_len("abc", ("</think>",)) == 0
    assert partial_suffix_len("<", ("</think>", "<tool_call>")) == 1


# --- tool calls ---------------------------------------------------------------------------------
GLM47 = ("Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
         "<arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}</arg_value><arg_key>zip</arg_key>"
         "<arg_value>01234</arg_value></tool_call><tool_call>now</tool_call>")
GLM45 = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>")
GLM45_LITERAL = ("<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>")


def stream_tools(text: str, fmt: str, step: int = 1):
    p = ToolCallParser(TOOLS, fmt)
    content, deltas = [], []
    for i in range(0, len(text), step):
        ev = p.feed(text[i:i + step])
        content.append(ev.content)
        deltas.extend(ev.tool_deltas)
    ev = p.finish()
    content.append(ev.content)
    deltas.extend(ev.tool_deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if d.get("id"):
            assert c["id"] is None
            c["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            c["name"] = fn["name"]
        c["arguments"] += fn.get("arguments") or ""
    return "".join(content), [calls[i] for i in sorted(calls)]


def test_glm47_typed_arguments():
    content, calls = ToolCallParser(TOOLS, "glm47").parse(GLM47)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert [c.index for c in calls] == [0, 1]
    assert json.loads(calls[0].arguments) == {"city": "北京", "days": 3, "metric": True, "opts": {"a": [1, 2]},
                                              "zip": "01234"}
    # json.dumps' default separators, non-ASCII kept (as SGLang prints them)
    assert calls[0].arguments == json.dumps(json.loads(calls[0].arguments), ensure_ascii=False)
    assert calls[1].arguments == "{}"
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("text,fmt", [(GLM47, "glm47"), (GLM45, "glm45"), (GLM45_LITERAL, "glm45")])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_deltas_equal_non_streamed(text, fmt, step):
    content, calls = ToolCallParser(TOOLS, fmt).parse(text)
    s_content, s_calls = stream_tools(text, fmt, step)
    assert s_content.strip() == content
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_glm45_newline_form():
    content, calls = ToolCallParser(TOOLS, "glm45").parse(GLM45)
    assert content == "Let me check."
    assert json.loads(calls[0].arguments) == {"city": "北京", "days": 3}
    assert calls[1].name == "now" and calls[1].arguments == "{}"
    _, calls = ToolCallParser(TOOLS, "glm45").parse(GLM45_LITERAL)
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_glm45_content_only_before_first_call_glm47_everywhere():
    text = "A<tool_call>now</tool_call>B"
    assert ToolCallParser(TOOLS, "glm45").parse(text)[0] == "A"
    assert ToolCallParser(TOOLS, "glm47").parse(text)[0] == "AB"


def test_unknown_function_is_dropped():
    content, calls = ToolCallParser(TOOLS, "glm47").parse(
        "x<tool_call>rm_rf<arg_key>p</arg_key><arg_value>/</arg_value></tool_call><tool_call>now</tool_call>")
    assert [c.name for c in calls] == ["now"] and calls[0].index == 0


def test_no_complete_call_returns_raw_text():
    text = "see <tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"
    content, calls = ToolCallParser(TOOLS, "glm47").parse(text)
    assert calls == [] and content == text
    # Streaming closes the unterminated call's JSON so the client still gets valid JSON.
    _, s_calls = stream_tools(text, "glm47")
    assert s_calls[0]["arguments"] == "{}"


def test_plain_text_and_lookalikes_pass_through():
    for text in ["no calls here", "a <tool b", "x < y and <tool_cal"]:
        content, calls = ToolCallParser(TOOLS, "glm47").parse(text)
        assert (content, calls) == (text, [])
        assert stream_tools(text, "glm47")[0] == text


@pytest.mark.parametrize("raw,schema,value", [
    ("Paris", {"type": "string"}, "Paris"),
    ("3", {"type": "string"}, "3"),
    ("3", {"type": "integer"}, 3),
    ("2.5", {"type": "number"}, 2.5),
    ("true", {"type": "boolean"}, True),
    ("True", {"type": "boolean"}, True),  # Python literal fallback
    ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("not json", {"type": "integer"}, "not json"),
    ("7", None, 7),  # key not in the schema: JSON if it parses
    ("hello", None, "hello"),
    ("x", {"type": ["string", "null"]}, "x"),
    ("a", {"enum": ["a", "b"]}, "a"),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is not JSON: stays raw
])
def test_convert_value(raw, schema, value):
    assert convert_value(raw, schema) == value


def test_unknown_format_rejected():
    with pytest.raises(ValueError):
        ToolCallParser(TOOLS, "qwen25")
