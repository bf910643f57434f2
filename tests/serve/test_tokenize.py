"""POST /tokenize and /detokenize (and their /v1/ aliases): SGLang's and vLLM's fields.

The messages form must give exactly the prompt ids /v1/chat/completions submits for the same
body (the scripted engine records them); bad inputs are 4xx naming the field, never a 500.
"""

from __future__ import annotations

import json

import pytest

MODEL = "trnrt-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
SPECIAL_TEXT = "[gMASK]<sop>Hello <|user|> world 北京<|endoftext|>"


def post(server, path: str, body):
    status, data, _ = server.raw("POST", path, body)
    return status, data


def ok(server, path: str, body) -> dict:
    status, data = post(server, path, body)
    assert status == 200, data
    return data


def tokenizer_of(server):
    from trnrt.serve import get_state

    return get_state(server.app).tokinfo().tokenizer


def submitted_prompt(server) -> list[int]:
    """The prompt ids of the last request the engine received (Engine.scripted records them)."""
    submitted = getattr(server.engine, "submitted", None)
    if not submitted:
        pytest.fail("the scripted engine no longer records submitted requests (see serve_support.py)")
    return list(submitted[-1].prompt_token_ids)


# --- the messages form is the chat route's prompt -------------------------------------------------
CHAT_BODIES = {
    "tools-effort-kwargs": {"messages": MSGS, "tools": TOOLS, "reasoning_effort": "low",
                            "chat_template_kwargs": {"clear_thinking": False}},
    "thinking-off": {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}},
    "tool-choice-none": {"messages": MSGS, "tools": TOOLS, "tool_choice": "none"},
    "history": {"messages": [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": TOOLS},
}


@pytest.mark.parametrize("name", list(CHAT_BODIES))
def test_tokenize_messages_is_the_chat_prompt(scripted_server, name):
    body = CHAT_BODIES[name]
    chat = ok(scripted_server, "/v1/chat/completions", {"model": MODEL, **body, "max_tokens": 2})
    engine_ids = submitted_prompt(scripted_server)
    for path in ("/tokenize", "/v1/tokenize"):
        got = ok(scripted_server, path, {"model": MODEL, **body})
        assert got["tokens"] == engine_ids
        assert got["count"] == chat["usage"]["prompt_tokens"] == len(engine_ids)
        assert got["max_model_len"] == 1024 and got["token_strs"] is None


def test_tokenize_messages_renders_tools_and_effort(scripted_server):
    """The fields above reach the template (else the equality test would hold vacuously)."""
    tok = tokenizer_of(scripted_server)
    plain = ok(scripted_server, "/tokenize", {"messages": MSGS})["tokens"]
    full = ok(scripted_server, "/tokenize", CHAT_BODIES["tools-effort-kwargs"])["tokens"]
    text = tok.decode(full, skip_special_tokens=False)
    assert "get_weather" in text and "get_weather" not in tok.decode(plain, skip_special_tokens=False)
    assert "low" in text.lower()
    off = ok(scripted_server, "/tokenize", CHAT_BODIES["thinking-off"])["tokens"]
    assert off != plain


def test_tokenize_messages_count_matches_usage_on_every_engine(any_server):
    body = {"messages": MSGS, "tools": TOOLS, "reasoning_effort": "high"}
    chat = ok(any_server, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert ok(any_server, "/tokenize", body)["count"] == chat["usage"]["prompt_tokens"]


def test_tokenize_add_generation_prompt(scripted_server):
    tok = tokenizer_of(scripted_server)
    with_gen = ok(scripted_server, "/tokenize", {"messages": MSGS})["tokens"]
    without = ok(scripted_server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False})["tokens"]
    assert with_gen[:len(without)] == without and len(with_gen) > len(without)
    assert tok.decode(with_gen[len(without):], skip_special_tokens=False).startswith("<|assistant|>")
    # null means the default, as in SGLang's model.
    assert ok(scripted_server, "/tokenize", {"messages": MSGS, "add_generation_prompt": None})["tokens"] == with_gen


def test_server_default_template_kwargs_apply(scripted_server):
    """--default-chat-template-kwargs reach /tokenize as they reach the chat route."""
    import falcon.testing

    from trnrt.serve import ServeSettings, create_app

    app = create_app(scripted_server.engine, lambda: tokenizer_of(scripted_server),
                     ServeSettings(served_model_name=MODEL, default_chat_template_kwargs={"enable_thinking": False}))
    client = falcon.testing.TestClient(app, headers={"Host": "127.0.0.1"})
    got = client.simulate_post("/tokenize", json={"messages": MSGS}).json["tokens"]
    assert got == ok(scripted_server, "/tokenize", CHAT_BODIES["thinking-off"])["tokens"]


# --- the prompt form, detokenize, round trips --------------------------------------------------------
def test_tokenize_prompt(any_server):
    tok = tokenizer_of(any_server)
    got = ok(any_server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert got["tokens"] == tok.encode("Hello world", add_special_tokens=True)
    assert got["count"] == len(got["tokens"]) > 0
    assert got["max_model_len"] == 1024 and got["token_strs"] is None
    assert ok(any_server, "/tokenize", {"prompt": ""})["tokens"] == tok.encode("", add_special_tokens=True)


def test_tokenize_max_model_len_is_the_context_length(scripted_server):
    import falcon.testing

    from trnrt.serve import ServeSettings, create_app

    app = create_app(scripted_server.engine, lambda: tokenizer_of(scripted_server),
                     ServeSettings(served_model_name=MODEL, context_length=300))
    client = falcon.testing.TestClient(app, headers={"Host": "127.0.0.1"})
    assert client.simulate_post("/v1/tokenize", json={"prompt": "hi"}).json["max_model_len"] == 300


@pytest.mark.parametrize("skip", [False, True])
def test_round_trip(any_server, skip):
    tok = tokenizer_of(any_server)
    ids = ok(any_server, "/tokenize", {"prompt": SPECIAL_TEXT, "add_special_tokens": False})["tokens"]
    specials = ("[gMASK]", "<sop>", "<|user|>", "<|endoftext|>")
    assert all(tok.convert_tokens_to_ids(s) in ids for s in specials)  # they are single special tokens
    got = ok(any_server, "/detokenize", {"tokens": ids, "skip_special_tokens": skip})
    want = SPECIAL_TEXT
    if skip:
        for s in specials:
            want = want.replace(s, "")
    assert got == {"text": want, "prompt": want}
    if not skip:  # skip_special_tokens defaults to true
        assert ok(any_server, "/v1/detokenize", {"tokens": ids})["text"] == ok(
            any_server, "/detokenize", {"tokens": ids, "skip_special_tokens": True})["text"]


def test_batches(any_server):
    texts = ["Hello world", "北京 天气", "<|user|>x"]
    got = ok(any_server, "/v1/tokenize", {"prompt": texts, "add_special_tokens": False, "return_token_strs": True})
    assert [len(t) for t in got["tokens"]] == got["count"] and len(got["count"]) == 3
    assert [len(s) for s in got["token_strs"]] == got["count"]
    singles = [ok(any_server, "/tokenize", {"prompt": t, "add_special_tokens": False})["tokens"] for t in texts]
    assert got["tokens"] == singles
    back = ok(any_server, "/v1/detokenize", {"tokens": got["tokens"], "skip_special_tokens": False})
    assert back == {"text": texts, "prompt": texts}
    # a batch of one is still a batch
    one = ok(any_server, "/tokenize", {"prompt": ["hi"]})
    assert isinstance(one["count"], list) and one["token_strs"] is None
    assert ok(any_server, "/detokenize", {"tokens": [one["tokens"][0]]})["text"] == ["hi"]


def test_empty_token_lists(any_server):
    assert ok(any_server, "/detokenize", {"tokens": []}) == {"text": "", "prompt": ""}
    assert ok(any_server, "/detokenize", {"tokens": [[], []]}) == {"text": ["", ""], "prompt": ["", ""]}


def test_return_token_strs(any_server):
    tok = tokenizer_of(any_server)
    got = ok(any_server, "/tokenize", {"prompt": "Hello <|user|>", "return_token_strs": True})
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert "<|user|>" in got["token_strs"] and len(got["token_strs"]) == got["count"]
    chat = ok(any_server, "/tokenize", {"messages": MSGS, "return_token_strs": True})
    assert chat["token_strs"] == tok.convert_ids_to_tokens(chat["tokens"])
    assert ok(any_server, "/tokenize", {"prompt": "x", "return_token_strs": False})["token_strs"] is None


def test_add_special_tokens_defaults():
    """Prompt form: true; messages form: false (the template holds the specials); both settable.
    Checked on the parsed request: the test tokenizer adds nothing either way."""
    from trnrt.serve.protocol.tokenize import parse_tokenize

    assert parse_tokenize({"prompt": "x"}).add_special_tokens is True
    assert parse_tokenize({"prompt": "x", "add_special_tokens": False}).add_special_tokens is False
    assert parse_tokenize({"messages": MSGS}).add_special_tokens is False
    assert parse_tokenize({"messages": MSGS, "add_special_tokens": True}).add_special_tokens is True


def test_add_special_tokens_reaches_the_tokenizer():
    from trnrt.serve.handlers.tokenize import tokenize_ids
    from trnrt.serve.protocol.tokenize import parse_tokenize

    class Tok:  # adds a BOS (id 1) when asked, like Llama-style tokenizers
        def encode(self, text, add_special_tokens):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    class St:
        class settings:
            default_chat_template_kwargs: dict = {}

    assert tokenize_ids(St, Tok(), parse_tokenize({"prompt": ["ab"]})) == [[1, 97, 98]]
    assert tokenize_ids(St, Tok(), parse_tokenize({"prompt": "ab", "add_special_tokens": False})) == [[97, 98]]


def test_api_key_and_shutdown(scripted_server):
    import falcon.testing

    from trnrt.serve import ServeSettings, create_app, get_state

    app = create_app(scripted_server.engine, lambda: tokenizer_of(scripted_server),
                     ServeSettings(served_model_name=MODEL, api_key="sk-tok"))
    client = falcon.testing.TestClient(app, headers={"Host": "127.0.0.1"})
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [5]})):
        assert client.simulate_post(path, json=body).status_code == 401
        assert client.simulate_post(path, json=body, headers={"Authorization": "Bearer sk-tok"}).status_code == 200
    get_state(app).shutting_down.set()
    r = client.simulate_post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-tok"})
    assert r.status_code == 503 and r.json["error"]["type"] == "service_unavailable"


# --- bad inputs ----------------------------------------------------------------------------------
TOK, DETOK = "/tokenize", "/detokenize"
BIG = 10**9

# (id, path, body (dict, or raw JSON text), status, the field that must be named)
BAD = [
    # /tokenize: the two forms
    ("neither-prompt-nor-messages", TOK, {"model": MODEL}, 400, "prompt"),
    ("both-prompt-and-messages", TOK, {"prompt": "hi", "messages": MSGS}, 400, "messages"),
    ("prompt-int", TOK, {"prompt": 12345}, 400, "prompt"),
    ("prompt-object", TOK, {"prompt": {"a": 1}}, 400, "prompt"),
    ("prompt-empty-list", TOK, {"prompt": []}, 400, "prompt"),
    ("prompt-token-ids", TOK, {"prompt": [1, 2, 3]}, 400, "prompt"),
    ("prompt-mixed-list", TOK, {"prompt": ["a", 1]}, 400, "prompt"),
    ("prompt-nested-list", TOK, {"prompt": [["a"]]}, 400, "prompt"),
    ("prompt-too-many", TOK, {"prompt": ["a"] * 1025}, 400, "prompt"),
    ("prompt-lone-surrogate", TOK, '{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("prompt-list-lone-surrogate", TOK, '{"prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    ("add-special-tokens-string", TOK, {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("add-special-tokens-int", TOK, {"prompt": "hi", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("return-token-strs-string", TOK, {"prompt": "hi", "return_token_strs": "true"}, 400, "return_token_strs"),
    ("model-int", TOK, {"prompt": "hi", "model": 5}, 400, "model"),
    ("model-wrong", TOK, {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("model-lone-surrogate", TOK, '{"prompt": "hi", "model": "\\ud800"}', 400, "model"),
    # /tokenize: the messages form
    ("messages-string", TOK, {"messages": "hi"}, 400, "messages"),
    ("messages-empty", TOK, {"messages": []}, 400, "messages"),
    ("message-not-object", TOK, {"messages": ["hi"]}, 400, "messages"),
    ("message-bad-role", TOK, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("message-content-int", TOK, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("message-lone-surrogate", TOK, '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content"),
    ("tool-description-lone-surrogate", TOK, json.dumps({"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "description": "SURROGATE"}}]}).replace("SURROGATE", "\\udc80"), 400, "tools"),
    ("tools-not-list", TOK, {"messages": MSGS, "tools": {"a": 1}}, 400, "tools"),
    ("tool-choice-unknown-name", TOK, {"messages": MSGS, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice.function.name"),
    ("template-kwargs-list", TOK, {"messages": MSGS, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    ("template-kwargs-reserved", TOK, {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
    ("reasoning-effort-unknown", TOK, {"messages": MSGS, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("add-generation-prompt-string", TOK, {"messages": MSGS, "add_generation_prompt": "no"}, 400,
     "add_generation_prompt"),
    ("continue-final-message-true", TOK, {"messages": MSGS, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("continue-final-message-with-prompt", TOK, {"prompt": "hi", "continue_final_message": True}, 400,
     "continue_final_message"),
    ("chat-template-custom", TOK, {"messages": MSGS, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    # /detokenize
    ("tokens-missing", DETOK, {"model": MODEL}, 400, "tokens"),
    ("tokens-string", DETOK, {"tokens": "1 2 3"}, 400, "tokens"),
    ("tokens-int", DETOK, {"tokens": 5}, 400, "tokens"),
    ("tokens-strings", DETOK, {"tokens": ["a", "b"]}, 400, "tokens"),
    ("tokens-negative", DETOK, {"tokens": [1, -1, 2]}, 400, "tokens"),
    ("tokens-out-of-vocab", DETOK, {"tokens": [1, BIG]}, 400, "tokens"),
    ("tokens-at-vocab-size", DETOK, "VOCAB", 400, "tokens"),
    ("tokens-bool", DETOK, {"tokens": [True, False]}, 400, "tokens"),
    ("tokens-float", DETOK, {"tokens": [1.5]}, 400, "tokens"),
    ("tokens-integral-float", DETOK, {"tokens": [2.0]}, 400, "tokens"),
    ("tokens-null-item", DETOK, {"tokens": [1, None]}, 400, "tokens"),
    ("tokens-mixed-depth", DETOK, {"tokens": [[1], 2]}, 400, "tokens"),
    ("tokens-nested-too-deep", DETOK, {"tokens": [[[1, 2]]]}, 400, "tokens"),
    ("tokens-batch-out-of-vocab", DETOK, {"tokens": [[1], [2, BIG]]}, 400, "tokens"),
    ("tokens-too-many", DETOK, {"tokens": [[1]] * 1025}, 400, "tokens"),
    ("skip-special-tokens-string", DETOK, {"tokens": [1], "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("detok-model-wrong", DETOK, {"tokens": [1], "model": "other"}, 404, "model"),
    # both: bodies that are not objects
    ("tokenize-array-body", TOK, "[1, 2]", 400, None),
    ("detokenize-string-body", DETOK, '"hello"', 400, None),
    ("tokenize-malformed-json", TOK, '{"prompt": ', 400, None),
    ("detokenize-empty-body", DETOK, "", 400, None),
]


def test_bad_corpus_is_large_enough():
    assert len(BAD) >= 25 and len({c[0] for c in BAD}) == len(BAD)


def _serves_normally(server) -> None:
    ids = ok(server, "/tokenize", {"prompt": "still fine"})["tokens"]
    assert ok(server, "/detokenize", {"tokens": ids})["text"] == "still fine"


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(any_server, case):
    _, path, body, status, param = case
    if body == "VOCAB":
        from trnrt.serve import get_state

        body = {"tokens": [get_state(any_server.app).engine.model_info.vocab_size]}
    got, data = post(any_server, path, body)
    assert got == status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0].split("[")[0] in err["message"] or status == 404, err
    _serves_normally(any_server)


def test_oversize_body(scripted_server):
    from trnrt.serve import get_state

    limit = get_state(scripted_server.app).settings.max_request_bytes
    got, data = post(scripted_server, "/tokenize", {"prompt": "x" * (limit + 10)})
    assert got == 413, data
    # just past the limit ("1, " per id): a far larger body would still be in flight when the 413 closes
    got, data = post(scripted_server, "/detokenize", {"tokens": [1] * (limit // 3 + 16)})
    assert got == 413, data
    _serves_normally(scripted_server)


def test_tokenizer_routes_have_a_tighter_body_limit(scripted_server):
    """Bodies past MAX_BODY_BYTES get 413 even under the default 16 MiB server limit; just under is served."""
    import falcon.testing

    from trnrt.serve import ServeSettings, create_app
    from trnrt.serve.protocol.tokenize import MAX_BODY_BYTES

    app = create_app(scripted_server.engine, lambda: tokenizer_of(scripted_server),
                     ServeSettings(served_model_name=MODEL))
    client = falcon.testing.TestClient(app, headers={"Host": "127.0.0.1"})
    assert MAX_BODY_BYTES < ServeSettings().max_request_bytes
    r = client.simulate_post("/tokenize", json={"prompt": "x" * MAX_BODY_BYTES})
    assert r.status_code == 413 and r.json["error"]["type"] == "invalid_request_error"
    r = client.simulate_post("/v1/detokenize", json={"tokens": [1] * (MAX_BODY_BYTES // 3 + 16)})
    assert r.status_code == 413
    r = client.simulate_post("/tokenize", json={"prompt": "x " * (MAX_BODY_BYTES // 2 - 64)})
    assert r.status_code == 200 and r.json["count"] > 1024  # past the context: still counted (as vLLM does)


def test_content_type_must_be_json(scripted_server):
    for path, body in ((TOK, {"prompt": "hi"}), (DETOK, {"tokens": [1]})):
        status, data, _ = scripted_server.raw("POST", path, body, headers={"Content-Type": "text/plain"})
        assert status == 415 and data["error"]["param"] == "Content-Type", data


ODD_VALUES = [None, 0, 1, -1, 2.5, "", "x", [], [1], ["a"], [[1]], {}, {"a": 1}, True, False]


@pytest.mark.parametrize("path", [TOK, DETOK])
def test_no_field_value_yields_a_500(scripted_server, path):
    """Every known field with every odd JSON type: 200 or a 4xx in the OpenAI envelope."""
    from trnrt.serve.protocol.tokenize import DETOKENIZE_FIELDS, TOKENIZE_FIELDS

    fields = sorted(TOKENIZE_FIELDS if path == TOK else DETOKENIZE_FIELDS)
    bases = [{"prompt": "hi"}, {"messages": MSGS}] if path == TOK else [{"tokens": [1, 2]}]
    seen = set()
    for base in bases:
        for name in fields:
            for value in ODD_VALUES:
                status, data = post(scripted_server, path, {**base, name: value})
                assert status < 500, (name, value, data)
                if status != 200:
                    assert set(data["error"]) == {"message", "type", "param", "code"}, (name, value, data)
                seen.add(status)
    assert 200 in seen and 400 in seen
