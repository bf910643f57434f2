"""The engine core in its own process (trnrt.engine.core.mp_client / core_proc), driven through the
EngineClient protocol with the scripted engine of `trnrt serve --scripted` in the child: outputs
equal the in-process engine's, the engine's exceptions cross with their type and field, aborts
and flushes work, stats sections, speculative-decoding stats and finish records reach this side, a
dead engine process ends every open stream and refuses new work, and shutdown leaves no process or
thread behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trnrt.cli.server_args import ServerArgs
from trnrt.cli.serve_engine import build_engine, engine_core_factory
from trnrt.engine.core.client import EngineDeadError
from trnrt.engine.core.mp_client import MPEngineClient
from trnrt.engine.request import GenerateRequest, InvalidRequestError, SamplingParams


def _args(**kw) -> ServerArgs:
    return ServerArgs(scripted=True, max_running_requests=8, **kw)


def _collect(stream, timeout=30.0):
    outs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        o = stream.get(timeout=0.5)
        if o is None:
            continue
        outs.append(o)
        if o.finished:
            return outs
    raise AssertionError("stream did not finish")


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def spec_engine_factory(args: ServerArgs):
    """engine_core_factory's engine with speculative stats reported as a speculative engine reports
    them (module level: the spawned engine process imports it by name)."""
    engine = engine_core_factory(args)
    engine.stats_collector.set_speculative("NEXTN", 2)
    engine.stats_collector.on_spec_step(3, 6, 3, [2, 1])  # 3 verifies, 6 drafts, 3 accepted
    return engine


@pytest.fixture(scope="module")
def client():
    # The scripted engine of `trnrt serve --scripted`; its stats collector also holds a few
    # speculative-decoding figures (spec_engine_factory) for the test that checks they cross.
    c = MPEngineClient(spec_engine_factory, (_args(scripted_step_delay_s=0.002),))
    yield c
    c.shutdown(0.0)
    assert not c._proc.is_alive()


def _req(ids, n=8, rid=None, **sp):
    kw = {"request_id": rid} if rid else {}
    return GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=n, **sp), **kw)


def test_outputs_equal_the_in_process_engine(client):
    local, _ = build_engine(_args())
    try:
        ids = list(range(100, 140))
        want = _collect(local.submit(_req(ids, ignore_eos=True)))
        got = _collect(client.submit(_req(ids, ignore_eos=True)))
    finally:
        local.shutdown(0.0)
    assert [t for o in got for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
    assert "".join(o.new_text for o in got) == "".join(o.new_text for o in want)
    assert got[-1].finish_reason.type == want[-1].finish_reason.type == "length"
    assert got[-1].num_prompt_tokens == 40 and got[-1].num_output_tokens == 8
    assert client.model_info == local.model_info
    assert _wait(client.is_idle)


def test_engine_errors_cross_with_their_type_and_field(client):
    vocab = client.model_info.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        client.submit(_req([1, 2, vocab + 5]))
    assert e.value.field == "prompt_token_ids" and "outside the vocabulary" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        client.submit(_req([1, 2], temperature=-1.0))
    assert e.value.field == "temperature"
    assert client.is_idle()  # a refused submit leaves nothing registered
    # a duplicate id in flight, and one repeated inside a batch
    s = client.submit(_req(range(10, 20), n=200, rid="dup-1", ignore_eos=True))
    with pytest.raises(InvalidRequestError) as e:
        client.submit(_req([5], rid="dup-1"))
    assert e.value.field == "rid"
    with pytest.raises(InvalidRequestError):
        client.submit_many([_req([5], rid="dup-2"), _req([6], rid="dup-2")])
    client.abort("dup-1")
    outs = _collect(s)
    assert outs[-1].finish_reason.type == "abort"
    assert _wait(client.is_idle)


def test_abort_requests_flush_and_load(client):
    streams = [client.submit(_req(range(30, 40), n=500, rid=f"grp-{i}", ignore_eos=True)) for i in range(3)]
    assert _wait(lambda: client.load().num_running_reqs == 3)
    assert client.load().num_pending_reqs == 3
    assert client.flush_cache().ok is False  # busy: refused at once
    aborted = client.abort_requests("grp-", timeout_s=5.0)
    assert sorted(aborted) == ["grp-0", "grp-1", "grp-2"]
    for s in streams:
        assert _collect(s)[-1].finish_reason.type == "abort"
    assert _wait(client.is_idle)
    assert client.flush_cache(timeout_s=2.0).ok is True
    assert _wait(lambda: client.load().num_running_reqs == 0)
    fresh = client.load(fresh=True)
    assert fresh.num_running_reqs == 0 and fresh.max_running_requests == 8
    info = client.server_info()
    assert info["max_running_requests"] == 8 and info["served_model_name"] == client.model_info.served_model_name


def test_stats_sections_and_finish_records(client):
    records = []
    client.stats_collector.add_finish_listener(records.append)
    client.stats_collector.set_section("http_side", lambda: {"here": os.getpid()})
    _collect(client.submit(_req(range(50, 60), n=4, rid="rec-1", ignore_eos=True)))
    assert _wait(lambda: any(r.get("request_id") == "rec-1" for r in records))
    snap = client.stats()
    assert snap["engines"][0]["http_side"] == {"here": os.getpid()}
    assert snap["counters"]["requests_finished_total"] >= 1
    client.stats_collector.set_section("http_side", None)
    assert "http_side" not in client.stats()["engines"][0]


def test_speculative_stats_cross_the_process_boundary(client):
    """The /v1/stats snapshot is built in the engine process and sent whole (its `speculative`
    section with it); the load it publishes carries the accept length /server_info and /v1/loads
    read."""
    snap = client.stats()
    spec = snap["engines"][0]["speculative"]
    assert (spec["enabled"], spec["algorithm"], spec["num_steps"]) == (True, "NEXTN", 2)
    assert (spec["num_verifies"], spec["num_accepted_tokens"], spec["accepted_per_position"]) == (3, 3, [2, 1])
    assert spec["avg_accept_length"] == 2.0 and spec["accept_rate"] == 0.5
    assert snap["speculative"] == spec
    assert _wait(lambda: client.load().spec_accept_length == 2.0) and client.load().spec_accept_rate == 0.5


def test_dead_engine_process_ends_streams_and_refuses_work():
    c = MPEngineClient(engine_core_factory, (_args(scripted_step_delay_s=0.01),))
    try:
        s = c.submit(_req(range(10, 20), n=10_000, ignore_eos=True))
        assert s.get(timeout=10) is not None  # running
        os.kill(c.pid, signal.SIGKILL)
        last = _collect(s)[-1]
        assert last.finished and last.error and "engine process exited" in last.error
        assert last.finish_reason.status_code == 503
        assert not c.alive and c.is_idle()
        with pytest.raises(EngineDeadError):
            c.submit(_req([1, 2, 3]))
        assert c.abort_requests("x") == [] and c.flush_cache().ok is False
    finally:
        c.shutdown(0.0)
    assert not c._reader.is_alive() and not c._proc.is_alive()  # no thread or process left


def _failing_factory(message):
    raise ValueError(message)


def test_a_failing_factory_raises_its_own_error():
    with pytest.raises(ValueError, match="no such preset here"):
        MPEngineClient(_failing_factory, ("no such preset here",))


def test_shutdown_drains_in_flight_requests():
    c = MPEngineClient(engine_core_factory, (_args(scripted_step_delay_s=0.005),))
    s = c.submit(_req(range(10, 20), n=20, ignore_eos=True))
    c.shutdown(10.0)  # lets it finish
    outs = _collect(s)
    assert outs[-1].finish_reason.type == "length" and sum(len(o.new_token_ids) for o in outs) == 20
    assert not c._proc.is_alive()
    with pytest.raises(EngineDeadError):
        c.submit(_req([1]))
