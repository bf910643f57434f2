"""`trnrt serve`'s prefix-cache and scheduling flags (SGLang 0.5.23's names and defaults): --help,
usage errors (exit 2, naming the flag) before any model loads, and what reaches the engine."""

from __future__ import annotations

import pytest

CACHE_FLAGS = ("--disable-radix-cache", "--checkpoint-interval", "--radix-eviction-policy",
               "--radix-eviction-policy-config", "--enable-hierarchical-cache", "--enable-hicache", "--hicache-ratio",
               "--hicache-size", "--hicache-write-policy")
SCHED_FLAGS = ("--schedule-policy", "--enable-priority-scheduling", "--schedule-low-priority-values-first",
               "--priority-scheduling-preemption-threshold", "--disable-priority-preemption",
               "--default-priority-value", "--abort-on-priority-when-disabled", "--max-queued-requests",
               "--max-queued-tokens")


def invoke(*args: str):
    from typer.testing import CliRunner

    from trnrt.cli import app

    return CliRunner().invoke(app, ["serve", "--port", "0", *args], terminal_width=200, env={"COLUMNS": "200"})


@pytest.fixture
def captured(monkeypatch):
    """Engine.from_model_dir replaced: records its keywords, then stops the CLI (exit 2). Built in
    this process (the patch does not reach an engine process)."""
    import trnrt.cli.serve_engine as serve_mod
    from trnrt.engine.core import engine as engine_mod

    monkeypatch.setattr(serve_mod, "use_engine_process", lambda args: False)

    seen: dict = {}

    def fake_from_model_dir(model_dir=None, *, prefix_cache_config=None, **kw):
        seen.update(kw, prefix_cache_config=prefix_cache_config)
        raise ValueError("stop here")  # build_engine's ValueError path: exit 2, no server

    monkeypatch.setattr(engine_mod.Engine, "from_model_dir", staticmethod(fake_from_model_dir))
    return seen


def test_help_lists_every_flag():
    out = invoke("--help").output
    for flag in CACHE_FLAGS + SCHED_FLAGS:
        assert flag in out, flag
    assert "--no-disable-radix-cache" not in out  # plain switches, as in SGLang


@pytest.mark.parametrize("args,flag,text", [
    (["--enable-priority-scheduling", "--schedule-policy", "lpm"], "--schedule-policy",
     "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."),
    (["--enable-priority-scheduling", "--schedule-policy", "random"], "--schedule-policy", "must be 'fcfs' or 'lof'"),
    (["--schedule-policy", "priority"], "--schedule-policy", "not one of"),
    (["--schedule-policy", "sjf"], "--schedule-policy", "lof, random, shortest-prefill-first, spf"),
    (["--enable-priority-scheduling", "--schedule-policy", "spf"], "--schedule-policy",
     "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."),
    (["--max-queued-tokens", "0"], "--max-queued-tokens", ""),
    (["--max-queued-tokens", "-5"], "--max-queued-tokens", ""),
    (["--max-queued-tokens", "1.5"], "--max-queued-tokens", ""),
    (["--radix-eviction-policy", "mru"], "--radix-eviction-policy", "not one of"),
    (["--radix-eviction-policy-config", "{oops"], "--radix-eviction-policy-config", "not valid JSON"),
    (["--radix-eviction-policy-config", "[1, 2]"], "--radix-eviction-policy-config", "must be a JSON object"),
    (["--hicache-write-policy", "write_through_selective"], "--hicache-write-policy", "not one of"),
    (["--hicache-ratio", "0"], "--hicache-ratio", "must be > 0"),
    (["--hicache-size", "-1"], "--hicache-size", ""),
    (["--checkpoint-interval", "17"], "--checkpoint-interval", "multiple of the block size"),
    (["--checkpoint-interval", "-16"], "--checkpoint-interval", ""),
    (["--enable-hicache", "--disable-radix-cache"], "--enable-hierarchical-cache", "mutually exclusive"),
    (["--priority-scheduling-preemption-threshold", "x"], "--priority-scheduling-preemption-threshold", ""),
    (["--default-priority-value", "1.5"], "--default-priority-value", ""),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size", "positive number of tokens or -1"),
    (["--chunked-prefill-size", "65"], "--chunked-prefill-size", "exceeds the preset's largest prefill graph (64"),
    (["--chunked-prefill-size", "-1", "--max-num-batched-tokens", "4096"], "--chunked-prefill-size",
     "needs a preset whose largest prefill graph holds the context length"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens", ""),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_values_are_usage_errors(captured, args, flag, text):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert flag in r.output and text in " ".join(r.output.split()), r.output
    assert not captured  # refused before the engine (the model) was built


def test_flags_reach_the_engine(captured):
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.sched.scheduler import SchedulerConfig

    r = invoke("--checkpoint-interval", "64", "--num-checkpoints", "12", "--radix-eviction-policy", "slru",
               "--radix-eviction-policy-config", '{"protected_threshold": 4}', "--enable-hicache",
               "--hicache-ratio", "3", "--hicache-size", "2", "--hicache-write-policy", "write_back",
               "--schedule-policy", "lof", "--enable-priority-scheduling", "--schedule-low-priority-values-first",
               "--priority-scheduling-preemption-threshold", "5", "--disable-priority-preemption",
               "--default-priority-value", "-3", "--abort-on-priority-when-disabled", "--max-queued-requests", "7", "--max-queued-tokens", "300",
               "--max-running-requests", "4", "--max-num-batched-tokens", "100", "--chunked-prefill-size", "32")
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert captured["prefix_cache_config"] == PrefixCacheConfig(
        enabled=True, checkpoint_interval=64, num_checkpoints=12, eviction_policy="slru",
        eviction_policy_config={"protected_threshold": 4}, hierarchical=True, hicache_ratio=3.0, hicache_size_mb=2048, write_policy="write_back")
    scfg = captured["scheduler_config"]
    assert isinstance(scfg, SchedulerConfig)
    assert (scfg.schedule_policy, scfg.enable_priority_scheduling, scfg.schedule_low_priority_values_first,
            scfg.priority_preemption_threshold, scfg.disable_priority_preemption, scfg.default_priority_value,
            scfg.abort_on_priority_when_disabled, scfg.max_queued_requests, scfg.max_queued_tokens) == (
        "lof", True, True, 5, True, -3, True, 7, 300)
    assert scfg.max_num_seqs == 4 == captured["max_running_requests"]  # the preset's resolution is kept
    assert (scfg.max_num_batched_tokens, scfg.max_prefill_chunk_tokens, scfg.max_prefill_tokens) == (100, 32, 32)


def test_defaults_are_sglangs(captured):
    from trnrt.cli.server_args import ServerArgs
    from trnrt.engine.cache.cache_config import PrefixCacheConfig

    r = invoke()
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert captured["prefix_cache_config"] == PrefixCacheConfig()  # the radix cache is on, lru, no host tier
    scfg = captured["scheduler_config"]
    assert (scfg.schedule_policy, scfg.enable_priority_scheduling, scfg.priority_preemption_threshold,
            scfg.default_priority_value, scfg.max_queued_requests, scfg.max_queued_tokens) == (
        "fcfs", False, 10, None, None, None)
    # a full largest decode batch plus four largest prefill chunks (default: 32 + 4 x 64)
    assert (scfg.max_num_batched_tokens, scfg.max_prefill_chunk_tokens, scfg.chunked_prefill) == (288, 64, True)
    invoke("--disable-radix-cache")
    assert captured["prefix_cache_config"].enabled is False
    # admission: 2 x running without a queue limit; with one, the engine answers past it
    assert ServerArgs(max_running_requests=4).max_concurrent_requests == 8
    assert ServerArgs(max_running_requests=4, max_queued_requests=2).max_concurrent_requests == 4 + 2 + 8


def test_scripted_engine_gets_the_scheduling_flags(tok_dir):
    from trnrt.cli.server_args import ServerArgs
    from trnrt.cli.serve_engine import build_engine

    args = ServerArgs(model=str(tok_dir), scripted=True, max_running_requests=2, max_queued_requests=3,
                     enable_priority_scheduling=True, schedule_policy="lof", default_priority_value=1)
    engine, _ = build_engine(args)
    try:
        s = engine.scheduler_config
        assert (s.max_num_seqs, s.max_queued_requests, s.enable_priority_scheduling, s.schedule_policy,
                s.default_priority_value) == (2, 3, True, "lof", 1)
        assert engine.server_info()["scheduler_config"]["max_queued_requests"] == 3
    finally:
        engine.shutdown(0.0)



@pytest.mark.parametrize("name", ["spf", "shortest-prefill-first"])
def test_spf_alias_reaches_the_engine_as_sglangs_name(captured, name):
    r = invoke("--schedule-policy", name)
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert captured["scheduler_config"].schedule_policy == "shortest-prefill-first"


@pytest.mark.parametrize("field,value,flag", [("max_queued_tokens", -1, "--max-queued-tokens"),
                                              ("max_queued_tokens", 0, "--max-queued-tokens"),
                                              ("max_queued_requests", -1, "--max-queued-requests")])
def test_server_args_queue_limits_are_checked_naming_the_flag(field, value, flag):
    import typer

    from trnrt.cli.server_args import ServerArgs
    from trnrt.cli.server_configs import resolve_server_configs

    with pytest.raises(typer.BadParameter) as e:
        resolve_server_configs(ServerArgs(scripted=True, **{field: value}))
    assert e.value.param_hint == flag and str(value) in str(e.value)


def test_server_info_reports_spf_and_max_queued_tokens(tok_dir, tokenizer_factory):
    """/server_info: the launch options and the engine's scheduler_config, SGLang's policy name."""
    from serve_support import start_server, stop_server

    from trnrt.cli.server_args import ServerArgs
    from trnrt.cli.serve_engine import build_engine
    from trnrt.cli.server_configs import resolve_server_configs

    args = ServerArgs(model=str(tok_dir), scripted=True, schedule_policy="spf", max_queued_tokens=500)
    assert args.schedule_policy == "shortest-prefill-first"
    engine, _ = build_engine(args)
    srv = start_server(engine, tokenizer_factory, resolve_server_configs(args).settings)
    try:
        status, info, _ = srv.raw("GET", "/server_info")
        assert status == 200, info
        assert (info["schedule_policy"], info["max_queued_tokens"], info["max_queued_requests"]) == (
            "shortest-prefill-first", 500, None)
        s = info["scheduler_config"]
        assert (s["schedule_policy"], s["max_queued_tokens"]) == ("shortest-prefill-first", 500)
    finally:
        stop_server(srv)
