"""The tiny checkpoint's chat template (GLM-5.3-Flash format), rendered by transformers.

Golden strings are written out literally: a change to the template must change this file too.
"""

from __future__ import annotations

import json
import shutil

import pytest

from trnrt.models.tiny.checkpoint import CHAT_TEMPLATE_PATH
from trnrt.models.tiny.tokenizer import GLM_SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A transformers tokenizer loaded from a directory holding only tokenizer files + template."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tokenizer_files(d, build_tokenizer())
    shutil.copyfile(CHAT_TEMPLATE_PATH, d / "chat_template.jinja")
    t = AutoTokenizer.from_pretrained(str(d))
    # apply_chat_template must pick chat_template.jinja up from the directory by itself.
    assert t.chat_template == CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    return t


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]

WEATHER_ARGS = {"city": "Zürich", "days": 2, "options": {"unit": "celsius", "hourly": False}}


def conversation(arguments=None):
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "reasoning_content": "A greeting; answer briefly.",
         "content": " I am a tiny model. 🙂\n"},
        {"role": "user", "content": [{"type": "text", "text": "What's the weather in Zürich for 2 days?"}]},
        {"role": "assistant", "reasoning_content": "I should call get_weather.", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": WEATHER_ARGS if arguments is None else arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": ["sunny", "rain"]}'},
    ]


def render(tok, messages, **kw):
    kw.setdefault("add_generation_prompt", True)
    out = tok.apply_chat_template(messages, tokenize=False, **kw)
    assert isinstance(out, str)
    return out


TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)

BODY_AFTER_FIRST_ASSISTANT = (
    "<|user|>What's the weather in Zürich for 2 days?"
    "<|assistant|><think>I should call get_weather.</think>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value>"
    '<arg_key>options</arg_key><arg_value>{"unit": "celsius", "hourly": false}</arg_value></tool_call>'
    '<|observation|><tool_response>{"forecast": ["sunny", "rain"]}</tool_response>'
)


def test_golden_default_thinking_on(tok):
    assert render(tok, conversation()) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max"
        "<|system|>You are a concise assistant."
        "<|user|>Hi! Who are you?"
        "<|assistant|><think>A greeting; answer briefly.</think>I am a tiny model. 🙂"
        + BODY_AFTER_FIRST_ASSISTANT
        + "<|assistant|><think>"
    )


def test_golden_thinking_off(tok):
    assert render(tok, conversation(), enable_thinking=False) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max"
        "<|system|>You are a concise assistant."
        "<|user|>Hi! Who are you?"
        "<|assistant|><think>A greeting; answer briefly.</think>I am a tiny model. 🙂"
        + BODY_AFTER_FIRST_ASSISTANT
        + "<|assistant|></think>"
    )


def test_golden_tools_low_effort_clear_thinking(tok):
    # clear_thinking drops the reasoning of turns before the last user message only.
    assert render(tok, conversation(), tools=TOOLS, reasoning_effort="low", clear_thinking=True) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Low"
        + TOOLS_BLOCK
        + "<|system|>You are a concise assistant."
        "<|user|>Hi! Who are you?"
        "<|assistant|><think></think>I am a tiny model. 🙂"
        + BODY_AFTER_FIRST_ASSISTANT
        + "<|assistant|><think>"
    )


def test_reasoning_effort_levels(tok):
    msgs = [{"role": "user", "content": "x"}]
    assert render(tok, msgs, reasoning_effort="high").startswith("[gMASK]<sop><|system|>Reasoning Effort: High<|user|>")
    assert render(tok, msgs, reasoning_effort="medium").startswith("[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>")
    assert render(tok, msgs) == "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>x<|assistant|><think>"
    assert render(tok, msgs, add_generation_prompt=False) == "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>x"


def test_json_string_arguments_render_like_a_dict(tok):
    # OpenAI clients send arguments as a JSON string; ASCII-escaped non-ASCII (ensure_ascii=True,
    # Python's default) and escaped quotes/newlines must come out as the text itself.
    args = {"city": "São Paulo 🙂", "days": 2, "note": 'say "hi"\nthen go, ok: yes', "nested": {"a": [1, "b,c:}"]}}
    as_dict = render(tok, conversation(args))
    assert render(tok, conversation(json.dumps(args))) == as_dict
    assert render(tok, conversation(json.dumps(args, ensure_ascii=False))) == as_dict
    assert (
        '<tool_call>get_weather<arg_key>city</arg_key><arg_value>São Paulo 🙂</arg_value>'
        '<arg_key>days</arg_key><arg_value>2</arg_value>'
        '<arg_key>note</arg_key><arg_value>say "hi"\nthen go, ok: yes</arg_value>'
        '<arg_key>nested</arg_key><arg_value>{"a": [1, "b,c:}"]}</arg_value></tool_call>'
    ) in as_dict
    no_args = render(tok, conversation("{}"))
    assert "<tool_call>get_weather</tool_call>" in no_args
    assert render(tok, conversation("")) == no_args


def test_consecutive_tool_results_share_one_observation(tok):
    msgs = conversation() + [{"role": "tool", "content": [{"type": "text", "text": "second"}]}]
    out = render(tok, msgs)
    assert out.endswith(
        '<|observation|><tool_response>{"forecast": ["sunny", "rain"]}</tool_response>'
        "<tool_response>second</tool_response><|assistant|><think>"
    )
    assert out.count("<|observation|>") == 1


def test_reasoning_split_out_of_content(tok):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nlet me see\n</think>\n\nThe answer."},
        {"role": "user", "content": "again"},
    ]
    assert render(tok, msgs) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>q"
        "<|assistant|><think>let me see</think>The answer.<|user|>again<|assistant|><think>"
    )


def test_rendered_prompt_tokenizes_special_strings_as_single_tokens(tok):
    out = render(tok, conversation(), tools=TOOLS)
    ids = tok(out, add_special_tokens=False)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[:3] == ["[gMASK]", "<sop>", "<|system|>"]
    assert toks[-2:] == ["<|assistant|>", "<think>"]
    for s in ("<|user|>", "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>",
              "<tool_response>", "</think>"):
        assert s in toks
    assert set(toks) & set(GLM_SPECIAL_TOKENS)
    assert tok.decode(ids) == out


def test_unknown_role_is_an_error(tok):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown message role"):
        render(tok, [{"role": "narrator", "content": "x"}])
