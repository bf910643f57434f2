"""Structured outputs in the real Engine with a scripted runner that honours the token mask.

The scripted runner returns its script's token when the mask allows it and an allowed one
otherwise (trnrt.engine.runner.scripted_runner), so these tests see exactly which tokens the engine's
masks allowed: the grammar applies after `</think>`, a preempted request keeps its matcher, a
dead end ends with "stop", and grammars are refused (naming the field) when the flag is off.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("xgrammar")

from trnrt.engine.core.engine import Engine  # noqa: E402
from trnrt.engine.sample.grammar_spec import GrammarSpec  # noqa: E402
from trnrt.engine.request import GenerateRequest, InvalidRequestError, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from trnrt.models.tiny.tokenizer import write_tokenizer_files

    d = tmp_path_factory.mktemp("hf_tok")
    write_tokenizer_files(d)
    return AutoTokenizer.from_pretrained(str(d))


def _engine(tok, script, **kw):
    eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
    return Engine.scripted(tok, script, eos_token_ids=(eos,), **kw)


def _collect(stream, timeout=30.0):
    outs, deadline = [], time.monotonic() + timeout
    while not outs or not outs[-1].finished:
        o = stream.get(timeout=max(0.0, deadline - time.monotonic()))
        assert o is not None, "stalled"
        outs.append(o)
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), outs[-1]


def _req(tok, prompt, grammar, **params):
    params.setdefault("max_new_tokens", 64)
    ids = tok.encode(prompt, add_special_tokens=False)
    return GenerateRequest(ids, SamplingParams(grammar=grammar, temperature=0.0, **params))


def _think_end(tok) -> int:
    return tok.convert_tokens_to_ids("</think>")


def test_grammar_applies_after_think_and_valid_tokens_pass(hf_tok):
    tok = hf_tok
    answer = json.dumps({"ok": True, "n": 7}, separators=(",", ":"))
    reasoning = tok.encode("hello there", add_special_tokens=False)
    script_ids = reasoning + [_think_end(tok)] + tok.encode(answer, add_special_tokens=False)
    eng = _engine(tok, lambda p: list(script_ids), structured_outputs=True)
    try:
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format", after_token=_think_end(tok))
        ids, text, last = _collect(eng.submit(_req(tok, "q", spec)))
        # the free reasoning text and the valid answer pass unmasked; the grammar then ends at EOS
        assert ids[:len(script_ids)] == script_ids, "a mask was applied before </think> or blocked a valid token"
        assert eng.runner.num_masked_tokens == 0  # then the exhausted script says EOS: allowed once complete
        assert last.finish_reason.type == "stop"
        assert json.loads(tok.decode(ids[len(reasoning) + 1:], skip_special_tokens=True)) == {"ok": True, "n": 7}
        # without the </think> gate the same script is masked from the first token
        n0 = eng.runner.num_masked_tokens
        spec0 = GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format")
        ids0, _, _ = _collect(eng.submit(_req(tok, "q", spec0)))
        assert eng.runner.num_masked_tokens > n0 and ids0[:len(reasoning)] != reasoning
        assert not eng._grammars, "a finished request's matcher was kept"
    finally:
        eng.shutdown(0.0)


def _replays(tok, kind, value, ids, eos_ids) -> bool:
    """Every generated token is accepted by a fresh matcher of the grammar (EOS ends it)."""
    from trnrt.engine.sample.grammar import GrammarCompilerService

    svc = GrammarCompilerService(tok, len(tok), eos_ids)
    st = svc.new_state(GrammarSpec(kind, value, "x"))
    return all(st.accept(t) for t in ids)


def test_preempted_requests_keep_their_matcher(hf_tok):
    tok = hf_tok
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    junk = tok.encode(" zz" * 40, add_special_tokens=False)  # never valid: the mask decides every token
    eng = _engine(tok, lambda p: list(junk), structured_outputs=True, max_model_len=64, max_running_requests=3,
                  num_blocks=7)
    try:
        regex = r"[a-c]{30,40}"
        reqs = [_req(tok, "x" * (18 + i), GrammarSpec("regex", regex, "regex"), max_new_tokens=40) for i in range(3)]
        results = [_collect(s) for s in eng.submit_many(reqs)]
        assert eng.scheduler.num_preemptions_total > 0, "no preemption: the test does not test resumption"
        for ids, text, last in results:
            body = [t for t in ids if t != eos]
            assert _replays(tok, "regex", regex, ids, [eos]), f"a resumed request lost its matcher state: {text!r}"
            assert 30 <= len(tok.decode(body)) <= 40 and set(tok.decode(body)) <= set("abc")
    finally:
        eng.shutdown(0.0)


def test_dead_end_stops_and_flag_off_is_refused(hf_tok):
    tok = hf_tok
    eng = _engine(tok, lambda p: tok.encode("ab", add_special_tokens=False), structured_outputs=True)
    try:
        # ignore_eos: EOS does not end it, the matcher then has no continuation: "stop", not -inf
        ids, text, last = _collect(eng.submit(_req(tok, "q", GrammarSpec("regex", "ab", "regex"), ignore_eos=True)))
        assert text.startswith("ab") and last.finish_reason.type == "stop" and len(ids) <= 3
        with pytest.raises(InvalidRequestError) as e:
            eng.submit(_req(tok, "q", GrammarSpec("regex", "[a-", "structured_outputs.regex")))
        assert e.value.field == "structured_outputs.regex" and "Unclosed" in str(e.value)
        assert "/project" not in str(e.value) and ".cc:" not in str(e.value)
    finally:
        eng.shutdown(0.0)
    off = _engine(tok, lambda p: [1])
    try:
        with pytest.raises(InvalidRequestError, match="--structured-outputs") as e:
            off.submit(_req(tok, "q", GrammarSpec("regex", "ab", "guided_regex")))
        assert e.value.field == "guided_regex"
    finally:
        off.shutdown(0.0)
