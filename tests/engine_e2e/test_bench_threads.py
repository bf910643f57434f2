"""`trnrt bench`: both sides run at one torch thread count, and the output says which."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.benchmark.engine_bench import BenchError, run_bench, threads_note
from trnrt.engine.runner.threads import ENV_VAR

TINY = dict(batch=2, input_len=8, output_len=4, num_prompts=2)


@pytest.fixture
def two_threads(monkeypatch):
    """The process at torch's usual default on this box (2), as `trnrt bench` starts."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_compare_hf_defaults_to_the_engine_default_on_both_sides(two_threads):
    notes: list[str] = []
    r = run_bench(**TINY, compare_hf=True, progress=lambda d, done, total: notes.append(d))
    # the tiny model on the CPU: one intra-op thread, measured in the engine thread and on the
    # thread transformers ran on; not the process's 2
    assert r["threads"] == 1 and r["hf"]["threads"] == 1
    assert notes[-1] == "done: torch threads 1, both sides"
    assert torch.get_num_threads() == 2  # restored


def test_threads_option_and_env_reach_both_sides(two_threads, monkeypatch):
    r = run_bench(**TINY, compare_hf=True, threads=2)
    assert r["threads"] == 2 and r["hf"]["threads"] == 2
    monkeypatch.setenv(ENV_VAR, "2")
    r = run_bench(**TINY)
    assert r["threads"] == 2 and "hf" not in r
    r = run_bench(**TINY, threads=1)  # the option wins over the variable
    assert r["threads"] == 1


def test_bad_env_is_a_bench_error(two_threads, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "zero")
    with pytest.raises(BenchError, match=ENV_VAR) as e:
        run_bench(**TINY)
    assert e.value.field == "threads"


def test_threads_note():
    assert threads_note({"threads": 1}) == "done: torch threads 1"
    assert threads_note({"threads": 4, "hf": {"threads": 4}}) == "done: torch threads 4, both sides"
    assert threads_note({"threads": 1, "hf": {"threads": 2}}) == "done: torch threads trnrt 1, transformers 2"


def test_cli_json_reports_the_thread_count_of_both_sides(two_threads):
    r = CliRunner().invoke(app, ["bench", "--batch", "2", "--input-len", "8", "--output-len", "4", "--compare-hf",
                                 "--threads", "2", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    [obj] = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert obj["threads"] == 2 and obj["hf"]["threads"] == 2


def test_a_side_without_a_decode_rate_gives_no_ratio_and_the_table_prints(capsys):
    # A 4-token transformers decode on a busy machine can time as zero (generate minus its own
    # prefill forward): its rate is None, and `--compare-hf` printed a TypeError (CI, once).
    from trnrt.cli.bench import _print_table
    from trnrt.benchmark.engine_bench import _ratio

    assert _ratio(10.0, None) is None and _ratio(None, 5.0) is None and _ratio(10.0, 0.0) is None
    assert _ratio(10.0, 4.0) == 2.5
    side = {"batch": 2, "input_len": 8, "output_len": 4, "prefill_tok_s": 100.0}
    r = {**side, "decode_tok_s": 50.0, "decode_step_ms": 20.0,
         "hf": {**side, "decode_tok_s": None, "decode_step_ms": 0.0},
         "ratio": {"prefill": _ratio(100.0, 100.0), "decode": _ratio(50.0, None)}}
    _print_table(r, compiled=False)
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "1.00x" in out
