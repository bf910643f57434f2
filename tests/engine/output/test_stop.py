"""StopChecker: token stop order, ignore_eos semantics, merging with stop strings."""

from trnrt.engine.request import FinishReason, SamplingParams
from trnrt.engine.output.sequence import Sequence
from trnrt.engine.output.stop import StopChecker, is_token_stop

EOS = 2


def seq_with(outputs, prompt_len=3, **params):
    s = Sequence("r", list(range(10, 10 + prompt_len)), SamplingParams(**params))
    for t in outputs:
        s.append_token(t)
    return s


def test_token_stop_conditions():
    sc = StopChecker(eos_token_ids=[EOS, 3], max_model_len=8)
    assert sc.check_token(seq_with([])) is None
    assert sc.check_token(seq_with([5])) is None
    assert sc.check_token(seq_with([5, 3])) == FinishReason("stop", matched=3)  # any of the EOS ids
    assert sc.check_token(seq_with([5, EOS], ignore_eos=True)) is None
    assert sc.check_token(seq_with([9], stop_token_ids=[9], ignore_eos=True)) == FinishReason("stop", matched=9)
    assert sc.check_token(seq_with([5, 6], max_new_tokens=2)) == FinishReason("length")
    assert sc.check_token(seq_with([5, 6, 7, 8, 9], max_new_tokens=100)) == FinishReason("length")  # 3 + 5 == 8
    assert sc.check_token(seq_with([5, 6, 7, 8], max_new_tokens=100)) is None


def test_merge_stop_string_with_token_reason():
    length = FinishReason("length")
    eos = FinishReason("stop", matched=EOS)
    assert StopChecker.merge(None, None) is None
    assert StopChecker.merge(None, "###") == FinishReason("stop", matched="###")
    assert StopChecker.merge(length, "###") == FinishReason("stop", matched="###")  # trimmed text ended there
    assert StopChecker.merge(eos, "###") == eos
    assert is_token_stop(eos) and not is_token_stop(length) and not is_token_stop(FinishReason("stop", matched="x"))
