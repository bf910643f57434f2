"""stop_regex in the engine: compilation (RE2 only, refusals with a reason), the detokenizer's regex
path (matches across token boundaries, trimmed or kept, held back while they could still match,
bounded search work per token), and the real Engine with a scripted runner."""

import pytest
from tokenizers import ByteLevelBPETokenizer

from trnrt.engine.output.detokenizer import IncrementalDetokenizer
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, SamplingParams
from trnrt.engine.output.stop import REGEX_HOLD_CHARS, StopRegex, compile_stop_regex

ENGLISH = ["hello world, the quick brown fox stops here", "the lazy dog jumps over the quick fox. END 42 17",
           "aaaa aaaa aaaa bbbb"]


@pytest.fixture(scope="module")
def tok():
    t = ByteLevelBPETokenizer()
    t.train_from_iterator(ENGLISH * 3, vocab_size=400, min_frequency=2, special_tokens=["<eos>", "<|user|>"],
                          show_progress=False)
    return t


def rx(*patterns):
    return [compile_stop_regex(p) for p in patterns]


def run(detok, ids):
    deltas = [detok.step([t]) for t in ids]
    if not detok.is_stopped:
        deltas.append(detok.flush())
    return deltas


def test_compile_is_re2_cached_and_bounded():
    import re2

    r = compile_stop_regex(r"fox\.")
    assert isinstance(r, StopRegex) and isinstance(r.regex, type(re2.compile("x")))
    assert compile_stop_regex(r"fox\.") is r  # compiled once, cached
    assert r.max_len == 4 and compile_stop_regex("a+b").max_len is None
    assert compile_stop_regex("(ab|c){2,3}").max_len == 6


@pytest.mark.parametrize("pattern, why", [
    (r"(a)\1", "linear time"), (r"foo(?=bar)", "linear time"), (r"(?<=x)y", "linear time"),
    (r"(?<!x)y", "linear time"), (r"(?>a)b", "linear time"), (r"a++", "linear time"),
    (r"(a", "not a valid"), (r"a*", "empty string"), (r"\b", "empty string"), ("x" * 257, "256 bytes"),
    (r"\pL", "not a valid Python"),
])
def test_refused_patterns_name_stop_regex_and_say_why(pattern, why):
    with pytest.raises(InvalidRequestError, match=why) as e:
        compile_stop_regex(pattern)
    assert e.value.field == "stop_regex"


def test_sampling_params_compiles_on_validate():
    sp = SamplingParams(stop_regex=r"\d+").validate()
    assert sp.stop_regex == [compile_stop_regex(r"\d+")] and isinstance(sp.stop_regex[0], StopRegex)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_regex=["x"] * 33).validate()
    assert e.value.field == "stop_regex"


def test_regex_across_token_boundaries_trimmed_at_match_start(tok):
    text = "the lazy dog jumps over the quick fox. END 42 17"
    ids = tok.encode(text).ids
    starts = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    i = text.index("ps ov")
    assert i not in starts and i + 5 not in starts  # the match starts and ends inside tokens
    detok = IncrementalDetokenizer(tok, [], stop_regex=rx(r"p[s]\s+o[uv]"))
    deltas = run(detok, ids)
    assert detok.matched_stop == r"p[s]\s+o[uv]"  # the pattern, as SGLang reports it
    assert "".join(deltas) == text[:i] == detok.output_text
    assert all("ps" not in d for d in deltas)


def test_regex_kept_with_include_stop_str_in_output(tok):
    text = "the lazy dog jumps over the quick fox. END 42 17"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], stop_regex=rx(r"\d+ "), include_stop_str_in_output=True)
    assert "".join(run(detok, ids)) == "the lazy dog jumps over the quick fox. END 42 "
    assert detok.matched_stop == r"\d+ "


def test_leftmost_of_strings_and_regexes_wins(tok):
    ids = tok.encode("the lazy dog jumps over").ids
    detok = IncrementalDetokenizer(tok, [], stop=["jumps"], stop_regex=rx("l[a-z]+y"))
    assert detok.step(ids) == "the " and detok.matched_stop == "l[a-z]+y"
    detok = IncrementalDetokenizer(tok, [], stop=["lazy"], stop_regex=rx("j.mps"))
    assert detok.step(ids) == "the " and detok.matched_stop == "lazy"


def test_streamed_text_is_never_retracted(tok):
    """Every delta is a prefix of the final text (nothing streamed is later cut), and the text is
    the same whether tokens come one by one (streamed) or all at once."""
    text = "the quick brown fox stops here. END 42 17"
    ids = tok.encode(text).ids
    for pattern in ["fox s", r"\d\d", "here[.]", "qu?ick", r"o\w+ s", "x"]:
        one = IncrementalDetokenizer(tok, [], stop_regex=rx(pattern))
        deltas = run(one, ids)
        acc = ""
        for d in deltas:
            acc += d
            assert one.output_text.startswith(acc)
        batch = IncrementalDetokenizer(tok, [], stop_regex=rx(pattern))
        assert "".join(run(batch, ids)) == acc
        assert one.matched_stop == batch.matched_stop


def test_hold_back_is_the_longest_match_minus_one(tok):
    ids = tok.encode("the quick brown fox").ids
    detok = IncrementalDetokenizer(tok, [], stop_regex=rx("br.wn fix"))  # 9 chars: hold 8
    out = "".join(detok.step([t]) for t in ids)
    assert out == "the quick brown fox"[:-8] and detok.flush() == "brown fox"[1:]
    detok = IncrementalDetokenizer(tok, [], stop_regex=rx("z+"))  # unbounded: capped hold
    long_ids = tok.encode("the quick brown fox " * 10).ids
    out = "".join(detok.step([t]) for t in long_ids)
    assert len("the quick brown fox " * 10) - len(out) == REGEX_HOLD_CHARS


def test_long_match_found_from_the_held_back_text(tok):
    text = "aaaa " * 30 + "bbbb"
    ids = tok.encode(text).ids
    for pattern in (r"(a+ )+b", r"[a ]+b"):  # the second could start on any emitted character
        detok = IncrementalDetokenizer(tok, [], stop_regex=rx(pattern))
        before = "".join(detok.step([t]) for t in ids[:-1])
        assert not detok.is_stopped and len(before) == len(tok.decode(ids[:-1])) - REGEX_HOLD_CHARS
        assert detok.step(ids[-1:]) == "" and detok.matched_stop == pattern
        # the emitted a's stay; the match is cut where the held-back text began
        assert detok.output_text == before and len(before) > 0


def test_adversarial_pattern_search_work_is_bounded_and_equals_a_plain_one(tok):
    """`(a+)+$` over a long run of a's: the search covers only the held-back window each token
    (counted, not timed), exactly as much as a plain pattern with the same hold, and RE2 runs it."""
    ids = tok.encode("aaaa " * 400).ids
    n_chars = len("aaaa " * 400)
    work = {}
    for pattern in [r"(a+)+$", r"(x+x+)+y", r"zzzz+"]:
        detok = IncrementalDetokenizer(tok, [], stop_regex=rx(pattern))
        for t in ids:
            detok.step([t])
            if detok.is_stopped:
                break
        work[pattern] = detok.regex_chars_searched
    # `(a+)+$` matches at once (the text so far ends in a's); the other two never match
    assert work[r"(x+x+)+y"] == work[r"zzzz+"]
    max_token = max(len(tok.decode([t])) for t in ids)
    assert work[r"zzzz+"] <= len(ids) * (REGEX_HOLD_CHARS + 1 + max_token)
    assert work[r"zzzz+"] < n_chars * 70  # linear in the output, not quadratic
    detok = IncrementalDetokenizer(tok, [], stop_regex=rx(r"(a+)+$"))
    assert detok.step(ids[:1]) == "" and detok.matched_stop == r"(a+)+$"


def test_stop_token_text_kept_only_when_asked(tok):
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("hello world").ids
    for keep, want in ((False, "hello world"), (True, "hello world<eos>")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, include_stop_str_in_output=keep)
        text = "".join(detok.step([t]) for t in ids) + detok.step([eos], exclude_last=True) + detok.flush()
        assert text == want


def test_engine_stops_on_a_regex_and_frees_everything(tok):
    from trnrt.engine.core.engine import Engine

    eos = tok.token_to_id("<eos>")
    script_ids = tok.encode("the lazy dog jumps over the quick fox. END 42 17").ids

    class _Unused:
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text).ids

    engine = Engine.scripted(tok._tokenizer, lambda prompt: list(script_ids), eos_token_ids=(eos,), max_model_len=256)
    try:
        prompt = tok.encode("hello").ids
        results = {}
        for name, keep, stream in (("trim", False, True), ("keep", True, False), ("trim-ns", False, False)):
            sp = SamplingParams(max_new_tokens=40, temperature=0.0, stop_regex=[r"\d+"],
                                include_stop_str_in_output=keep)
            (s,) = engine.submit_many([GenerateRequest(prompt, sp, request_id=name, stream=stream)])
            outs = list(s)
            results[name] = ("".join(o.new_text for o in outs), outs[-1].finish_reason)
        base = "the lazy dog jumps over the quick fox. END "
        assert results["trim"] == (base, FinishReason("stop", matched=r"\d+"))
        assert results["trim-ns"] == results["trim"]
        kept, reason = results["keep"]
        assert reason == FinishReason("stop", matched=r"\d+")
        assert kept.startswith(base) and kept[len(base):] in ("4", "42")  # the match, as far as it got
        assert engine.stats()["live"]["running"] == 0
    finally:
        engine.shutdown(0.0)
