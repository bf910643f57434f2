"""Admin and info routes (SGLang 0.5.23's): /abort_request, /flush_cache, /health_generate,
/model_info, /server_info (+ their deprecated /get_* names), /v1/loads, /get_load; their auth and
their bad inputs.

The servers here run the real Engine with a scripted runner (`Engine.scripted`), 10 ms per step, so
a 300-token answer lasts about 3 s and an abort, a refused flush or a health probe lands visibly
mid-stream. `any_server` adds the real tiny model for what only a model shows (config.json facts,
a real one-token generation).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from importlib import metadata

import pytest

from serve_support import (SCRIPTS, assert_idle, counters, live, make_scripted_engine, spawn_serve, start_server,
                           stop_server)

MODEL = "trnrt-tiny"
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")
FLUSH_BUSY = "Flush cache failed.\n"
FLUSH_TIMEOUT = "Timed out waiting for idle state."
FLUSH_IN_PROGRESS = "Another flush_cache is already in progress."

# SGLang 0.5.23's /model_info keys and /v1/loads core keys.
MODEL_INFO_KEYS = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}
LOAD_CORE_KEYS = {"timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
                  "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
                  "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
                  "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments"}
ROUTES = [("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/server_info"), ("GET", "/get_server_info"),
          ("GET", "/v1/loads"), ("GET", "/get_load"), ("GET", "/health_generate"), ("GET", "/flush_cache"),
          ("POST", "/flush_cache"), ("POST", "/abort_request")]
API_KEY, ADMIN_KEY = "sk-main-3f9a", "sk-admin-77c1"


def scripted_engine(tokenizer_factory, **kw):
    kw.setdefault("max_model_len", 4096)  # room for the 300-token streams
    return make_scripted_engine(tokenizer_factory, **kw)


@pytest.fixture(scope="module")
def srv(tokenizer_factory, tok_dir):
    """10 ms per step, 8 running at most; a 1 s health timeout keeps the 503 test short."""
    from trnrt.serve import ServeSettings

    engine = scripted_engine(tokenizer_factory, step_delay_s=0.01, max_running_requests=8)
    settings = ServeSettings(served_model_name=MODEL, tokenizer_path=str(tok_dir), max_concurrent_requests=16,
                             health_generate_timeout_s=1.0,
                             server_args={"host": "127.0.0.1", "port": 0, "threads": 24, "api_key": API_KEY})
    server = start_server(engine, tokenizer_factory, settings, threads=24)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def one_slot(tokenizer_factory):
    """One running request at most: a second one waits in the queue."""
    from trnrt.serve import ServeSettings

    engine = scripted_engine(tokenizer_factory, step_delay_s=0.01, max_running_requests=1)
    server = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, max_concurrent_requests=8),
                          threads=12)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def app_engine(tokenizer_factory):
    engine = scripted_engine(tokenizer_factory)
    yield engine
    engine.shutdown(0.0)


def app_client(engine, tokenizer_factory, **settings):
    """An in-process client (falcon.testing) of an app with these settings, over `engine`."""
    import falcon.testing

    from trnrt.serve import ServeSettings, create_app

    return falcon.testing.TestClient(create_app(engine, tokenizer_factory, ServeSettings(
        served_model_name=MODEL, **settings)), headers={"Host": "127.0.0.1"})


# --- helpers --------------------------------------------------------------------------------------
class Stream:
    """A streamed POST read event by event over a raw socket (so a test reads exactly as far as it wants)."""

    def __init__(self, port: int, path: str, body: dict):
        data = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
        self.file = self.sock.makefile("rb")
        status = self.file.readline()
        assert b" 200 " in status, status
        while self.file.readline() not in (b"\r\n", b""):
            pass

    def events(self, limit: int | None = None) -> list:
        out = []
        while limit is None or len(out) < limit:
            line = self.file.readline()
            if not line:
                break
            line = line.strip()
            if line.startswith(b"data: "):
                if line[6:] == b"[DONE]":
                    break
                out.append(json.loads(line[6:]))
        return out

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.file.close()
        self.sock.close()


def chat_stream(server, rid: str, max_tokens: int, script: str = "long") -> Stream:
    return Stream(server.port, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": f"SCRIPT:{script} go"}], "stream": True,
        "max_tokens": max_tokens, "rid": rid, "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False}})


def chat_text(events: list) -> tuple[str, str | None, dict | None]:
    """(content, finish_reason, usage) of a chat stream's events."""
    text, finish, usage = "", None, None
    for e in events:
        for c in e.get("choices", []):
            text += c["delta"].get("content") or ""
            finish = c.get("finish_reason") or finish
        usage = e.get("usage") or usage
    return text, finish, usage


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # reported by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result(timeout: float = 30.0):
        t.join(timeout)
        assert not t.is_alive(), "worker thread still running"
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result


# --- /abort_request -------------------------------------------------------------------------------
def test_abort_by_rid_prefix_mid_stream_ends_only_that_request(srv):
    long_text = SCRIPTS["long"]
    aborts0 = counters(srv)["aborts"]
    victim = chat_stream(srv, rid("victim"), max_tokens=300)
    try:
        head = victim.events(limit=6)
        bystander = in_thread(lambda: srv.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": "SCRIPT:long", "max_tokens": 40, "rid": rid("bystander")}))
        wait_for(lambda: live(srv)["running"] == 2, what="both requests running")
        status, body, headers = srv.raw("POST", "/abort_request", {"rid": "victim-"})  # a prefix of the id
        assert (status, body, headers.get("Content-Length")) == (200, None, "0")
        text, finish, usage = chat_text(head + victim.events())
    finally:
        victim.close()
    assert finish == "abort"
    assert text and long_text.startswith(text) and len(text) < len(long_text)  # its output so far
    assert 0 < usage["completion_tokens"] < 300
    b_status, b, _ = bystander()
    assert b_status == 200, b
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 40
    assert counters(srv)["aborts"] == aborts0 + 1  # the bystander was not aborted
    assert_idle(srv)  # pages and slots freed


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
def test_abort_non_streamed_returns_partial_output(srv, route):
    """A non-streamed request aborted mid-way is a 200 with the text so far and finish reason abort,
    in OpenAI's form (finish_reason "abort") and SGLang's (meta_info.finish_reason)."""
    r = rid("partial")
    if route == "/generate":
        body = {"text": "SCRIPT:long", "rid": r, "sampling_params": {"max_new_tokens": 300}}
    else:
        body = {"model": MODEL, "prompt": "SCRIPT:long", "max_tokens": 300, "rid": r}
    gen0 = counters(srv)["generation_tokens"]
    pending = in_thread(lambda: srv.raw("POST", route, body))
    wait_for(lambda: counters(srv)["generation_tokens"] >= gen0 + 10, what="ten tokens generated")
    assert srv.raw("POST", "/abort_request", {"rid": r})[0] == 200
    status, d, _ = pending()
    assert status == 200, d
    if route == "/generate":
        assert d["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted"}
        text, n = d["text"], d["meta_info"]["completion_tokens"]
    else:
        assert d["choices"][0]["finish_reason"] == "abort"
        text, n = d["choices"][0]["text"], d["usage"]["completion_tokens"]
    assert 10 <= n < 300 and text and SCRIPTS["long"].startswith(text)
    assert_idle(srv)


def test_abort_all_running_and_queued(one_slot):
    """abort_all ends the running request ("Aborted") and the queued one ("Abort in waiting queue")."""
    aborts0 = counters(one_slot)["aborts"]
    running = Stream(one_slot.port, "/generate", {"text": "SCRIPT:long", "stream": True, "rid": rid("run"),
                                                  "sampling_params": {"max_new_tokens": 300}})
    try:
        running.events(limit=3)
        queued = in_thread(lambda: one_slot.raw("POST", "/generate", {
            "text": "SCRIPT:long", "rid": rid("queued"), "sampling_params": {"max_new_tokens": 20}}))
        wait_for(lambda: live(one_slot)["queued"] == 1, what="a queued request")
        assert one_slot.raw("POST", "/abort_request", {"abort_all": True})[0] == 200
        last = running.events()[-1]
    finally:
        running.close()
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted"}
    assert last["text"] and SCRIPTS["long"].startswith(last["text"])
    status, d, _ = queued()
    assert status == 200, d
    assert d["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert d["text"] == "" and d["meta_info"]["completion_tokens"] == 0
    assert counters(one_slot)["aborts"] == aborts0 + 2
    assert_idle(one_slot)


def test_abort_matching_nothing_aborts_nothing(srv):
    """An empty rid without abort_all, or a prefix no request has, is a 200 that aborts nothing."""
    aborts0 = counters(srv)["aborts"]
    s = chat_stream(srv, rid("keep"), max_tokens=30)
    try:
        s.events(limit=2)
        for body in ({"rid": ""}, {}, {"rid": "no-such-request"}, {"rid": "", "abort_all": False},
                     {"rid": "keep-zzzzzzzzzz", "unknown_field": 1}):
            status, d, _ = srv.raw("POST", "/abort_request", body)
            assert (status, d) == (200, None), (body, d)
        text, finish, usage = chat_text(s.events())
    finally:
        s.close()
    assert finish == "length" and usage["completion_tokens"] == 30
    assert counters(srv)["aborts"] == aborts0
    assert_idle(srv)


# --- /flush_cache ---------------------------------------------------------------------------------
def test_flush_cache_idle_get_and_post(srv):
    assert_idle(srv)
    for method in ("GET", "POST"):
        status, body, headers = srv.raw(method, "/flush_cache")
        assert (status, body) == (200, FLUSH_OK)
        assert headers["Content-Type"].startswith("text/plain")
    assert srv.raw("POST", "/flush_cache?timeout=0")[:2] == (200, FLUSH_OK)


def test_flush_cache_refused_while_busy_then_waits_with_timeout(srv):
    s = chat_stream(srv, rid("busy"), max_tokens=40)
    try:
        s.events(limit=2)
        status, body, headers = srv.raw("GET", "/flush_cache")
        assert (status, body) == (400, FLUSH_BUSY) and headers["Content-Type"].startswith("text/plain")
        # ?timeout= waits for the work to end (about 0.4 s of decoding left), then flushes
        waiting = in_thread(lambda: (srv.raw("POST", "/flush_cache?timeout=20"), time.monotonic()))
        _, finish, usage = chat_text(s.events())
        ended = time.monotonic()
    finally:
        s.close()
    (status, body, _), answered = waiting()
    assert (status, body) == (200, FLUSH_OK)
    assert answered >= ended - 0.05  # it answered once the stream had ended, not before
    assert finish == "length" and usage["completion_tokens"] == 40  # the flush did not cut the stream
    assert_idle(srv)


def test_flush_cache_timeout_and_second_deferred_flush(srv):
    s = chat_stream(srv, rid("long"), max_tokens=300)
    try:
        s.events(limit=2)
        first = in_thread(lambda: srv.raw("GET", "/flush_cache?timeout=0.6"))
        time.sleep(0.2)  # the first deferred flush is registered
        assert srv.raw("GET", "/flush_cache?timeout=5")[:2] == (400, FLUSH_IN_PROGRESS)
        assert first()[:2] == (400, FLUSH_TIMEOUT)
        assert srv.raw("POST", "/abort_request", {"rid": "long-"})[0] == 200
        s.events()
    finally:
        s.close()
    assert_idle(srv)
    assert srv.raw("GET", "/flush_cache")[:2] == (200, FLUSH_OK)


# --- /health_generate -----------------------------------------------------------------------------
def test_health_generate_idle_really_generates(srv):
    assert_idle(srv)
    c0 = counters(srv)
    status, body, headers = srv.raw("GET", "/health_generate")
    assert (status, body) == (200, None)
    c1 = counters(srv)
    assert c1["requests_finished_total"] == c0["requests_finished_total"] + 1  # a real generation ran
    assert c1["generation_tokens"] == c0["generation_tokens"] + 1  # of one token
    assert_idle(srv)


def test_health_generate_answers_during_a_long_generation(srv):
    s = chat_stream(srv, rid("busy"), max_tokens=300)
    try:
        s.events(limit=2)
        t0 = time.monotonic()
        status, body, _ = srv.raw("GET", "/health_generate")
        elapsed = time.monotonic() - t0
        assert (status, body) == (200, None)
        assert elapsed < 0.5, elapsed  # steps are 10 ms: it did not wait behind the stream
        assert live(srv)["running"] == 1  # and the stream goes on
    finally:
        s.close()
    assert_idle(srv)


def test_health_generate_503_when_the_engine_is_stuck_or_shutting_down(srv):
    from trnrt.serve import get_state

    assert_idle(srv)
    srv.engine.runner.paused.set()  # the next step blocks: nothing is generated
    try:
        t0 = time.monotonic()
        status, body, _ = srv.raw("GET", "/health_generate")
        elapsed = time.monotonic() - t0
    finally:
        srv.engine.runner.paused.clear()
    assert status == 503 and "timed out" in body["error"]["message"], body
    assert 0.9 <= elapsed < 5, elapsed  # health_generate_timeout_s = 1
    assert_idle(srv)  # the probe was aborted or finished once the step ran
    state = get_state(srv.app)
    state.shutting_down.set()
    try:
        assert srv.raw("GET", "/health_generate")[0] == 503
    finally:
        state.shutting_down.clear()
    assert srv.raw("GET", "/health_generate")[0] == 200


# --- /model_info, /server_info --------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(srv, tok_dir, path):
    status, d, _ = srv.raw("GET", path)
    assert status == 200 and set(d) == MODEL_INFO_KEYS, d
    assert d["model_path"] == srv.engine.model_info.model_path and d["served_model_name"] == MODEL
    assert d["tokenizer_path"] == str(tok_dir)
    assert d["is_generation"] is True and d["preferred_sampling_params"] is None
    assert (d["weight_version"], d["disaggregation_mode"]) == ("default", "null")
    assert (d["reasoning_parser"], d["tool_call_parser"]) == ("glm45", "glm47")
    assert d["model_type"] is None and d["architectures"] is None  # a scripted engine has no config.json


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info(srv, path):
    status, d, _ = srv.raw("GET", path)
    assert status == 200, d
    _, loads, _ = srv.raw("GET", "/v1/loads")
    assert d["status"] == "ready" and d["version"] == metadata.version("trnrt")
    assert isinstance(d["max_total_num_tokens"], int) and d["max_total_num_tokens"] == \
        loads["loads"][0]["max_total_num_tokens"] > 0
    assert d["page_size"] == srv.engine.server_info()["page_size"]
    assert d["served_model_name"] == MODEL and d["context_length"] == 4096 and d["max_req_input_len"] == 4095
    assert d["max_running_requests"] == 8 and d["max_concurrent_requests"] == 16
    assert (d["tool_call_parser"], d["reasoning_parser"]) == ("glm47", "glm45")
    assert (d["host"], d["threads"], d["port"]) == ("127.0.0.1", 24, int(srv.port))  # port 0 resolved
    assert d["preset"] == "default" and d["backend"] == "scripted" and "engine_config" in d
    (state,) = d["internal_states"]
    assert state["avg_spec_accept_length"] is None and state["last_gen_throughput"] >= 0
    assert state["memory_usage"]["token_capacity"] == d["max_total_num_tokens"]
    assert state["max_running_requests"] == 8 and state["page_size"] == d["page_size"]
    # never the key, under any name
    raw = json.dumps(d)
    assert API_KEY not in raw and "api_key" not in raw


def test_real_model_info_server_info_and_health(any_server):
    status, d, _ = any_server.raw("GET", "/model_info")
    assert status == 200 and set(d) == MODEL_INFO_KEYS
    if any_server.engine.model_info.backend != "scripted":
        assert d["model_type"] == "glm5_next" and d["architectures"] == ["Glm5NextForConditionalGeneration"]
        assert d["tokenizer_path"] == d["model_path"]  # the server loads the checkpoint's tokenizer
    status, info, _ = any_server.raw("GET", "/server_info")
    assert status == 200 and info["internal_states"][0]["avg_spec_accept_length"] is None
    assert_idle(any_server)
    n0 = counters(any_server)["requests_finished_total"]
    assert any_server.raw("GET", "/health_generate")[0] == 200
    assert counters(any_server)["requests_finished_total"] == n0 + 1
    assert_idle(any_server)


# --- /v1/loads, /get_load -------------------------------------------------------------------------
def test_loads_sections(srv):
    status, d, _ = srv.raw("GET", "/v1/loads")
    assert status == 200 and set(d) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert d["version"] == metadata.version("trnrt")
    assert (d["accelerator"], d["num_accelerators"]) == (None, 0)  # the scripted engine is on the CPU
    from datetime import datetime
    datetime.fromisoformat(d["timestamp"])
    (entry,) = d["loads"]
    # default = all: every section that exists here; no speculative decoding, no LoRA
    assert set(entry) == LOAD_CORE_KEYS | {"memory", "disaggregation", "queues", "prefix_cache"}
    assert entry["dp_rank"] == 0 and entry["max_running_requests"] == 8
    assert set(entry["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    assert entry["memory"]["token_capacity"] == entry["max_total_num_tokens"]
    assert entry["disaggregation"]["mode"] == "null"
    for include, extra in [("core", set()), ("queues", {"queues"}), ("core,memory", {"memory"}),
                           ("memory&include=disagg", {"memory", "disaggregation"}), ("spec,lora", set()),
                           ("all", {"memory", "disaggregation", "queues", "prefix_cache"}),
                           ("cache", {"prefix_cache"}),
                           ("", {"memory", "disaggregation", "queues", "prefix_cache"})]:
        status, d, _ = srv.raw("GET", f"/v1/loads?include={include}")
        assert status == 200 and set(d["loads"][0]) == LOAD_CORE_KEYS | extra, include
    assert len(srv.raw("GET", "/v1/loads?dp_rank=0")[1]["loads"]) == 1
    assert srv.raw("GET", "/v1/loads?dp_rank=1")[1]["loads"] == []  # SGLang: an out-of-range rank, no loads
    assert srv.raw("GET", "/v1/loads?dp_rank=-1")[1]["loads"] == []


def test_loads_and_get_load_mid_stream_and_prometheus(srv):
    from prometheus_client.parser import text_string_to_metric_families

    s = chat_stream(srv, rid("load"), max_tokens=300)
    try:
        s.events(limit=3)
        _, d, _ = srv.raw("GET", "/v1/loads?include=core")
        status, text, headers = srv.raw("GET", "/v1/loads?format=prometheus")
        _, gl, _ = srv.raw("GET", "/get_load")
    finally:
        s.close()
    (e,) = d["loads"]
    assert e["num_running_reqs"] == 1 and e["num_used_tokens"] > 0 and 0 < e["token_usage"] < 1
    assert e["num_active_tokens"] > 0 and e["num_total_tokens"] >= e["num_active_tokens"]
    assert e["utilization"] == round(max(1 / 8, e["token_usage"] / 0.9), 4)
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    gauges = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(f.type == "gauge" for f in gauges.values())
    sample = gauges["sglang_num_running_reqs"].samples[0]
    assert sample.labels == {"dp_rank": "0"} and sample.value == 1
    assert 'sglang_num_running_reqs{dp_rank="0"} 1\n' in text
    assert gauges["sglang_queues_waiting"].samples[0].value == 0
    assert "sglang_memory_token_capacity" in gauges and "sglang_disagg_decode_transfer_queue_reqs" in gauges
    assert "sglang_dp_rank" not in gauges and "sglang_total_prefill_busy_us" not in gauges  # labels / nulls
    assert gl == [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": gl[0]["num_tokens"]}]
    assert gl[0]["num_tokens"] > 0
    assert srv.raw("GET", "/v1/loads?format=prometheus&dp_rank=3")[1] == "\n"
    assert_idle(srv)
    assert srv.raw("GET", "/get_load")[1] == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


# --- speculative decoding stats on every route -----------------------------------------------------
def test_speculative_stats_on_every_route(tokenizer_factory):
    """The engine's stats collector fed as a speculative engine feeds it (set_speculative at start,
    on_spec_step per verifying step): /v1/stats, /server_info, /v1/loads (JSON and Prometheus) and
    /metrics report it; off (the default) and before the first verify they report nothing made up."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = scripted_engine(tokenizer_factory)
    stats = engine.stats_collector

    def published(length) -> bool:  # the engine publishes its load after each step or idle turn
        deadline = time.monotonic() + 5.0
        while engine.load().spec_accept_length != length:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def routes() -> tuple[dict, object, dict, str, str]:
        spec = client.simulate_get("/v1/stats").json["engines"][0]["speculative"]
        accept = client.simulate_get("/server_info").json["internal_states"][0]["avg_spec_accept_length"]
        (entry,) = client.simulate_get("/v1/loads").json["loads"]
        loads_prom = client.simulate_get("/v1/loads", params={"format": "prometheus"}).text
        return spec, accept, entry, loads_prom, client.simulate_get("/metrics").text

    try:
        client = app_client(engine, tokenizer_factory)
        spec, accept, entry, loads_prom, metrics = routes()  # off
        assert spec["enabled"] is False and spec["avg_accept_length"] is None and accept is None
        assert "speculative" not in entry and "sglang_spec_" not in loads_prom and "trnrt_spec_" not in metrics

        stats.set_speculative("NEXTN", 3)
        assert published(None)
        spec, accept, entry, loads_prom, metrics = routes()  # on, nothing verified yet
        assert (spec["enabled"], spec["algorithm"], spec["num_steps"], spec["num_verifies"]) == (True, "NEXTN", 3, 0)
        assert spec["avg_accept_length"] is None and spec["accept_rate"] is None and accept is None
        assert "speculative" not in entry  # SGLang leaves the section out before the first verify
        assert "trnrt_spec_accept_length{" in metrics and "trnrt_spec_decode_num_drafts_total{" in metrics

        stats.on_spec_step(4, 12, 6, [3, 2, 1])
        stats.on_spec_step(2, 6, 4, [2, 1, 1])  # 6 verifies, 18 drafts, 10 accepted
        assert published(16 / 6)
        spec, accept, entry, loads_prom, metrics = routes()
        assert (spec["num_verifies"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (6, 18, 10)
        assert spec["avg_accept_length"] == 16 / 6 and spec["accept_rate"] == 10 / 18
        assert spec["accepted_per_position"] == [5, 3, 2] and spec["windows"]["1m"]["num_verifies"] == 6
        assert accept == 16 / 6  # what bench_serving reads
        assert entry["speculative"] == {"accept_length": 2.6667, "accept_rate": 0.5556}
        inc = client.simulate_get("/v1/loads", params={"include": "spec"}).json["loads"][0]
        assert set(inc) == LOAD_CORE_KEYS | {"speculative"}
        assert 'sglang_spec_accept_length{dp_rank="0"} 2.6667' in loads_prom
        fams = {f.name: f for f in text_string_to_metric_families(metrics)}
        values = {name: fams[name].samples[0].value for name in (
            "trnrt_spec_decode_num_drafts", "trnrt_spec_decode_num_draft_tokens",
            "trnrt_spec_decode_num_accepted_tokens", "trnrt_spec_accept_length")}
        assert values == {"trnrt_spec_decode_num_drafts": 6, "trnrt_spec_decode_num_draft_tokens": 18,
                          "trnrt_spec_decode_num_accepted_tokens": 10, "trnrt_spec_accept_length": 16 / 6}
        per_pos = {s.labels["position"]: s.value for s in fams["trnrt_spec_decode_num_accepted_tokens_per_pos"].samples}
        assert per_pos == {"0": 5, "1": 3, "2": 2}
    finally:
        engine.shutdown(0.0)


# --- auth -----------------------------------------------------------------------------------------
def _call(client, method: str, path: str, key: str | None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"rid": "nothing-matches"}) if path == "/abort_request" else None
    return client.simulate_request(method, path, headers=headers, body=body)


def test_api_key_covers_every_admin_route(app_engine, tokenizer_factory):
    client = app_client(app_engine, tokenizer_factory, api_key=API_KEY)
    for method, path in ROUTES:
        r = _call(client, method, path, None)
        assert r.status_code == 401 and r.json["error"]["type"] == "authentication_error", (method, path)
        assert _call(client, method, path, "wrong").status_code == 401, (method, path)
        assert _call(client, method, path, API_KEY).status_code == 200, (method, path)
    assert client.simulate_get("/health").status_code == 200  # still open


def test_admin_api_key_replaces_api_key_on_admin_routes(app_engine, tokenizer_factory):
    """SGLang's rule: with --admin-api-key, /flush_cache and /abort_request need it (the API key is
    refused there); every other route needs the API key (the admin key is refused there)."""
    both = app_client(app_engine, tokenizer_factory, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    admin_only = app_client(app_engine, tokenizer_factory, admin_api_key=ADMIN_KEY)
    for method, path in ROUTES:
        if path in ("/flush_cache", "/abort_request"):
            assert _call(both, method, path, ADMIN_KEY).status_code == 200, (method, path)
            assert _call(both, method, path, API_KEY).status_code == 401, (method, path)
            assert _call(admin_only, method, path, None).status_code == 401, (method, path)
            assert _call(admin_only, method, path, ADMIN_KEY).status_code == 200, (method, path)
        else:
            assert _call(both, method, path, API_KEY).status_code == 200, (method, path)
            assert _call(both, method, path, ADMIN_KEY).status_code == 401, (method, path)
            assert _call(admin_only, method, path, None).status_code == 200, (method, path)  # no API key set
    assert both.simulate_get("/health").status_code == 200


# --- bad input ------------------------------------------------------------------------------------
BAD = [
    # (method, path, body, status, param)
    ("GET", "/flush_cache?timeout=abc", None, 400, "timeout"),
    ("GET", "/flush_cache?timeout=-1", None, 400, "timeout"),
    ("POST", "/flush_cache?timeout=nan", None, 400, "timeout"),
    ("GET", "/flush_cache?timeout=inf", None, 400, "timeout"),
    ("GET", "/flush_cache?timeout=1&timeout=2", None, 400, "timeout"),
    ("GET", "/v1/loads?include=bogus", None, 400, "include"),
    ("GET", "/v1/loads?include=core,,memory", None, 400, "include"),
    ("GET", "/v1/loads?include=CORE", None, 400, "include"),
    ("GET", "/v1/loads?dp_rank=x", None, 400, "dp_rank"),
    ("GET", "/v1/loads?dp_rank=1.5", None, 400, "dp_rank"),
    ("GET", "/v1/loads?format=xml", None, 400, "format"),
    ("POST", "/abort_request", {"rid": 5}, 400, "rid"),
    ("POST", "/abort_request", {"rid": ["a"]}, 400, "rid"),
    ("POST", "/abort_request", '{"rid": "\\ud800"}', 400, "rid"),
    ("POST", "/abort_request", {"abort_all": "yes"}, 400, "abort_all"),
    ("POST", "/abort_request", {"rid": "", "abort_all": 1}, 400, "abort_all"),
    ("POST", "/abort_request", "{not json", 400, None),
    ("POST", "/abort_request", "[]", 400, None),
    ("POST", "/abort_request", "", 400, None),
    ("POST", "/abort_request", '{"abort_all": NaN}', 400, None),
    ("GET", "/abort_request", None, 405, None),
    ("POST", "/model_info", None, 405, None),
    ("PUT", "/server_info", None, 405, None),
    ("DELETE", "/flush_cache", None, 405, None),
    ("POST", "/health_generate", None, 405, None),
    ("POST", "/v1/loads", None, 405, None),
    ("POST", "/get_load", None, 405, None),
    ("POST", "/get_server_info", None, 405, None),
]


@pytest.mark.parametrize("method,path,body,status,param", BAD, ids=[f"{m} {p} {b!r}"[:60] for m, p, b, *_ in BAD])
def test_bad_input(srv, method, path, body, status, param):
    got, d, headers = srv.raw(method, path, body)
    assert got == status, d
    assert headers["Content-Type"].startswith("application/json")
    assert isinstance(d, dict) and isinstance(d["error"]["message"], str), d
    if param is not None:
        assert d["error"]["param"] == param, d


def test_abort_request_needs_a_json_content_type(srv):
    got, d, _ = srv.raw("POST", "/abort_request", '{"abort_all": true}', headers={"Content-Type": "text/plain"})
    assert got == 415 and d["error"]["param"] == "Content-Type"


def test_server_still_serves_after_bad_input(srv):
    for method, path, body, *_ in BAD:
        srv.raw(method, path, body)
    assert counters(srv)["errors"] == 0
    assert srv.raw("GET", "/health")[0] == 200
    assert srv.raw("GET", "/flush_cache")[:2] == (200, FLUSH_OK)
    assert srv.raw("GET", "/health_generate")[0] == 200
    assert_idle(srv)


def test_cli_admin_api_key_and_reported_settings(tok_dir):
    """`trnrt serve --api-key K --admin-api-key A`: /server_info reports the launch options and the
    tokenizer directory but neither key; /flush_cache takes A, not K."""
    import signal
    import urllib.error
    import urllib.request

    proc, url = spawn_serve(tok_dir, "--threads", "6", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)

    def get(url: str, key: str):
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        status, text = get(url + "/server_info", API_KEY)
        assert status == 200, text
        assert API_KEY not in text and ADMIN_KEY not in text and "api_key" not in text
        info = json.loads(text)
        assert info["threads"] == 6 and info["scripted"] is True and info["port"] == int(url.rsplit(":", 1)[1])
        assert info["tokenizer_path"] == str(tok_dir) and info["model_path"] == str(tok_dir)
        assert get(url + "/flush_cache", ADMIN_KEY)[0] == 200
        assert get(url + "/flush_cache", API_KEY)[0] == 401
        assert get(url + "/server_info", ADMIN_KEY)[0] == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
