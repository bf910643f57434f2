"""Connections and protocol errors: idle connections cannot lock the server out, a per-client cap,
waitress' own errors in the JSON envelope, and a second signal that cuts the drain short."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request

import pytest

from serve_support import make_scripted_engine, spawn_serve


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _raw_request(port: int, data: bytes) -> tuple[int, dict | str]:
    s = _connect(port)
    s.sendall(data)
    chunks = []
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        chunks.append(b)
    s.close()
    raw = b"".join(chunks).decode("utf-8", "replace")
    head, _, body = raw.partition("\r\n\r\n")
    status = int(head.split()[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


@pytest.fixture(scope="module")
def capped_server(tokenizer_factory):
    """A server whose per-client cap is small enough to reach cheaply."""
    from trnrt.serve import ServeSettings, create_app
    from trnrt.serve.server import make_server, start_in_thread, stop_in_thread

    engine = make_scripted_engine(tokenizer_factory)
    app = create_app(engine, tokenizer_factory, ServeSettings(served_model_name="trnrt-tiny", max_request_bytes=4096))
    srv = make_server(app, host="127.0.0.1", port=0, max_connections_per_client=40)
    thread = start_in_thread(srv)
    yield srv
    engine.shutdown(0.0)
    stop_in_thread(srv, thread)


def test_300_idle_connections_do_not_stop_health_or_requests(scripted_server):
    idle = [_connect(scripted_server.port) for _ in range(300)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        status, _, _ = scripted_server.raw("GET", "/health", timeout=5)
        assert status == 200
        status, data, _ = scripted_server.raw("POST", "/v1/completions",
                                              {"model": "trnrt-tiny", "prompt": "hi", "max_tokens": 2}, timeout=5)
        assert status == 200, data
        assert time.monotonic() - t0 < 15  # not the 30 s drain (a loaded box took 9 s to exit)
    finally:
        for s in idle:
            s.close()


def test_per_client_connection_cap(capped_server):
    port = capped_server.effective_port
    held = [_connect(port) for _ in range(40)]
    try:
        time.sleep(0.1)
        status, data = _raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 429 and data["error"]["type"] == "rate_limit_error", data
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)  # the closes reach the main loop: the count goes back down
    status, _ = _raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200
    assert capped_server.client_counts.counts.get("127.0.0.1", 0) <= 1


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99999\r\n\r\n"
     + b"x" * 99999, 413),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300000 + b"\r\n\r\n", 431),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: bogus\r\n\r\n", 501),
], ids=["body-over-limit", "header-too-large", "bad-request-line", "bad-transfer-encoding"])
def test_protocol_errors_are_json(capped_server, request_bytes, status):
    got, data = _raw_request(capped_server.effective_port, request_bytes)
    assert got == status, data
    assert isinstance(data, dict) and data["error"]["code"] == status, data


def test_lowercase_method_is_405_json(capped_server):
    got, data = _raw_request(capped_server.effective_port, b"get /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert 400 <= got < 500 and isinstance(data, dict) and "error" in data, data


def test_second_signal_aborts_in_flight_at_once(tok_dir):
    """The first SIGTERM starts a 30 s drain; a second one aborts the stream at once (it ends with
    an error event and [DONE]) and the process exits 0 within a few seconds."""
    proc, url = spawn_serve(tok_dir, "--served-model-name", "tiny", "--scripted-step-delay", "0.05", "--drain-timeout", "30")
    try:
        body = json.dumps({"text": "SCRIPT:long " * 30, "stream": True,
                           "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(
            url + "/generate", data=body, headers={"Content-Type": "application/json"}), timeout=20)
        assert stream.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = stream.read().decode()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 15  # not the 30 s drain (a loaded box took 9 s to exit)
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(e[6:]) for e in rest.split("\n\n") if e.startswith("data: {")]
        last = events[-1]
        # the stream was cut: its last chunk is an abort, not a length finish after 400 tokens
        assert last.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort" or "error" in last, last
        assert len(last.get("output_ids", [])) < 400
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stopping_a_threaded_server_leaves_nothing_that_writes_to_its_old_fds(tokenizer_factory):
    """waitress' close() shuts the loop's wake-up pipe under live worker and loop threads; a late
    trigger pull then writes b"x" to a reused fd number (seen in CI as `xHTTP/1.1 400` on another
    server's fresh connection). stop_in_thread stops the workers and the loop before any fd closes."""
    from trnrt.serve import ServeSettings, create_app
    from trnrt.serve.server import make_server, start_in_thread, stop_in_thread

    engine = make_scripted_engine(tokenizer_factory)
    srv = make_server(create_app(engine, tokenizer_factory, ServeSettings(served_model_name="trnrt-tiny")),
                      host="127.0.0.1", port=0)
    thread = start_in_thread(srv, "waitress-stop-test")
    status, _ = _raw_request(srv.effective_port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200
    workers = list(srv.task_dispatcher.threads)
    assert workers
    idle = _connect(srv.effective_port)  # an open channel: the loop must close it itself
    try:
        engine.shutdown(0.0)
        stop_in_thread(srv, thread)
        assert not thread.is_alive()
        assert not srv.task_dispatcher.threads
        assert srv.trigger._closed and not srv._map
        assert idle.recv(1) == b""  # the idle client sees its connection closed
    finally:
        idle.close()
