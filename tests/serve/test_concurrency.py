"""Concurrency and disconnects on a real waitress server: 64 concurrent streams complete; clients that
leave (mid-stream, while queued, or during a non-streamed request) abort their requests, and the
engine ends idle with no page or slot in use."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from serve_support import assert_idle, counters, live, make_scripted_engine, start_server, stop_server

MODEL = "trnrt-tiny"


def stream_body(content: str, max_tokens: int, **kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": max_tokens, "stream_options": {"include_usage": True},
                       "chat_template_kwargs": {"enable_thinking": False}, **kw}).encode()


class RawStream:
    """A streaming POST over a raw socket, so a test can hang up exactly when it wants.

    (http.client hands a `Connection: close` socket to the response object, and dropping that
    object closes the socket: too implicit for disconnect tests.)
    """

    def __init__(self, port: int, body: bytes, path: str = "/v1/chat/completions", wait_headers: bool = True):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.sock.sendall(head + body)
        self.file = self.sock.makefile("rb")
        if wait_headers:  # (a streamed response's headers come with its first engine output)
            self.read_headers()

    def read_headers(self) -> None:
        status = self.file.readline()
        assert b" 200 " in status, status
        while self.file.readline() not in (b"\r\n", b""):
            pass  # headers

    def events(self, limit: int | None = None) -> list:
        """SSE `data:` payloads (parsed JSON, or "[DONE]") until [DONE], EOF or `limit` events.

        The body is chunked: chunk-size lines and blank lines are skipped; waitress writes each
        event as one chunk, so a data line is never split.
        """
        events = []
        while limit is None or len(events) < limit:
            line = self.file.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                events.append("[DONE]")
                break
            events.append(json.loads(data))
        return events

    def hang_up(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.file.close()
        self.sock.close()


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def slow_server(tokenizer_factory):
    from trnrt.serve import ServeSettings

    # 10 ms per decode step: a 400-token answer takes 4 s, so an abort is plainly visible. The real
    # scheduler runs behind the scripted runner: a step budget of 4096 tokens (the default preset's
    # is 64) admits all 64 prompts of test_64_concurrent_streams in one step, so they all run at once.
    engine = make_scripted_engine(tokenizer_factory, step_delay_s=0.01, max_running_requests=64,
                                  max_model_len=4096, max_num_batched_tokens=4096)
    server = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL))
    yield server
    stop_server(server)


def test_64_concurrent_streams(slow_server):
    from trnrt.serve import get_state

    state = get_state(slow_server.app)
    n, results, errors, peak = 64, {}, [], {"active": 0, "running": 0}
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            peak["active"] = max(peak["active"], state.active_requests)
            peak["running"] = max(peak["running"], live(slow_server)["running"])
            time.sleep(0.005)

    def client(i):
        try:
            st = RawStream(slow_server.port, stream_body(f"SCRIPT:long client {i}", 30))
            results[i] = st.events()
            st.hang_up()
        except Exception as e:  # collected and reported below
            errors.append((i, repr(e)))

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    # Hold the engine until all 64 requests are in, so they provably run at the same time.
    slow_server.engine.runner.paused.set()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: state.active_requests == n, 30.0, "all clients to be admitted")
        # and submitted: on a loaded box a client can still be tokenizing when the others are in,
        # and would start after the first ones finished (peak running n - 1)
        wait_for(lambda: slow_server.engine.load().num_pending_reqs == n, 30.0, "all requests to be submitted")
    finally:
        slow_server.engine.runner.paused.clear()
    for t in threads:
        t.join(60)
    stop.set()
    mon.join()
    assert not errors, errors[:3]
    assert len(results) == n
    texts = set()
    for events in results.values():
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finish == ["length"]
        assert events[-2]["usage"]["completion_tokens"] == 30
        texts.add("".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"]))
    assert len(texts) == 1  # every client got the same scripted answer, whole
    # The streams really overlapped (otherwise this test would pass on a 1-thread server).
    assert peak["active"] == n, peak
    assert peak["running"] == n, peak
    assert_idle(slow_server)


def test_disconnect_mid_stream_aborts(slow_server):
    before = counters(slow_server)["aborts"]
    streams = []
    for i in range(8):
        st = RawStream(slow_server.port, stream_body("SCRIPT:long bye", 400))
        assert len(st.events(4)) == 4
        streams.append(st)
    assert live(slow_server)["running"] == 8
    t0 = time.monotonic()
    for st in streams:
        st.hang_up()
    wait_for(lambda: counters(slow_server)["aborts"] >= before + 8, 3.0, "aborts")
    assert time.monotonic() - t0 < 2.0  # prompt: far below the 4 s the answers would take
    assert_idle(slow_server)


def test_disconnect_during_non_streamed_request_aborts(slow_server):
    before = counters(slow_server)["aborts"]
    sock = socket.create_connection(("127.0.0.1", slow_server.port), timeout=30)
    body = json.dumps({"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": "SCRIPT:long x"}]})
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    wait_for(lambda: live(slow_server)["running"] == 1, 3.0, "the request to run")
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    wait_for(lambda: counters(slow_server)["aborts"] == before + 1, 3.0, "the abort")
    assert_idle(slow_server)


def test_disconnect_while_queued_aborts(tokenizer_factory):
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory, step_delay_s=0.01, max_running_requests=1)
    server = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL))
    try:
        first = RawStream(server.port, stream_body("SCRIPT:long first", 400))
        first.events(2)
        second = RawStream(server.port, stream_body("SCRIPT:long second", 400), wait_headers=False)
        # no headers yet: a streamed response starts with the request's first engine output (so a
        # refusal before it is a plain HTTP error); the request waits for a slot
        wait_for(lambda: live(server)["queued"] == 1, 3.0, "the second request to queue")
        second.hang_up()
        wait_for(lambda: live(server)["queued"] == 0, 2.0, "the queued request to be aborted")
        assert live(server)["running"] == 1  # the first one goes on
        first.hang_up()
        assert_idle(server)
        assert counters(server)["aborts"] == 2
    finally:
        stop_server(server)
