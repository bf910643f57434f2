"""The tool_choice grammar (trnrt.engine.sample.tool_call_grammar) on xgrammar's matcher, token by token.

Checks the two faults of xgrammar's built-in GLM tag are fixed (the special ids are demanded, a
length-bounded string cannot swallow `</arg_value>`), the call counts of required / named /
parallel, the reasoning prefix, and a random walk over the masks: every output the grammar can
produce parses (the server's GLM parser) into calls whose arguments validate (jsonschema).
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from trnrt.engine.sample.grammar import GrammarCompilerService  # noqa: E402
from trnrt.engine.sample.grammar_spec import GrammarSpec  # noqa: E402
from trnrt.engine.sample.tool_call_grammar import ToolGrammarError, tool_call_tag  # noqa: E402
from trnrt.serve.output.tool_calls import ToolCallParser  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 4},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }, "required": ["city", "days"]}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "meta": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
                 "required": ["k"], "additionalProperties": False},
        "ok": {"type": "boolean"},
    }, "required": ["meta"], "$defs": {"tag": {"type": "string", "enum": ["a", "b"]}}}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOTE, PING]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from trnrt.models.tiny.tokenizer import write_tokenizer_files

    d = tmp_path_factory.mktemp("hf_tok")
    write_tokenizer_files(d)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def svc(tok):
    stops = [tok.convert_tokens_to_ids(s) for s in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    return GrammarCompilerService(tok, len(tok), stops)


def _state(svc, **kw):
    return svc.new_state(GrammarSpec("tool_call", json.dumps(tool_call_tag(TOOLS, **kw)), "tool_choice"))


def _allowed(state) -> list[int]:
    mask = state.next_mask()
    out = []
    for w, word in enumerate(mask.tolist()):
        word &= 0xFFFFFFFF
        out += [32 * w + b for b in range(32) if word >> b & 1]
    return out


def _sp(tok, s):
    return tok.convert_tokens_to_ids(s)


def _text(tok, s):
    return tok.encode(s, add_special_tokens=False, split_special_tokens=True)  # tags spelled out


def _feed(state, ids) -> bool:
    for t in ids:
        _allowed(state)
        if not state.accept(t):
            return False
    return True


def _call_ids(tok, name, pairs):
    ids = [_sp(tok, "<tool_call>")] + _text(tok, name)
    for k, v in pairs:
        ids += [_sp(tok, "<arg_key>")] + _text(tok, k) + [_sp(tok, "</arg_key>"), _sp(tok, "<arg_value>")]
        ids += _text(tok, v) + [_sp(tok, "</arg_value>")]
    return ids + [_sp(tok, "</tool_call>")]


def test_special_ids_demanded_and_a_valid_call_ends_on_a_stop_token(tok, svc):
    st = _state(svc)
    assert _allowed(st) == [_sp(tok, "<tool_call>")]  # no text, no spelled-out tag
    assert not st.accept(_text(tok, "<tool_call>")[0])
    assert _feed(st, _call_ids(tok, "get_weather", [("city", "Rome"), ("days", "3")]))
    assert set(_allowed(st)) == {_sp(tok, s) for s in ("<|endoftext|>", "<|user|>", "<|observation|>")}
    assert st.accept(_sp(tok, "<|observation|>")) and st.matcher.is_terminated()


def test_string_bounds_hold_and_cannot_swallow_the_end_tag(tok, svc):
    st = _state(svc, name="get_weather")
    head = _call_ids(tok, "get_weather", [])[:-1] + [_sp(tok, "<arg_key>")] + _text(tok, "city") \
        + [_sp(tok, "</arg_key>"), _sp(tok, "<arg_value>")]
    assert _feed(st, head)
    assert _sp(tok, "</arg_value>") not in _allowed(st)  # minLength 2
    assert _feed(st, _text(tok, "R"))
    assert _sp(tok, "</arg_value>") not in _allowed(st)
    assert _feed(st, _text(tok, "ome"))
    # maxLength 4 reached: only the end tag, never more text, another tag or a spelled-out tag
    assert _allowed(st) == [_sp(tok, "</arg_value>")]
    st2 = _state(svc, name="get_weather")
    assert _feed(st2, head + _text(tok, "ab"))
    assert not _feed(st2, _text(tok, "</arg_value>"))  # '<' cannot start inside a bounded string


def test_named_tool_forces_its_function_and_one_call(tok, svc):
    st = _state(svc, name="ping", parallel=True)
    assert not _feed(st, _call_ids(tok, "note", [])[:3])
    st = _state(svc, name="ping", parallel=True)
    assert _feed(st, _call_ids(tok, "ping", []))
    assert _sp(tok, "<tool_call>") not in _allowed(st)


def test_required_single_vs_parallel(tok, svc):
    one, many = _state(svc), _state(svc, parallel=True)
    call = _call_ids(tok, "ping", [])
    assert _feed(one, call) and _feed(many, call)
    assert _sp(tok, "<tool_call>") not in _allowed(one)
    assert _sp(tok, "<tool_call>") in _allowed(many)
    assert _feed(many, call)


def test_reasoning_is_free_text_without_tags_then_the_think_end_token(tok, svc):
    st = _state(svc, name="ping", reasoning=True)
    assert _feed(st, _text(tok, "let me think < about it"))
    allowed = set(_allowed(st))
    assert _sp(tok, "</think>") in allowed and _sp(tok, "<tool_call>") not in allowed
    assert not _state(svc, name="ping", reasoning=True).accept(_sp(tok, "<tool_call>"))
    assert _feed(st, [_sp(tok, "</think>")] + _call_ids(tok, "ping", []))


def test_tags_stay_out_of_json_strings_and_nested_bounds_hold(tok, svc):
    st = _state(svc, name="note")
    head = _call_ids(tok, "note", [])[:-1] + [_sp(tok, "<arg_key>")] + _text(tok, "meta") \
        + [_sp(tok, "</arg_key>"), _sp(tok, "<arg_value>")] + _text(tok, '{"k": "ab')
    assert _feed(st, head)
    allowed = set(_allowed(st))
    assert not allowed & {_sp(tok, t) for t in ("</arg_value>", "</tool_call>", "<arg_key>")}
    assert _feed(st, _text(tok, "c"))
    assert not _feed(st, _text(tok, "d"))  # nested maxLength 3


def test_schema_errors_name_the_field():
    with pytest.raises(ToolGrammarError, match="not in tools") as e:
        tool_call_tag(TOOLS, name="nope")
    assert e.value.field == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 5, "maxLength": 2}}}}}
    with pytest.raises(ToolGrammarError, match="minLength 5 is greater than maxLength 2"):
        tool_call_tag([bad])


@pytest.mark.parametrize("kw", [{}, {"parallel": True}, {"name": "get_weather"}, {"name": "note"}])
def test_random_walks_parse_into_valid_calls(tok, svc, kw):
    """Random tokens among the allowed ones until a stop token: always the wanted number of
    calls, each validating against its tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    stops = {_sp(tok, s) for s in ("<|endoftext|>", "<|user|>", "<|observation|>")}
    tag_ids = {_sp(tok, s) for s in ("</arg_value>", "</tool_call>", "<tool_call>")}
    for seed in range(8):
        rng, st, out = random.Random(seed), _state(svc, **kw), []
        for _ in range(400):
            allowed = _allowed(st)
            assert allowed, "dead end"
            # favour ends a little so walks finish (ends are 1 token among thousands)
            ends = [t for t in allowed if t in stops or t in tag_ids]
            t = rng.choice(ends) if ends and rng.random() < 0.3 else rng.choice(allowed)
            assert st.accept(t)
            if t in stops:
                break
            out.append(t)
        else:
            pytest.fail("walk did not end")
        text = tok.decode(out, skip_special_tokens=False)
        content, calls = ToolCallParser(TOOLS).parse(text)
        assert content == "" and calls, text
        assert len(calls) == 1 or kw.get("parallel"), text
        for c in calls:
            assert kw.get("name") in (None, c.name)
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_bounded_strings_refuse_surrogate_bytes(tok, svc):
    """xgrammar's negated classes accept ED A0 80 (a UTF-16 surrogate, decoded as 3 x U+FFFD):
    the bounded-string classes skip the surrogate block, top level and nested."""
    byte = {}
    for i in range(len(tok)):
        b = svc.tool_tokenizer_info.decoded_vocab[i]
        if len(b) == 1:
            byte.setdefault(b[0], i)
    surrogate = [byte[b] for b in b"\xed\xa0\x80"]
    emoji = [byte[b] for b in "\U0001f600".encode()]
    top = _call_ids(tok, "get_weather", [])[:-1] + [_sp(tok, "<arg_key>")] + _text(tok, "city") \
        + [_sp(tok, "</arg_key>"), _sp(tok, "<arg_value>")]
    nested = _call_ids(tok, "note", [])[:-1] + [_sp(tok, "<arg_key>")] + _text(tok, "meta") \
        + [_sp(tok, "</arg_key>"), _sp(tok, "<arg_value>")] + _text(tok, '{"k": "')
    for name, head in (("get_weather", top), ("note", nested)):
        assert _feed(_state(svc, name=name), head + emoji)
        assert not _feed(_state(svc, name=name), head + surrogate)
