"""The production log (TRNRT_PROD_DIR): a record per finished request, gauges, no request text,
size-bounded rotation, `no_logs` keeps a request out. One scripted server for the module."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from serve_support import make_scripted_engine, start_server, stop_server

SECRET = "zebra-quartz-prompt-marker"  # in every prompt: must never reach the files
OUTPUT_WORDS = ("Hello world", "How are you", "capital of France", "Paris")  # scripted outputs


@pytest.fixture(scope="module")
def logged(tokenizer_factory, tmp_path_factory):
    from trnrt.serve import ServeSettings, get_state

    d = tmp_path_factory.mktemp("prod")
    engine = make_scripted_engine(tokenizer_factory)
    server = start_server(engine, tokenizer_factory,
                          ServeSettings(served_model_name="trnrt-tiny", prod_dir=str(d), prod_gauges_s=0.2))
    plog = get_state(server.app).prod_log
    assert plog is not None and plog.path.parent == d
    yield server, plog, d
    stop_server(server)
    plog.close()


def _records(d, kind="request") -> list[dict]:
    out = []
    for f in sorted(d.glob("trnrt-prod-*.jsonl*")):
        out += [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
    return [r for r in out if r["type"] == kind]


def _wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def test_a_record_per_request_and_no_request_text(logged):
    server, plog, d = logged
    before = len(_records(d))
    sent = []  # (route, n choices, usage or None)
    st, body, _ = server.raw("POST", "/v1/chat/completions", {
        "model": "trnrt-tiny", "messages": [{"role": "user", "content": f"{SECRET} SCRIPT:reason"}]})
    assert st == 200, body
    sent.append(("/v1/chat/completions", 1, body["usage"], "stop"))
    st, body, _ = server.raw("POST", "/v1/completions", {
        "model": "trnrt-tiny", "prompt": f"{SECRET} one", "max_tokens": 3, "n": 2})
    assert st == 200, body
    sent.append(("/v1/completions", 2, body["usage"], "length"))
    st, body, _ = server.raw("POST", "/generate", {"text": f"{SECRET} two", "sampling_params": {"max_new_tokens": 4},
                                                  "rid": "my-rid-1"})
    assert st == 200, body
    sent.append(("/generate", 1, None, "length"))
    # streamed
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "trnrt-tiny", "stream": True, "messages": [{"role": "user", "content": f"{SECRET} three"}]}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and b"[DONE]" in resp.read()
    conn.close()
    sent.append(("/v1/chat/completions", 1, None, "stop"))
    # no_logs: kept out, on every route that reads a body
    for path, payload in (("/v1/chat/completions", {"model": "trnrt-tiny", "no_logs": True,
                                                    "messages": [{"role": "user", "content": f"{SECRET} x"}]}),
                          ("/generate", {"text": f"{SECRET} y", "no_logs": True, "rid": "kept-out"})):
        st, body, _ = server.raw("POST", path, payload)
        assert st == 200, body

    want = sum(n for _, n, _, _ in sent)
    _wait_for(lambda: plog.flush() and len(_records(d)) - before >= want)
    time.sleep(0.1)
    assert plog.flush()
    recs = _records(d)[before:]
    assert len(recs) == want, recs  # exactly one per engine request; the no_logs ones are absent
    assert "kept-out" not in {r["request_id"] for r in recs}
    by_route = {}
    for r in recs:
        by_route.setdefault(r["route"], []).append(r)
        for k in ("request_id", "route", "engine", "finish_reason", "prompt_tokens", "output_tokens",
                  "cached_tokens", "ttft_ms", "itl_ms", "e2e_ms", "queue_ms", "time_s", "choice", "choices"):
            assert k in r, (k, r)
        assert r["engine"] == "engine-0" and r["ttft_ms"] is not None and r["e2e_ms"] >= r["ttft_ms"] >= 0
        assert r["output_tokens"] >= 1 and r["prompt_tokens"] >= 1
    chat = by_route["/v1/chat/completions"]
    assert [r["stream"] for r in chat] == [False, True]
    assert chat[0]["prompt_tokens"] == sent[0][2]["prompt_tokens"]
    assert chat[0]["output_tokens"] == sent[0][2]["completion_tokens"]
    assert chat[0]["finish_reason"] == "stop" and chat[0]["itl_ms"] is not None
    comp = by_route["/v1/completions"]
    assert sorted(r["choice"] for r in comp) == [0, 1] and {r["choices"] for r in comp} == {2}
    assert sum(r["output_tokens"] for r in comp) == sent[1][2]["completion_tokens"] == 6
    assert {r["finish_reason"] for r in comp} == {"length"}
    (gen,) = by_route["/generate"]
    assert gen["request_id"] == "my-rid-1" and gen["output_tokens"] == 4

    # never any request text, prompt or output, in any file
    raw = "".join(f.read_text(encoding="utf-8") for f in d.glob("trnrt-prod-*"))
    assert SECRET not in raw
    for words in OUTPUT_WORDS:
        assert words not in raw


def test_client_abort_is_logged_as_abort(logged):
    server, plog, d = logged
    import socket

    before = len(_records(d))
    s = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"text": f"{SECRET} SCRIPT:long", "stream": True, "rid": "hangs-up",
                       "sampling_params": {"max_new_tokens": 400}})
    s.sendall((f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    s.recv(200)  # the stream started
    server.engine.runner.paused.set()  # hold the engine mid-answer: it cannot finish before the hang-up is seen
    try:
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        time.sleep(0.2)  # the worker notices the hang-up while the engine is held
    finally:
        server.engine.runner.paused.clear()
    _wait_for(lambda: any(r["request_id"] == "hangs-up" for r in _records(d)[before:]), timeout=10)
    (rec,) = [r for r in _records(d)[before:] if r["request_id"] == "hangs-up"]
    assert rec["finish_reason"] == "abort" and rec["route"] == "/generate"


def test_gauges_lines(logged):
    server, plog, d = logged
    _wait_for(lambda: len(_records(d, "gauges")) >= 2)
    g = _records(d, "gauges")[-1]
    (eng,) = g["engines"]
    assert eng["engine"] == "engine-0" and set(eng["live"]) >= {"running", "queued", "pages_used"}
    assert eng["counters"]["requests_arrived"] >= 1 and "p99" in eng["latency_ms"]["ttft_ms"]


def test_rotation_is_size_bounded(tmp_path):
    from trnrt.serve.prod_log import ProdLog

    plog = ProdLog(tmp_path, max_bytes=2048, backups=2, gauges_interval_s=60)
    for i in range(200):  # ~200 lines of ~200 bytes: far more than 3 files of 2 KiB
        plog.on_request_closed("/generate", [f"r{i}"])
    assert plog.flush()
    files = sorted(p.name for p in tmp_path.iterdir())
    name = plog.path.name
    assert files == sorted([name, name + ".1", name + ".2"])
    assert all(p.stat().st_size <= 2048 for p in tmp_path.iterdir())
    last = [json.loads(x) for x in plog.path.read_text().splitlines()]
    assert last[-1]["request_id"] == "r199" and plog.written == 200
    plog.close()


def test_join_in_either_order_and_caps(tmp_path):
    from trnrt.serve.prod_log import ProdLog
    from trnrt.stats import StatsCollector

    t = [0.0]
    c = StatsCollector(clock=lambda: t[0], wall_clock=lambda: 1.7e9, engine_id="e0")
    plog = ProdLog(tmp_path, gauges_interval_s=60, collector=c, pending_cap=4)
    c.on_request_arrived("a", 10)
    t[0] = 0.5
    c.on_request_scheduled("a")
    t[0] = 1.0
    c.on_tokens("a", 1)
    t[0] = 1.5
    c.on_tokens("a", 2)
    t[0] = 2.0
    c.on_request_finished("a", "length", num_cached_tokens=4)  # the engine first
    plog.on_request_closed("/v1/completions", ["a", "b"], stream=False)
    c.on_request_arrived("b", 5)
    c.on_request_finished("b", "abort")  # the HTTP close first
    plog.on_request_closed(None, ["probe"])  # an internal probe: never logged
    c.on_request_arrived("probe", 1)
    c.on_request_finished("probe", "stop")
    for i in range(10):  # engine finishes without an HTTP request: bounded
        c.on_request_arrived(f"x{i}", 1)
        c.on_request_finished(f"x{i}", "stop")
    assert len(plog._engine_side) == 4
    assert plog.flush()
    recs = [json.loads(x) for x in plog.path.read_text().splitlines()]
    assert [r["request_id"] for r in recs] == ["a", "b"]
    a = recs[0]
    assert (a["queue_ms"], a["ttft_ms"], a["itl_ms"], a["e2e_ms"]) == (500.0, 1000.0, 250.0, 2000.0)
    assert (a["prompt_tokens"], a["output_tokens"], a["cached_tokens"], a["engine"]) == (10, 3, 4, "e0")
    assert recs[1]["finish_reason"] == "abort" and recs[1]["ttft_ms"] is None
    plog.close()
    c.on_request_arrived("late", 1)
    c.on_request_finished("late", "stop")  # after close: the listener is gone
