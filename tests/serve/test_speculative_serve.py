"""`trnrt serve --speculative-*` (SGLang's names, vLLM's --speculative-config): usage errors name
the flag before any model loads, the resolved config reaches the engine, and a server with the
tiny checkpoint's MTP drafter answers /generate exactly as a plain one (greedy), with the
acceptance figures on /server_info and /v1/stats."""

from __future__ import annotations

import pytest

from serve_support import start_server, stop_server
from test_cli_cache_flags import captured, invoke  # noqa: F401  (the fixture)


@pytest.mark.parametrize("args,flag,text", [
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm", "trnrt serves NEXTN"),
    (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm", "MTP layer"),
    (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "4"], "--speculative-eagle-topk", "only 1"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "0"], "--speculative-num-steps", "1..8"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "5"],
     "--speculative-num-draft-tokens", "must be --speculative-num-steps + 1 (3)"),
    (["--speculative-num-steps", "2"], "--speculative-num-steps", "needs --speculative-algorithm"),
    (["--speculative-config", '{"method": "eagle3"}'], "--speculative-config", "method \"mtp\""),
    (["--speculative-config", "{oops"], "--speculative-config", "not JSON"),
    (["--speculative-algorithm", "NEXTN", "--scripted"], "--speculative-algorithm", "not --scripted"),
    (["--preset", "mtp-always", "--structured-outputs"], "--structured-outputs", "no grammar or penalty variant"),
    (["--preset", "mtp-always", "--penalties"], "--penalties", "needs a dynamic preset"),
    (["--preset", "mtp-dynamic", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"],
     "--speculative-num-steps", "verifies 3 drafts a step"),
    (["--preset", "mtp-always", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}'],
     "--speculative-num-steps", "verifies 3 drafts a step"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_speculative_flags_are_usage_errors(captured, args, flag, text):  # noqa: F811
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert flag in r.output and text in " ".join(r.output.split()), r.output
    assert not captured


@pytest.mark.parametrize("args,steps", [
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "3"], 2),
    (["--speculative-algorithm", "nextn"], 3),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "5"], 4),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 5}'], 5),
])
def test_speculative_flags_reach_the_engine(captured, args, steps):  # noqa: F811
    from trnrt.engine.spec.config import SpeculativeConfig

    r = invoke(*args)
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert captured["speculative"] == SpeculativeConfig("NEXTN", steps)


def test_off_by_default(captured):  # noqa: F811
    invoke()
    assert captured["speculative"] is None


@pytest.mark.parametrize("args,expected", [
    (["--preset", "mtp-always"], (3, 0.0)),  # the preset alone turns it on, always
    (["--preset", "mtp-dynamic"], (3, 1.5)),  # ... with its minimum accept length
    (["--preset", "mtp-dynamic", "--speculative-min-accept-length", "2.5"], (3, 2.5)),
    (["--preset", "mtp-dynamic", "--speculative-algorithm", "EAGLE"], (3, 1.5)),  # k from the preset
    (["--preset", "mtp-always", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"], (3, 0.0)),
    (["--preset", "mtp-dynamic", "--penalties", "--structured-outputs"], (3, 1.5)),  # dynamic: plain steps
])
def test_mtp_presets_turn_speculation_on(captured, args, expected):  # noqa: F811
    r = invoke(*args)
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    spec = captured["speculative"]
    assert (spec.algorithm, spec.num_steps, spec.min_accept_length) == ("NEXTN", *expected)
