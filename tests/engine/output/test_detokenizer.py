"""IncrementalDetokenizer on a real byte-level BPE tokenizer trained in the test.

The unicode sentence appears once in the training text and the English ones three times, so
with min_frequency=2 the multi-byte characters (é, ö, 世, 界, 🙂) stay split into byte tokens,
which is the case the U+FFFD hold-back exists for.
"""

import pytest
from tokenizers import ByteLevelBPETokenizer

from trnrt.engine.output.detokenizer import IncrementalDetokenizer

UNICODE = "héllo wörld 世界 🙂"
ENGLISH = ["hello world, the quick brown fox stops here", "the lazy dog jumps over the quick fox. END"]


@pytest.fixture(scope="module")
def tok():
    t = ByteLevelBPETokenizer()
    t.train_from_iterator([UNICODE] + ENGLISH * 3, vocab_size=400, min_frequency=2,
                          special_tokens=["<eos>", "<|user|>"], show_progress=False)
    return t


def stream(detok, ids, one_by_one=True):
    """Feed ids (one per step, like decode steps); return the list of deltas including the flush."""
    deltas = [detok.step([t]) for t in ids] if one_by_one else [detok.step(ids)]
    if not detok.is_stopped:
        deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(UNICODE + " the quick fox").ids
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 6, "multi-byte characters were meant to span tokens"
    prompt = tok.encode("hello").ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == UNICODE + " the quick fox"
    assert all("\ufffd" not in d for d in deltas)  # never a half character
    assert "" in deltas[:-1]  # some steps held their bytes back
    assert detok.output_text == UNICODE + " the quick fox" and detok.matched_stop is None


def test_leading_space_and_prompt_context(tok):
    prompt = tok.encode("the lazy dog").ids
    ids = tok.encode(" jumps over").ids
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(detok, ids)) == " jumps over"


def test_stop_string_across_token_boundaries_is_trimmed(tok):
    text = "the quick fox stops here. END and more"
    ids = tok.encode(text).ids
    stop = "ps he"
    # the stop string starts inside one token and ends inside another
    starts = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    i = text.index(stop)
    assert i not in starts and i + len(stop) not in starts
    detok = IncrementalDetokenizer(tok, [], stop=["NOPE", stop])
    deltas = stream(detok, ids)
    assert detok.matched_stop == stop
    assert "".join(deltas) == text[:i] == detok.output_text
    # nothing of the stop string was ever streamed, and the text was held back while it could match
    assert all(stop[:2] not in d for d in deltas)
    assert detok.step(tok.encode(" more").ids) == "" and detok.flush() == ""  # stopped: ignored


def test_stop_string_kept_with_include_stop_str_in_output(tok):
    text = "the lazy dog jumps over the quick fox. END"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], stop=["over"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == "the lazy dog jumps over"
    assert detok.matched_stop == "over"


def test_leftmost_stop_string_wins_within_one_step(tok):
    ids = tok.encode("the lazy dog jumps").ids
    detok = IncrementalDetokenizer(tok, [], stop=["jumps", "lazy"])
    assert detok.step(ids) == "the "  # both complete in one multi-token step: "lazy" is leftmost
    assert detok.matched_stop == "lazy"


def test_partial_stop_prefix_held_back_then_released(tok):
    ids = tok.encode("the quick brown fox").ids
    k = next(k for k in range(len(ids)) if tok.decode(ids[: k + 1]).endswith("quick"))
    detok = IncrementalDetokenizer(tok, [], stop=["quick fox"])
    deltas = [detok.step([t]) for t in ids]
    # "quick" could have started "quick fox" until " brown" arrived: it came out late, not never
    assert "quick" not in "".join(deltas[: k + 1])
    assert "".join(deltas[: k + 2]).endswith("quick brown")
    assert "".join(deltas) + detok.flush() == "the quick brown fox" and detok.matched_stop is None
    # at the end of the text a possible prefix is released only by flush()
    detok = IncrementalDetokenizer(tok, [], stop=["fox jumps"])
    assert "".join(detok.step([t]) for t in ids) == "the quick brown "
    assert detok.flush() == "fox"


def test_skip_special_tokens_and_excluded_stop_token(tok):
    eos = tok.token_to_id("<eos>")
    user = tok.token_to_id("<|user|>")
    ids = tok.encode("hello world").ids
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(stream(detok, [user] + ids)) == "hello world"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(detok, [user] + ids)) == "<|user|>hello world"
    # the matched stop token's text is not output, even when special tokens are kept
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    text = "".join(detok.step([t]) for t in ids) + detok.step([eos], exclude_last=True) + detok.flush()
    assert text == "hello world"


def test_works_with_a_transformers_fast_tokenizer(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<eos>")
    ids = fast.encode(UNICODE, add_special_tokens=False)
    detok = IncrementalDetokenizer(fast, [], stop=["世界"])
    deltas = stream(detok, ids + [fast.eos_token_id])
    assert "".join(deltas) == "héllo wörld " and detok.matched_stop == "世界"


def test_engine_recipe_stop_string_finishes_request_and_frees_cache(tok):
    """The loop documented in trnrt.engine.output.stop: scheduler token stops + detokenizer stop strings."""
    from trnrt.engine.cache.cache_manager import CacheManager
    from trnrt.engine.output.outputs import RunnerOutput
    from trnrt.engine.request import FinishReason, GenerateRequest, SamplingParams
    from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig
    from trnrt.engine.output.stop import StopChecker, is_token_stop

    eos = tok.token_to_id("<eos>")
    scripts = {"s": tok.encode("the quick fox. END").ids + [7] * 20, "e": tok.encode(" héllo").ids + [eos]}
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheManager(20, 4, 4), eos_token_ids=[eos])
    detoks, texts, reasons = {}, {}, {}
    for rid, stop in (("s", ["fox."]), ("e", ["zzz"])):
        prompt = tok.encode("hello").ids
        params = SamplingParams(max_new_tokens=30, stop=stop)
        sched.add_request(GenerateRequest(prompt, params, rid))
        detoks[rid] = IncrementalDetokenizer(tok, prompt, stop=params.stop)
        texts[rid] = ""
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sampled = [scripts[e.request_id][sched.get_sequence(e.request_id).num_output_tokens] if e.do_sample else None
                   for e in so.scheduled]
        for u in sched.update_from_output(so, RunnerOutput(sampled)):
            detok = detoks[u.request_id]
            text = detok.step(u.new_token_ids, exclude_last=is_token_stop(u.finish_reason))
            reason = StopChecker.merge(u.finish_reason, detok.matched_stop)
            if reason is not None and not u.finished:
                sched.finish_request(u.request_id, reason)
            if reason is not None:
                text += detok.flush()
                reasons[u.request_id] = reason
            texts[u.request_id] += text
    assert texts == {"s": "the quick ", "e": " héllo"}
    assert reasons == {"s": FinishReason("stop", matched="fox."), "e": FinishReason("stop", matched=eos)}
    sched.cache.check_integrity([])
    assert sched.cache.num_free_blocks == sched.cache.num_usable_blocks


def test_deferred_decodes_once_at_flush_with_the_same_text(tok, monkeypatch):
    text = UNICODE + " the quick fox"
    ids = tok.encode(text).ids + tok.encode("<eos>").ids
    prompt = tok.encode("hello").ids
    live = IncrementalDetokenizer(tok, prompt)
    deferred = IncrementalDetokenizer(tok, prompt, deferred=True)
    calls = []
    orig = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", lambda self, i: calls.append(self) or orig(self, i))
    for k, t in enumerate(ids):
        last = k == len(ids) - 1  # the EOS: a stop token, its text excluded
        assert deferred.step([t], exclude_last=last) == ""
        live.step([t], exclude_last=last)
    assert deferred not in calls  # nothing decoded before the end
    assert deferred.flush() == live.output_text + live.flush() == text
    assert calls.count(deferred) == 2  # one window: prefix (the prompt context) and full
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [], stop=["x"], deferred=True)
