"""Penalties, logit_bias, min_tokens and thinking budgets through the HTTP API.

- the tiny model with --penalties: a huge logit_bias forces its token on chat, completions and
  /generate (greedy); bad values are 400s naming the field in the route's spelling;
- a server without --penalties: a penalty is a 400 naming the field and the flag;
- min_tokens (scripted, exact): a stop string in the first tokens does not end the output, on
  chat, completions and /generate, streamed and not; the same stop later does;
- thinking budgets (scripted, exact): a budget of N gives exactly N reasoning tokens then
  `</think>`, through chat (thinking_token_budget), Messages (thinking.budget_tokens) and
  /generate (max_thinking_tokens).
"""

from __future__ import annotations

import json

import pytest

from serve_support import eos_ids, start_server, stop_server

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"


@pytest.fixture(scope="module")
def pen_server():
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=8, context_length=256, penalties=True)
    server = start_server(engine, hf_tokenizer_factory(engine.model_info.model_path),
                          ServeSettings(served_model_name="trnrt-tiny"))
    yield server
    stop_server(server)






def test_logit_bias_forces_its_token_on_every_route(pen_server):
    target = 1234
    common = {"temperature": 0, "ignore_eos": True, "logit_bias": {str(target): 100}}
    s, d = pen_server.post(COMP, {"prompt": "hello", "max_tokens": 4, "return_token_ids": True, **common})
    assert s == 200 and d["choices"][0]["token_ids"] == [target] * 4, d
    s, d = pen_server.post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                    "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False},
                                    **common})
    assert s == 200 and d["choices"][0]["token_ids"] == [target] * 4, d
    s, d = pen_server.post(GEN, {"text": "hello", "sampling_params": {"max_new_tokens": 4, **common}})
    assert s == 200 and d["output_ids"] == [target] * 4, d
    # without the bias the greedy output is something else (the test means something)
    s, d = pen_server.post(COMP, {"prompt": "hello", "max_tokens": 4, "return_token_ids": True, "temperature": 0,
                                    "ignore_eos": True})
    assert d["choices"][0]["token_ids"] != [target] * 4
    # penalties are accepted (and change nothing about the shape of the answer)
    s, d = pen_server.post(COMP, {"prompt": "hello hello", "max_tokens": 4, "temperature": 0,
                                    "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.5})
    assert s == 200, d


BAD = [
    (COMP, {"prompt": "a", "logit_bias": {"999999": 1}}, "logit_bias"),
    (COMP, {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMP, {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    (COMP, {"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 2.5}, "repetition_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 3}, "frequency_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "presence_penalty": -2.1}, "presence_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    (COMP, {"prompt": "a", "min_tokens": -1}, "min_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "thinking_token_budget": -2}, "thinking_token_budget"),
    (GEN, {"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, "sampling_params.min_new_tokens"),
    (GEN, {"text": "a", "sampling_params": {"logit_bias": {"-1": 1}}}, "sampling_params.logit_bias"),
    (GEN, {"text": "a", "sampling_params": {"repetition_penalty": True}}, "sampling_params.repetition_penalty"),
    (GEN, {"text": "a", "max_thinking_tokens": -1}, "max_thinking_tokens"),
]


@pytest.mark.parametrize("path,body,field", BAD)
def test_bad_values_are_400s_naming_the_field(pen_server, path, body, field):
    s, d = pen_server.post(path, body)
    assert s == 400, d
    assert field in json.dumps(d), d


@pytest.mark.parametrize("path,body,field", [
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 0.5}, "frequency_penalty"),
    (COMP, {"prompt": "a", "logit_bias": {"5": 3}}, "logit_bias"),
    (COMP, {"prompt": "a", "min_tokens": 2}, "min_tokens"),
    (GEN, {"text": "a", "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
])
def test_without_the_flag_a_penalty_is_a_400_naming_the_flag(scripted_server, path, body, field):
    s, d = scripted_server.post(path, body)
    assert s == 400, d
    assert field in json.dumps(d) and "--penalties" in json.dumps(d), d


@pytest.fixture(scope="module")
def scripted_pen(tokenizer_factory):
    """A scripted engine with --penalties: the script says `ab STOP cd STOP ef` then EOS."""
    from trnrt.engine.core.engine import Engine
    from trnrt.serve import ServeSettings

    tok = tokenizer_factory()
    think_end = tok.convert_tokens_to_ids("</think>")
    pieces = ["ab", " STOP", " cd", " STOP", " ef"]
    stop_script = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
    reasoning = tok.encode(" r1 r2 r3 r4 r5 r6 r7 r8", add_special_tokens=False)
    think_script = reasoning + [think_end] + tok.encode(" the answer", add_special_tokens=False)

    def script(prompt_ids):
        return list(think_script if "THINK" in tok.decode(prompt_ids) else stop_script)

    engine = Engine.scripted(tok, script, penalties=True, eos_token_ids=eos_ids(tok), max_model_len=512)
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name="trnrt-tiny"))
    srv.stop_script, srv.reasoning, srv.think_end, srv.tok = stop_script, reasoning, think_end, tok
    yield srv
    stop_server(srv)


def _text(srv, path, body, stream):
    """(text, finish_reason) of one choice, streamed or not."""
    body = dict(body, stream=stream)
    if not stream:
        s, d = srv.post(path, body)
        assert s == 200, d
        if path == GEN:
            return d["text"], d["meta_info"]["finish_reason"]["type"]
        c = d["choices"][0]
        return (c["message"]["content"] if path == CHAT else c["text"]), c["finish_reason"]
    text, finish = "", None
    for c in srv.sse_events(path, body):
        if path == GEN:
            text, finish = c["text"], (c["meta_info"]["finish_reason"] or {}).get("type")
            continue
        if not c.get("choices"):
            continue
        ch = c["choices"][0]
        text += (ch["delta"].get("content") or "") if path == CHAT else ch["text"]
        finish = ch.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_protects_a_stop_string_in_the_first_tokens(scripted_pen, stream):
    srv = scripted_pen
    n_first = len(srv.tok.encode("ab STOP", add_special_tokens=False))  # the first STOP is inside these
    msgs = [{"role": "user", "content": "go"}]
    cases = [(CHAT, {"messages": msgs, "max_tokens": 30, "stop": ["STOP"], "min_tokens": n_first,
                     "chat_template_kwargs": {"enable_thinking": False}}),
             (COMP, {"prompt": "go", "max_tokens": 30, "stop": "STOP", "min_tokens": n_first}),
             (GEN, {"text": "go", "sampling_params": {"max_new_tokens": 30, "stop": "STOP",
                                                      "min_new_tokens": n_first}})]
    for path, body in cases:
        text, finish = _text(srv, path, body, stream)
        assert text.strip() == "ab STOP cd" and finish == "stop", (path, text)
        # without min_tokens the first STOP ends it (the stop is live: the test means something)
        plain = json.loads(json.dumps(body))
        (plain["sampling_params"] if path == GEN else plain).pop("min_new_tokens" if path == GEN else "min_tokens")
        text, finish = _text(srv, path, plain, stream)
        assert text.strip() == "ab" and finish == "stop", (path, text)
    # a stop regex is protected the same way, and EOS cannot end the output before min_tokens
    body = {"text": "go", "sampling_params": {"max_new_tokens": 30, "stop_regex": r"S\w+P", "min_new_tokens": n_first}}
    assert _text(srv, GEN, body, stream)[0].strip() == "ab STOP cd"
    n = len(srv.stop_script) + 3
    s, d = srv.post(COMP, {"prompt": "go", "max_tokens": 40, "min_tokens": n})
    assert d["usage"]["completion_tokens"] == n and d["choices"][0]["finish_reason"] == "stop", d


@pytest.mark.parametrize("budget", [0, 3])
def test_thinking_budget_gives_exactly_n_reasoning_tokens(scripted_pen, budget):
    srv = scripted_pen
    want = srv.reasoning[:budget] + [srv.think_end]
    msgs = [{"role": "user", "content": "THINK please"}]
    s, d = srv.post(CHAT, {"messages": msgs, "max_tokens": 20, "thinking_token_budget": budget,
                             "return_token_ids": True})
    assert s == 200, d
    ids = d["choices"][0]["token_ids"]
    # (the script goes on from its own position afterwards, as a model would after a forced token)
    assert ids[: budget + 1] == want, ids
    assert (d["choices"][0]["message"]["reasoning_content"] or "") == srv.tok.decode(srv.reasoning[:budget])
    # without a budget the script reasons 8 tokens
    s, d = srv.post(CHAT, {"messages": msgs, "max_tokens": 20, "return_token_ids": True})
    assert d["choices"][0]["token_ids"].index(srv.think_end) == len(srv.reasoning)
    # Messages: thinking.budget_tokens (>= 1 there)
    if budget:
        s, d = srv.post("/v1/messages", {"model": "trnrt-tiny", "max_tokens": 20, "messages": msgs,
                                           "thinking": {"type": "enabled", "budget_tokens": budget}})
        assert s == 200, d
        thinking = [b for b in d["content"] if b["type"] == "thinking"]
        assert thinking and thinking[0]["thinking"] == srv.tok.decode(srv.reasoning[:budget]), d
    # /generate: max_thinking_tokens on a prompt that opens a think block
    prompt = srv.tok.encode("THINK", add_special_tokens=False) + [srv.tok.convert_tokens_to_ids("<think>")]
    s, d = srv.post(GEN, {"input_ids": prompt, "max_thinking_tokens": budget, "sampling_params": {
        "max_new_tokens": 20, "skip_special_tokens": False}})
    assert s == 200 and d["output_ids"][: budget + 1] == want, d
