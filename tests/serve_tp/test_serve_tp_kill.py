"""Issue #31's acceptance, literally: killing one rank of `trnrt serve --tp-size 2` ends the server
within 10 s with a clear log line and a non-zero exit. Its own deployment (the shared TP=2 server
ends with its drain test, the two-node one with a lone failure on node 1): the plainest flags, one
test. SIGKILL worker rank 1 while a request streams: the request ends, nothing answers 200
afterwards, the server exits with code 3 (RankWatchdog on rank 0's node) and its log names the rank."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

from tp_support import ServeProcess, pid_alive, stop

MODEL = "trnrt-tiny"


def test_killing_a_rank_ends_the_server():
    sp = ServeProcess("--tp-size", "2", "--served-model-name", MODEL, "--context-length", "1024")
    srv = sp.server()
    try:
        (pid,) = sp.rank_pids().values()
        ended = threading.Event()

        def stream():  # a long request in flight when the rank dies
            try:
                srv.sse_events("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 900,
                                                   "stream": True, "ignore_eos": True}, timeout=30)
            except Exception:
                pass
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        statuses = []
        while sp.proc.poll() is None and time.monotonic() - t0 < 15:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=2)
                conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                             headers={"Content-Type": "application/json"})
                statuses.append((time.monotonic() - t0, conn.getresponse().status))
                conn.close()
            except OSError:
                pass
            time.sleep(0.05)
        code = sp.wait(15)
        elapsed = time.monotonic() - t0
        assert code == 3, sp.output()[-3000:]
        assert elapsed < 10, elapsed
        assert ended.wait(5), "the streaming request did not end"
        late = [s for t, s in statuses if t > 0.5]  # past the watchdog's poll: the engine is gone
        assert late and all(s == 503 for s in late), statuses
        assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in sp.output(), sp.output()[-4000:]
        assert not pid_alive(pid)
    finally:
        stop(sp)
