"""Prompt logprobs through the HTTP API (`trnrt serve --prompt-logprobs`), exact values.

The scripted engine reports deterministic fake prompt logprobs (ScriptedRunner): the prompt token
at position p >= 1 has logprob `ScriptedRunner.prompt_logprob(p - 1)`, rank 1, and its top-N
alternatives are (token, lp), (token + 1, lp - 0.5), (token + 2, lp - 1.0), ...; position 0 has
none. Checked on every route that serves them:
- /v1/completions `echo` + `logprobs` (the legacy object covers the prompt first; streamed: on the
  first chunk; `max_tokens: 0` scores the prompt only), also through the official `openai` client;
- vLLM's `prompt_logprobs` on /v1/completions (per choice) and /v1/chat/completions (top level);
- /generate `logprob_start_len` (`input_token_logprobs` / `input_top_logprobs`, cumulative and
  incremental streams, batches, n > 1);
- the 400s (flag off: each route's own field; bad values), after which the server still serves.
"""

from __future__ import annotations

import json

import pytest

from serve_support import eos_ids, make_script, record_engine_kwargs, start_server, stop_server

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MODEL = "trnrt-tiny"
PROMPT = "Hello world, how are you"
MSGS = [{"role": "user", "content": "hi there"}]


def _server(tokenizer_factory, **settings):
    from trnrt.engine.core.engine import Engine
    from trnrt.serve import ServeSettings

    tok = tokenizer_factory()
    engine = Engine.scripted(tok, make_script(tok), eos_token_ids=eos_ids(tok), max_model_len=512,
                             prompt_logprobs=True)
    return start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, **settings))


@pytest.fixture(scope="module")
def plp_server(tokenizer_factory):
    srv = _server(tokenizer_factory)
    yield srv
    stop_server(srv)


# --- expected values ------------------------------------------------------------------------------
def lp_at(p: int) -> float:
    """The scripted logprob of the prompt token at position p (p >= 1)."""
    from trnrt.engine.runner.scripted_runner import ScriptedRunner

    return ScriptedRunner.prompt_logprob(p - 1)


def top_at(ids: list[int], p: int, n: int, vocab: int) -> list[tuple[int, float]]:
    return [((ids[p] + k) % vocab, lp_at(p) - 0.5 * k) for k in range(n)]


def piece(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def prompt_ids(tok, text: str = PROMPT) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def legacy_prompt_part(tok, ids: list[int], n: int) -> dict:
    """The prompt's part of echo's legacy logprobs object."""
    vocab = len(tok)
    tokens = [piece(tok, t) for t in ids]
    offsets, off = [], 0
    for t in tokens:
        offsets.append(off)
        off += len(t)
    return {"tokens": tokens, "text_offset": offsets,
            "token_logprobs": [None] + [lp_at(p) for p in range(1, len(ids))],
            "top_logprobs": [None] + [{piece(tok, t): v for t, v in top_at(ids, p, n, vocab)}
                                      for p in range(1, len(ids))]}


def vllm_expected(tok, ids: list[int], n: int) -> list:
    vocab = len(tok)
    out: list = [None]
    for p in range(1, len(ids)):
        d = {str(ids[p]): {"logprob": lp_at(p), "rank": 1, "decoded_token": piece(tok, ids[p])}}
        for j, (t, v) in enumerate(top_at(ids, p, n, vocab)):
            d.setdefault(str(t), {"logprob": v, "rank": j + 1, "decoded_token": piece(tok, t)})
        out.append(d)
    return out


def close(a, b) -> bool:
    """Equal JSON values, floats within 1e-9."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) < 1e-9
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


# --- /v1/completions: echo + logprobs -------------------------------------------------------------
def test_completions_echo_logprobs_scores_the_prompt_with_max_tokens_0(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert s == 200, d
    c = d["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 0 and d["usage"]["prompt_tokens"] == len(ids)
    assert close(c["logprobs"], legacy_prompt_part(tokenizer, ids, 2)), c["logprobs"]
    assert "prompt_logprobs" not in c  # vLLM's field only when asked for


def test_completions_echo_logprobs_then_the_generated_tokens(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    s, plain = plp_server.post(COMP, {"prompt": PROMPT, "logprobs": 1, "max_tokens": 3})
    s2, d = plp_server.post(COMP, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3})
    assert s == s2 == 200, d
    c, gen = d["choices"][0], plain["choices"][0]
    assert c["text"] == PROMPT + gen["text"]
    lp, head = c["logprobs"], legacy_prompt_part(tokenizer, ids, 1)
    P = len(ids)
    shift = sum(len(t) for t in head["tokens"])
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert close(lp[key], head[key] + gen["logprobs"][key]), key
    # text_offset continues across the prompt and the completion
    assert lp["text_offset"] == head["text_offset"] + [o + shift for o in gen["logprobs"]["text_offset"]]
    assert len(lp["tokens"]) == P + 3


def test_completions_echo_logprobs_streamed_on_the_first_chunk(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "stream": True}
    chunks = [c for c in plp_server.sse_events(COMP, body) if c.get("choices")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    head = legacy_prompt_part(tokenizer, ids, 2)
    P = len(ids)
    assert close({k: first["logprobs"][k][:P] for k in head}, head), first["logprobs"]
    # joined, the stream equals the non-streamed answer
    s, whole = plp_server.post(COMP, dict(body, stream=False))
    joined = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in head}
    assert close(joined, whole["choices"][0]["logprobs"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    # max_tokens 0: one chunk, the prompt's only
    chunks = [c for c in plp_server.sse_events(COMP, dict(body, max_tokens=0)) if c.get("choices")]
    assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "length"
    assert close(chunks[0]["choices"][0]["logprobs"], head)


def test_completions_echo_logprobs_through_the_openai_client(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    # The client types token_logprobs as List[float] and top_logprobs as List[Dict]: strict
    # validation rejects the null of the first prompt token, which OpenAI's API sends as well.
    client = plp_server.client(_strict_response_validation=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    lp, want = r.choices[0].logprobs, legacy_prompt_part(tokenizer, ids, 2)
    assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    assert lp.tokens == want["tokens"] and lp.text_offset == want["text_offset"]
    assert close(lp.token_logprobs, want["token_logprobs"]) and close(lp.top_logprobs, want["top_logprobs"])
    stream = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, stream=True)
    chunks = list(stream)
    assert close(chunks[0].choices[0].logprobs.token_logprobs, want["token_logprobs"])


def test_completions_echo_logprobs_return_tokens_as_token_ids(plp_server, tokenizer):
    """vLLM's return_tokens_as_token_ids covers echo's prompt part too (streamed: the first chunk);
    vLLM's prompt_logprobs keep their shape (ids as keys already, decoded_token the text)."""
    ids, vocab = prompt_ids(tokenizer), len(tokenizer)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    s, d = plp_server.post(COMP, body)
    assert s == 200, d
    c, P = d["choices"][0], len(ids)
    lp = c["logprobs"]
    assert c["prompt_token_ids"] == ids and c["text"].startswith(PROMPT)
    assert lp["tokens"] == [f"token_id:{t}" for t in ids + c["token_ids"]]
    want_tops = [None] + [{f"token_id:{t}": v for t, v in top_at(ids, p, 2, vocab)} for p in range(1, P)]
    assert close(lp["top_logprobs"][:P], want_tops), lp["top_logprobs"][:P]
    assert lp["text_offset"][:P] == legacy_prompt_part(tokenizer, ids, 2)["text_offset"]  # offsets into text
    chunks = [ch for ch in plp_server.sse_events(COMP, {**body, "stream": True}) if ch.get("choices")]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"][:P] == lp["tokens"][:P]
    for key in ("tokens", "top_logprobs"):
        assert close([x for ch in chunks for x in ch["choices"][0]["logprobs"][key]], lp[key]), key
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1,
                                  "return_tokens_as_token_ids": True})
    assert s == 200 and close(d["choices"][0]["prompt_logprobs"], vllm_expected(tokenizer, ids, 2)), d


# --- vLLM prompt_logprobs -------------------------------------------------------------------------
@pytest.mark.parametrize("n_top", [0, 2])
def test_vllm_prompt_logprobs_on_completions(plp_server, tokenizer, n_top):
    ids = prompt_ids(tokenizer)
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "prompt_logprobs": n_top, "max_tokens": 2})
    assert s == 200, d
    got = d["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) == d["usage"]["prompt_tokens"]
    assert close(got, vllm_expected(tokenizer, ids, n_top)), got[:3]
    assert all(len(e) == max(n_top, 1) for e in got[1:])  # the prompt token is also the top one: once
    assert d["choices"][0]["logprobs"] is None  # no output logprobs asked for
    # streamed: on the first chunk
    chunks = [c for c in plp_server.sse_events(COMP, {"prompt": PROMPT, "prompt_logprobs": n_top, "max_tokens": 2,
                                                      "stream": True}) if c.get("choices")]
    assert close(chunks[0]["choices"][0]["prompt_logprobs"], got)
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


def test_vllm_prompt_logprobs_with_echo_logprobs_and_max_tokens_0(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "prompt_logprobs": 3, "echo": True, "logprobs": 1,
                                  "max_tokens": 0})
    assert s == 200, d
    c = d["choices"][0]
    assert close(c["prompt_logprobs"], vllm_expected(tokenizer, ids, 3))
    assert close(c["logprobs"], legacy_prompt_part(tokenizer, ids, 1))  # each its own top-N


def test_vllm_prompt_logprobs_on_chat(plp_server, tokenizer):
    body = {"messages": MSGS, "prompt_logprobs": 2, "max_tokens": 2, "return_prompt_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    s, d = plp_server.post(CHAT, body)
    assert s == 200, d
    ids = d["prompt_token_ids"]  # the templated prompt
    assert len(ids) == d["usage"]["prompt_tokens"]
    assert close(d["prompt_logprobs"], vllm_expected(tokenizer, ids, 2))
    chunks = plp_server.sse_events(CHAT, dict(body, stream=True))
    assert close(chunks[0]["prompt_logprobs"], d["prompt_logprobs"])
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    # max_tokens 0 scores the prompt only
    s, d0 = plp_server.post(CHAT, dict(body, max_tokens=0))
    assert s == 200 and d0["usage"]["completion_tokens"] == 0, d0
    assert close(d0["prompt_logprobs"], d["prompt_logprobs"])
    # through the official client (chat's response types take the extra field)
    r = plp_server.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                                    extra_body={"prompt_logprobs": 2})
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens


def test_n_2_each_choice_has_its_prompt_logprobs(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "n": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 1,
                                  "max_tokens": 2})
    assert s == 200 and len(d["choices"]) == 2, d
    for c in d["choices"]:
        assert close(c["prompt_logprobs"], vllm_expected(tokenizer, ids, 1))
        assert close({k: c["logprobs"][k][:len(ids)] for k in ("tokens", "token_logprobs", "top_logprobs")},
                     {k: v for k, v in legacy_prompt_part(tokenizer, ids, 1).items() if k != "text_offset"})
    s, d = plp_server.post(CHAT, {"messages": MSGS, "n": 2, "prompt_logprobs": 1, "max_tokens": 2,
                                  "return_prompt_token_ids": True})
    assert s == 200 and len(d["choices"]) == 2, d
    assert close(d["prompt_logprobs"], vllm_expected(tokenizer, d["prompt_token_ids"], 1))
    s, d = plp_server.post(GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                 "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert s == 200 and isinstance(d, list) and len(d) == 2, d
    want = [[None, ids[0], None]] + [[lp_at(p), ids[p], None] for p in range(1, len(ids))]
    for obj in d:
        assert close(obj["meta_info"]["input_token_logprobs"], want)


# --- /generate ------------------------------------------------------------------------------------
def gen_expected(tok, ids: list[int], k: int, n_top: int, text: bool) -> tuple[list, list]:
    vocab = len(tok)

    def t(x):
        return piece(tok, x) if text else None

    token_lps = [[None if p == 0 else lp_at(p), ids[p], t(ids[p])] for p in range(k, len(ids))]
    tops = [None if p == 0 else [[v, x, t(x)] for x, v in top_at(ids, p, n_top, vocab)] for p in range(k, len(ids))]
    return token_lps, tops


@pytest.mark.parametrize("k", [0, 3])
def test_generate_input_logprobs(plp_server, tokenizer, k):
    ids = prompt_ids(tokenizer)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": k, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2}}
    s, d = plp_server.post(GEN, body)
    assert s == 200, d
    m = d["meta_info"]
    token_lps, tops = gen_expected(tokenizer, ids, k, 2, True)
    assert close(m["input_token_logprobs"], token_lps), m["input_token_logprobs"][:2]
    assert close(m["input_top_logprobs"], tops)
    assert m["prompt_tokens"] == k + len(m["input_token_logprobs"])  # SGLang's invariant
    assert len(m["output_token_logprobs"]) == m["completion_tokens"] == 2
    # without the text and the top ones
    s, d = plp_server.post(GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": k,
                                 "sampling_params": {"max_new_tokens": 0}})
    assert s == 200, d
    m = d["meta_info"]
    assert close(m["input_token_logprobs"], gen_expected(tokenizer, ids, k, 0, False)[0])
    assert "input_top_logprobs" not in m and m["completion_tokens"] == 0
    assert m["finish_reason"]["type"] == "length"
    # -1 (the default): output logprobs only, as before
    s, d = plp_server.post(GEN, {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 1,
                                 "sampling_params": {"max_new_tokens": 2}})
    assert d["meta_info"]["input_token_logprobs"] == [] and d["meta_info"]["input_top_logprobs"] == []


def test_generate_batch_per_item_start_lens(plp_server, tokenizer):
    a, b = prompt_ids(tokenizer), prompt_ids(tokenizer, "one two three four")
    s, d = plp_server.post(GEN, {"input_ids": [a, b], "return_logprob": [True, True], "logprob_start_len": [1, -1],
                                 "sampling_params": {"max_new_tokens": 1}})
    assert s == 200 and len(d) == 2, d
    assert close(d[0]["meta_info"]["input_token_logprobs"], gen_expected(tokenizer, a, 1, 0, False)[0])
    assert d[0]["meta_info"]["prompt_tokens"] == 1 + len(d[0]["meta_info"]["input_token_logprobs"])
    assert d[1]["meta_info"]["input_token_logprobs"] == []


def test_generate_streamed_cumulative_carries_them_on_every_chunk(plp_server, tokenizer):
    ids = prompt_ids(tokenizer)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 4}, "stream": True}
    chunks = plp_server.sse_events(GEN, body)
    token_lps, tops = gen_expected(tokenizer, ids, 2, 1, False)
    assert len(chunks) >= 2
    for c in chunks:
        assert close(c["meta_info"]["input_token_logprobs"], token_lps)
        assert close(c["meta_info"]["input_top_logprobs"], tops)


def test_generate_streamed_incremental_carries_them_on_the_first_chunk(tokenizer_factory, tokenizer):
    srv = _server(tokenizer_factory, incremental_streaming_output=True)
    try:
        ids = prompt_ids(tokenizer)
        chunks = srv.sse_events(GEN, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                      "sampling_params": {"max_new_tokens": 4}, "stream": True})
        assert len(chunks) >= 2
        assert close(chunks[0]["meta_info"]["input_token_logprobs"], gen_expected(tokenizer, ids, 0, 0, False)[0])
        assert all(c["meta_info"]["input_token_logprobs"] == [] for c in chunks[1:])
    finally:
        stop_server(srv)


# --- 400s -----------------------------------------------------------------------------------------
def assert_400(srv, path, body, field, *words):
    s, d = srv.post(path, body)
    assert s == 400, d
    text = json.dumps(d)
    assert field in text and all(w in text for w in words), d
    if isinstance(d.get("error"), dict) and "param" in d["error"]:
        assert d["error"]["param"] == field, d


def assert_serves(srv):
    s, d = srv.post(COMP, {"prompt": PROMPT, "max_tokens": 2})
    assert s == 200 and d["choices"][0]["text"], d
    s, d = srv.post(GEN, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert s == 200 and d["output_ids"], d


FLAG_OFF = [
    (COMP, {"prompt": PROMPT, "echo": True, "logprobs": 1}, "logprobs"),
    (COMP, {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}, "logprobs"),
    (COMP, {"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 0}, "prompt_logprobs"),
    (GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    (GEN, {"text": [PROMPT, PROMPT], "return_logprob": True, "logprob_start_len": [-1, 2]}, "logprob_start_len"),
]


@pytest.mark.parametrize("path,body,field", FLAG_OFF)
def test_without_the_flag_each_route_names_its_field_and_the_flag(scripted_server, path, body, field):
    assert_400(scripted_server, path, body, field, "--prompt-logprobs")


def test_without_the_flag_the_neutral_forms_still_serve(scripted_server):
    srv = scripted_server
    s, d = srv.post(GEN, {"text": PROMPT, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}})
    assert s == 200, d  # no return_logprob: ignored, as SGLang ignores it
    s, d = srv.post(GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": -1,
                          "sampling_params": {"max_new_tokens": 1}})
    assert s == 200 and d["meta_info"]["input_token_logprobs"] == [], d
    s, d = srv.post(COMP, {"prompt": PROMPT, "echo": True, "max_tokens": 1, "prompt_logprobs": None})
    assert s == 200, d
    assert_serves(srv)


BAD = [
    *[(path, dict(base, prompt_logprobs=v), "prompt_logprobs")
      for path, base in ((COMP, {"prompt": PROMPT}), (CHAT, {"messages": MSGS}))
      for v in (21, -1, "x", True, 1.5, [1])],
    (GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": 500}, "logprob_start_len"),
    (GEN, {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    (GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    (GEN, {"text": PROMPT, "logprob_start_len": -2}, "logprob_start_len"),
    (GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": "0"}, "logprob_start_len"),
    (GEN, {"text": PROMPT, "return_logprob": True, "logprob_start_len": 1.0}, "logprob_start_len"),
    (COMP, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),  # 0 only with prompt logprobs
    (COMP, {"prompt": PROMPT, "echo": True, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (COMP, {"prompt": PROMPT, "logprob_start_len": 0}, "logprob_start_len"),  # SGLang's field: /generate only
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}-{f}-{json.dumps(b)[-40:]}" for p, b, f in BAD])
def test_bad_values_are_400s_naming_the_field(plp_server, path, body, field):
    assert_400(plp_server, path, body, field)


def test_server_stays_healthy_after_the_400s(plp_server, scripted_server):
    for path, body, _ in BAD:
        plp_server.post(path, body)
    for path, body, _ in FLAG_OFF:
        scripted_server.post(path, body)
    assert_serves(plp_server)
    assert_serves(scripted_server)
    s, d = plp_server.post(COMP, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert s == 200 and d["choices"][0]["logprobs"]["token_logprobs"][0] is None, d


# --- the flag -------------------------------------------------------------------------------------
def test_the_flag_reaches_the_engine(monkeypatch, tok_dir):
    from typer.testing import CliRunner

    from trnrt.cli import app
    from trnrt.cli.server_args import ServerArgs
    from trnrt.cli.serve_engine import build_engine
    seen = record_engine_kwargs(monkeypatch)
    r = CliRunner().invoke(app, ["serve", "--prompt-logprobs", "--disable-compiled-cache"])
    assert r.exit_code == 2 and seen["prompt_logprobs"] is True, r.output
    r = CliRunner().invoke(app, ["serve", "--disable-compiled-cache"])
    assert seen["prompt_logprobs"] is False
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200, env={"COLUMNS": "200"}).output
    assert "--prompt-logprobs" in out
    for on in (True, False):
        engine, _ = build_engine(ServerArgs(model=str(tok_dir), scripted=True, prompt_logprobs=on))
        try:
            assert engine.prompt_logprobs is on
        finally:
            engine.shutdown(0.0)
