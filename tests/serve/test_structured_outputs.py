"""Structured outputs end to end: the random tiny model behind the HTTP API with --structured-outputs.

Every guided output must be valid: JSON schemas (validated with jsonschema), regexes (full
match), EBNF grammars (re-checked by a fresh xgrammar matcher), choices; streamed and not;
through /v1/chat/completions, /v1/completions, /generate and /v1/responses. All requests of a
test go in flight together (one shared server, batched decode). The grammars are bounded
(maxLength, maxItems, bounded numbers) so a random model always finishes them within max_tokens.
Reasoning on: a scripted engine (its runner honours the masks) emits reasoning, `</think>` and
an answer, so the grammar must apply after `</think>` only. Bad grammars, several constraints
and a server without the flag are 400s naming the field.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serve_support import start_server, stop_server  # noqa: E402

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": -5, "maximum": 500}
SCHEMAS = [
    {"type": "object", "properties": {"a": I}, "required": ["a"]},
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"]}},
     "required": ["p"]},
    {"type": "object", "properties": {"v": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["v"]},
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"k": {"const": "fixed"}, "n": {"type": "null"}}, "required": ["k", "n"]},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": I}, "required": ["x"]}},
     "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2},
                                            "maxItems": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"s": {"type": "string", "enum": ["x y", "z\"q", "\u00e9t\u00e9"]}},
     "required": ["s"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"o": {"anyOf": [I, {"type": "boolean"}]}}, "required": ["o"]},
    {"type": "object", "properties": {"lvl": {"type": "integer", "minimum": 1, "maximum": 3},
                                      "sub": {"type": "object", "properties": {"q": S}, "required": ["q"]}},
     "required": ["lvl", "sub"]},
    {"type": "string", "maxLength": 8},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"enum": [1, "two", None, True]},
    {"type": "object", "properties": {"arr": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2,
                                              "maxItems": 2}}, "required": ["arr"]},
    {"type": "object", "$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "boolean"}},
                                          "required": ["v"]}},
     "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2},
                    "when": {"type": "string", "maxLength": 4}}, "required": ["list", "when"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -2.5, "maximum": 2.5},
                                      "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 9}},
     "required": ["x", "y"]},
]
REGEXES = [r"[a-z]{3,8}", r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}",
           r"0x[0-9a-f]{4}", r"(ab|cd){2,4}", r"[01]{8}", r"\w{2,5}@\w{2,5}\.com", r"-?[1-9][0-9]{0,2}",
           r"(red|green|blue)-[0-9]"]
EBNFS = [
    ('root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "-" | "*"', r"\(\d+ [+*-] \d+\)"),
    ('root ::= "SELECT " col " FROM " tbl\ncol ::= "a" | "b" | "c"\ntbl ::= "t1" | "t2"', r"SELECT [abc] FROM t[12]"),
    ('root ::= item (", " item)?\nitem ::= "cat" | "dog" | "bird"', r"(cat|dog|bird)(, (cat|dog|bird))?"),
    ('root ::= "<" tag ">" [a-z] [a-z]? "</" tag ">"\ntag ::= "b" | "i"', r"<[bi]>[a-z]{1,2}</[bi]>"),
    ('root ::= key "=" val\nkey ::= [a-z] [a-z]?\nval ::= [0-9] [0-9]? [0-9]?', r"[a-z]{1,2}=[0-9]{1,3}"),
]
CHOICES = [["alpha", "beta", "gamma"], ["yes", "no"], ["North America", "South America", "Europe"]]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def so_server():
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=64, structured_outputs=True,
                                   prefix_cache_config=PrefixCacheConfig())
    server = start_server(engine, hf_tokenizer_factory(engine.model_info.model_path),
                          ServeSettings(served_model_name="trnrt-tiny"), threads=72)
    yield server
    stop_server(server)






def _sse_text(server, path, body, pick):
    """Concatenated text of an SSE response (pick(chunk) -> text piece)."""
    return "".join(pick(e) or "" for e in server.sse_events(path, body))


def _run_all(jobs):
    with ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(lambda j: j(), jobs))


def _check_json(text, schema, where):
    try:
        value = json.loads(text)
    except ValueError:
        raise AssertionError(f"{where}: not JSON: {text!r}")
    jsonschema.validate(value, schema)


def test_every_guided_output_is_valid(so_server):
    srv = so_server
    jobs, checks = [], []
    chat = "/v1/chat/completions"
    no_think = {"enable_thinking": False}

    def add(job, check):
        jobs.append(job)
        checks.append(check)

    for i, schema in enumerate(SCHEMAS):
        msgs = [{"role": "user", "content": f"give json {i}"}]
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        stream = i % 2 == 1
        seed_kw = {"temperature": 1.0, "seed": i} if i % 3 == 0 else {"temperature": 0}
        body = {"messages": msgs, "response_format": rf, "max_tokens": MAX_TOKENS, "chat_template_kwargs": no_think,
                **seed_kw}
        if stream:
            add(lambda b=body: _sse_text(srv, chat, {**b, "stream": True},
                                         lambda c: (c["choices"][0]["delta"].get("content") if c["choices"] else "")),
                lambda t, s=schema, i=i: _check_json(t, s, f"chat stream schema {i}"))
        else:
            add(lambda b=body: srv.post(chat, b)[1]["choices"][0]["message"]["content"],
                lambda t, s=schema, i=i: _check_json(t, s, f"chat schema {i}"))
        # the same schema through the other routes and spellings
        route = i % 4
        if route == 0:
            add(lambda s=schema, i=i: srv.post("/v1/completions", {"prompt": f"json {i}:", "max_tokens": MAX_TOKENS,
                                                                   "temperature": 0, "guided_json": s})[1]
                ["choices"][0]["text"], lambda t, s=schema, i=i: _check_json(t, s, f"completions guided_json {i}"))
        elif route == 1:
            add(lambda s=schema, i=i: srv.post("/generate", {"text": f"json {i}:", "sampling_params": {
                "json_schema": json.dumps(s), "max_new_tokens": MAX_TOKENS, "temperature": 0}})[1]["text"],
                lambda t, s=schema, i=i: _check_json(t, s, f"generate json_schema {i}"))
        elif route == 2:
            add(lambda s=schema, i=i: srv.post("/v1/responses", {"input": f"json {i}", "max_output_tokens": MAX_TOKENS,
                                                                 "temperature": 0, "reasoning": {"effort": "none"},
                                                                 "text": {"format": {"type": "json_schema",
                                                                                     "name": "x", "schema": s}}})[1]
                ["output"][-1]["content"][0]["text"], lambda t, s=schema, i=i: _check_json(t, s, f"responses {i}"))
        else:
            add(lambda s=schema, i=i: _sse_text(srv, "/v1/completions", {
                "prompt": f"json {i}:", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "structured_outputs": {"json": s}}, lambda c: c["choices"][0]["text"] if c["choices"] else ""),
                lambda t, s=schema, i=i: _check_json(t, s, f"completions stream structured_outputs.json {i}"))
    for i, rx in enumerate(REGEXES):
        if i % 2:
            add(lambda rx=rx, i=i: srv.post(chat, {"messages": [{"role": "user", "content": f"r{i}"}],
                                                     "guided_regex": rx, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "chat_template_kwargs": no_think})[1]
                ["choices"][0]["message"]["content"], lambda t, rx=rx: _assert_full(rx, t))
        else:
            add(lambda rx=rx, i=i: _sse_text(srv, "/generate", {"text": f"r{i}", "stream": True, "sampling_params": {
                "regex": rx, "max_new_tokens": MAX_TOKENS, "temperature": 0}}, None) if False else
                srv.post("/generate", {"text": f"r{i}", "sampling_params": {
                    "regex": rx, "max_new_tokens": MAX_TOKENS, "temperature": 0}})[1]["text"],
                lambda t, rx=rx: _assert_full(rx, t))
    for i, (g, rx) in enumerate(EBNFS):
        add(lambda g=g, i=i: srv.post("/v1/completions", {"prompt": f"g{i}", "max_tokens": MAX_TOKENS,
                                                            "temperature": 1.0, "seed": i,
                                                            "structured_outputs": {"grammar": g}})[1]
            ["choices"][0]["text"], lambda t, rx=rx: _assert_full(rx, t))
        add(lambda g=g, i=i: srv.post("/generate", {"text": f"g{i}", "sampling_params": {
            "ebnf": g, "max_new_tokens": MAX_TOKENS, "temperature": 0}})[1]["text"],
            lambda t, rx=rx: _assert_full(rx, t))
    for i, ch in enumerate(CHOICES):
        add(lambda ch=ch, i=i: srv.post(chat, {"messages": [{"role": "user", "content": f"c{i}"}],
                                                 "structured_outputs": {"choice": ch}, "max_tokens": MAX_TOKENS,
                                                 "chat_template_kwargs": no_think, "seed": i})[1]
            ["choices"][0]["message"]["content"], lambda t, ch=ch: _assert_in(t, ch))
        add(lambda ch=ch, i=i: srv.post("/v1/completions", {"prompt": f"c{i}", "guided_choice": ch,
                                                              "max_tokens": MAX_TOKENS})[1]["choices"][0]["text"],
            lambda t, ch=ch: _assert_in(t, ch))
    before = dict(srv.engine.runner.num_graph_calls)
    results = _run_all(jobs)
    failures = []
    for text, check in zip(results, checks):
        try:
            check(text)
        except (AssertionError, jsonschema.ValidationError) as e:
            failures.append(str(e)[:300])
    assert not failures, f"{len(failures)} of {len(jobs)} guided outputs invalid:\n" + "\n".join(failures)
    calls = {k: v - before.get(k, 0) for k, v in srv.engine.runner.num_graph_calls.items()}
    assert any("structured_outputs" in k and n for k, n in calls.items()), "no variant graph ran"


def _assert_full(rx, text):
    assert re.fullmatch(rx, text), f"{text!r} does not fully match {rx!r}"


def _assert_in(text, choices):
    assert text in choices, f"{text!r} not one of {choices}"


def _assert_object(text):
    assert isinstance(json.loads(text), dict), text


def test_bad_grammars_are_400s_naming_the_field(so_server):
    srv = so_server
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strng"}}}}, "response_format.json_schema.schema", "Unsupported type"),
        ("/v1/chat/completions", {"messages": msgs, "guided_regex": "[a-"}, "guided_regex", "Unclosed"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= foo"}},
         "structured_outputs.grammar", "not defined"),
        ("/v1/completions", {"prompt": "x", "regex": "a", "guided_regex": "b"}, "regex", "Only one of"),
        ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict", "boolean"),
    ]
    for path, body, field, text in cases:
        status, data = srv.post(path, body)
        assert status == 400, (body, data)
        err = data["error"] if "error" in data else data
        assert err.get("param") == field and text in err["message"], data
        assert ".cc:" not in err["message"] and "/project" not in err["message"]
    status, data = srv.post("/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 4}})
    assert status == 400 and "sampling_params.regex" in json.dumps(data), data
    status, data = srv.post("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema",
                                                                                 "schema": {"type": "strng"}}}})
    assert status == 400 and data["error"]["param"] == "text.format.schema", data
    assert srv.engine.thread.is_alive()


def test_flag_off_is_a_400_naming_the_flag(scripted_server):
    status, data, _ = scripted_server.raw("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})
    assert status == 400 and "--structured-outputs" in data["error"]["message"], data
    assert data["error"]["param"] == "response_format"
    status, data, _ = scripted_server.raw("POST", "/generate", {"text": "x", "sampling_params": {"regex": "a+"}})
    assert status == 400 and "--structured-outputs" in json.dumps(data)


def test_reasoning_on_grammar_applies_after_think(tokenizer_factory):
    """A scripted model reasons freely, emits </think>, then answers: the reasoning is untouched,
    the answer is forced into the schema (the script's answer is not JSON)."""
    from trnrt.engine.core.engine import Engine
    from trnrt.serve import ServeSettings

    tok = tokenizer_factory()
    think_end = tok.convert_tokens_to_ids("</think>")
    script = tok.encode("let me think", add_special_tokens=False) + [think_end] + \
        tok.encode("not json at all", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    engine = Engine.scripted(tok, lambda p: list(script), structured_outputs=True, eos_token_ids=(eos,))
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name="trnrt-tiny"))
    try:
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 60, "stream": stream,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
            if stream:
                parts = {"content": "", "reasoning_content": ""}

                def pick(c):
                    d = c["choices"][0]["delta"] if c["choices"] else {}
                    for k in parts:
                        parts[k] += d.get(k) or ""
                    return ""
                _sse_text(srv, "/v1/chat/completions", body, pick)
                content, reasoning = parts["content"], parts["reasoning_content"]
            else:
                msg = srv.post("/v1/chat/completions", body)[1]["choices"][0]["message"]
                content, reasoning = msg["content"], msg["reasoning_content"]
            assert reasoning.strip() == "let me think"
            _check_json(content, schema, "reasoning-on answer")
    finally:
        stop_server(srv)
