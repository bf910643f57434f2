"""OutputStream delivery intervals and merge_outputs. Pure Python."""

import pytest

from trnrt.engine.output.outputs import RequestOutput, TokenLogprob
from trnrt.engine.request import FinishReason
from trnrt.engine.output.stream import OutputStream, merge_outputs


def _outs(n: int, logprobs: bool = True) -> list[RequestOutput]:
    outs = []
    for i in range(n):
        lps = [TokenLogprob(i, -float(i), [(i, -float(i))])] if logprobs else None
        outs.append(RequestOutput("r", new_token_ids=[i], new_text=f"<{i}>", new_logprobs=lps,
                                  num_prompt_tokens=7, num_output_tokens=i + 1))
    outs[-1].finished = True
    outs[-1].finish_reason = FinishReason("length")
    return outs


def _drain(stream: OutputStream) -> list[RequestOutput]:
    got = []
    while (o := stream.get(timeout=0)) is not None:
        got.append(o)
    return got


def test_merge_concatenates_deltas_and_keeps_the_last_state():
    m = merge_outputs(_outs(5))
    assert m.new_token_ids == [0, 1, 2, 3, 4] and m.new_text == "<0><1><2><3><4>"
    assert [lp.token_id for lp in m.new_logprobs] == [0, 1, 2, 3, 4]
    assert m.finished and m.finish_reason.type == "length" and m.num_output_tokens == 5 and m.num_prompt_tokens == 7
    assert merge_outputs(_outs(3, logprobs=False)).new_logprobs is None


@pytest.mark.parametrize("interval, sizes", [(1, [1] * 7), (3, [3, 3, 1]), (0, [7]), (7, [7]), (10, [7])])
def test_interval_delivers_every_nth_output_and_the_final(interval, sizes):
    s = OutputStream("r", interval)
    outs = _outs(7)
    delivered = []
    for k, o in enumerate(outs, 1):
        s.put(o)
        delivered.extend(_drain(s))
        # held back: only what is past the last interval boundary, nothing after the finish
        expected = 7 if o.finished else (k // interval * interval if interval else 0)
        assert sum(len(d.new_token_ids) for d in delivered) == expected
    assert [len(d.new_token_ids) for d in delivered] == sizes
    assert [t for d in delivered for t in d.new_token_ids] == list(range(7))
    assert "".join(d.new_text for d in delivered) == "".join(o.new_text for o in outs)
    assert delivered[-1].finished and not any(d.finished for d in delivered[:-1])
    assert s._held == []


def test_final_only_stream_wakes_nobody_before_the_end():
    s = OutputStream("r", 0)
    outs = _outs(4)
    for o in outs[:-1]:
        s.put(o)
        assert s.get(timeout=0) is None
    s.put(outs[-1])
    (final,) = _drain(s)
    assert final.new_token_ids == [0, 1, 2, 3] and s.finished


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval"):
        OutputStream("r", -1)
