"""`trnrt serve --dp 2`: two scripted engines behind sglang-router, end to end (real processes).

One deployment, one test running the checks in order (starting two engines takes most of the
time on a small box; pytest-xdist never splits one test). The last two checks kill and drain an
engine; the others leave both up.
The end-to-end tests need sglang-router (the `router` extra, also in the test extra); the
CLI tests at the top do not.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

from trnrt.cli import app  # noqa: E402
from trnrt.serve import dp  # noqa: E402

HAVE_ROUTER = importlib.util.find_spec("sglang_router") is not None
needs_router = pytest.mark.skipif(not HAVE_ROUTER, reason="sglang_router is not installed (pip install -e '.[router]')")
MODEL = "trnrt-tiny"


# -- the CLI (no processes) ---------------------------------------------------------------------

def test_dp_without_router_says_how_to_install_and_exits_2(monkeypatch, tok_dir):
    monkeypatch.setattr(dp, "router_available", lambda: False)
    r = CliRunner().invoke(app, ["serve", "--dp", "2", "--scripted", "--model", str(tok_dir), "--port", "0"])
    assert r.exit_code == 2, r.output
    assert "pip install -e '.[router]'" in r.output and "sglang-router==0.3.2" in r.output


def test_dp_passes_engine_options_and_keeps_keys_off_the_command_line(monkeypatch, tok_dir):
    seen = {}
    monkeypatch.setattr(dp, "router_available", lambda: True)
    monkeypatch.setattr(dp, "run", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    r = CliRunner().invoke(app, ["serve", "--dp", "3", "--scripted", "--model", str(tok_dir), "--port", "0",
                                 "--host", "127.0.0.1", "--max-running-requests", "8", "--disable-radix-cache",
                                 "--api-key", "sekrit", "--router-policy", "manual"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (cfg.dp, cfg.router_policy, cfg.api_key, cfg.max_running_requests) == (3, "manual", "sekrit", 8)
    assert cfg.port > 0
    args = cfg.engine_args
    assert "--dp" not in args and "--host" not in args and "--port" not in args and "sekrit" not in args
    assert args[args.index("--model") + 1] == str(tok_dir)
    assert args[args.index("--max-running-requests") + 1] == "8"
    assert "--scripted" in args and "--disable-radix-cache" in args
    cmd = dp.router_command(cfg, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 29000)
    assert "sekrit" not in cmd and "--disable-circuit-breaker" in cmd
    assert cmd[cmd.index("--policy") + 1] == "manual"
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--balance-abs-threshold") + 1] == "4"  # half of --max-running-requests


def test_dp_refuses_an_unknown_router_policy(tok_dir):
    r = CliRunner().invoke(app, ["serve", "--dp", "2", "--scripted", "--model", str(tok_dir), "--router-policy", "nope"])
    assert r.exit_code == 2
    assert "--router-policy" in r.output


# -- helpers ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(base: str, method: str, path: str, body=None, timeout: float = 30.0, headers: dict | None = None):
    """(status, parsed JSON body or text); the response headers go into `headers` when given."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read().decode()
        if headers is not None:
            headers.update({k.lower(): v for k, v in r.getheaders()})
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw
    finally:
        conn.close()


def stream(base: str, path: str, body: dict) -> tuple[int, list]:
    """(status, the SSE `data:` payloads, parsed, up to [DONE])."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        events = []
        for line in r.read().decode().splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return r.status, events
    finally:
        conn.close()


def finished(engine_url: str) -> int:
    return request(engine_url, "GET", "/v1/stats")[1]["counters"]["requests_finished_total"]


def engine_pid(port: int) -> int:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(d)
    raise AssertionError(f"no engine process on port {port}")


def workers(router: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in request(router, "GET", "/workers")[1]["workers"]}


class Deployment:
    def __init__(self, proc, url, log_path):
        self.proc, self.url, self.log_path = proc, url, log_path
        self.engines = sorted(workers(url))

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def deployment(tok_dir, tmp_path_factory):
    if not HAVE_ROUTER:
        pytest.skip("sglang_router is not installed")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("dp") / "supervisor.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trnrt", "serve", "--dp", "2", "--scripted", "--model", str(tok_dir),
             "--port", str(port), "--max-running-requests", "4", "--scripted-step-delay", "0.002",
             "--max-queued-requests", "2", "--drain-timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while f"ready at {url}" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("trnrt serve --dp 2 did not become ready:\n" + log_path.read_text(errors="replace"))
        time.sleep(0.1)
    d = Deployment(proc, url, log_path)
    try:
        assert len(d.engines) == 2 and all(workers(url).values())
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # drain the engines, then stop the router
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError("the supervisor did not stop on SIGTERM:\n" + d.log())
            assert code == 0, d.log()
            for e in d.engines:  # nothing left listening
                with pytest.raises(OSError):
                    socket.create_connection(("127.0.0.1", int(e.rsplit(":", 1)[1])), timeout=1).close()


# -- through the router -------------------------------------------------------------------------

def _chat_completions_and_generate_plain_and_streamed(deployment):
    u = deployment.url
    s, b = request(u, "POST", "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert s == 200, b
    assert b["choices"][0]["finish_reason"] and b["usage"]["completion_tokens"] > 0  # the text may be all reasoning
    s, ev = stream(u, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True})
    assert s == 200 and ev[-1] == "[DONE]"
    assert any(e["choices"][0].get("finish_reason") for e in ev[:-1] if e.get("choices")), ev

    s, b = request(u, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 8})
    assert s == 200 and b["choices"][0]["text"], b
    s, ev = stream(u, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": True})
    assert s == 200 and ev[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in ev[:-1] if e.get("choices"))

    s, b = request(u, "POST", "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 8}})
    assert s == 200 and b["text"] and b["meta_info"]["completion_tokens"] > 0, b
    s, ev = stream(u, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 8}, "stream": True})
    assert s == 200 and ev[-1] == "[DONE]" and ev[-2]["text"] == b["text"]

    s, b = request(u, "GET", "/v1/models")
    assert s == 200 and [m["id"] for m in b["data"]] == [MODEL]


def _a_repeated_long_prefix_lands_on_one_engine(deployment):
    before = {e: finished(e) for e in deployment.engines}
    prefix = f"{uuid.uuid4().hex} You are a coding agent working in a repository. " * 8
    for i in range(6):
        s, b = request(deployment.url, "POST", "/generate",
                       {"text": f"{prefix} step {i}", "sampling_params": {"max_new_tokens": 2}})
        assert s == 200, b
    got = sorted(finished(e) - before[e] for e in deployment.engines)
    assert got == [0, 6], got


def _get_load_moves_with_traffic(deployment):
    e = deployment.engines[0]
    assert request(e, "GET", "/get_load")[1][0]["num_tokens"] == 0
    done = threading.Event()

    def busy():
        request(e, "POST", "/generate", {"text": "a long busy request " * 20,
                                         "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
        done.set()

    threading.Thread(target=busy, daemon=True).start()
    peak = 0
    while not done.is_set():
        peak = max(peak, request(e, "GET", "/get_load")[1][0]["num_tokens"])
        time.sleep(0.01)
    assert peak > 0
    assert request(e, "GET", "/get_load")[1][0]["num_tokens"] == 0


def _flush_cache_reaches_both_engines(deployment):
    s, b = request(deployment.url, "POST", "/flush_cache")
    assert s == 200 and b["workers_flushed"] == 2, b
    for e in deployment.engines:
        cache = request(e, "GET", "/v1/loads?include=cache")[1]["loads"][0].get("prefix_cache")
        assert cache is None or cache["num_cached_pages"] == 0, cache


def _client_errors_do_not_make_the_router_refuse_valid_requests(deployment):
    bad = {"model": MODEL, "prompt": "hi", "max_tokens": 100000}  # over the context length: the engine's 400
    for _ in range(50):
        s, b = request(deployment.url, "POST", "/v1/completions", bad)
        assert s == 400 and b["error"]["param"] == "max_tokens", b
    for i in range(6):
        s, b = request(deployment.url, "POST", "/v1/completions", {"model": MODEL, "prompt": f"ok {i}", "max_tokens": 4})
        assert s == 200, b
    assert all(workers(deployment.url).values())


def _concurrently(n: int, fn) -> list:
    out: list = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i)), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


LONG = {"max_new_tokens": 150, "ignore_eos": True}


def _a_full_queue_is_a_503_the_router_retries_not_a_dead_engine(deployment):
    e = deployment.engines[1]
    health = []

    def direct(i):
        if i == 0:  # meanwhile the engine stays healthy: the router keeps it in rotation
            time.sleep(0.2)
            health.append(request(e, "GET", "/health")[0])
            return None
        h: dict = {}
        s, _ = request(e, "POST", "/generate", {"text": f"direct {i}", "sampling_params": LONG}, headers=h)
        return s, h

    got = [r for r in _concurrently(13, direct) if r is not None]
    full = [h for s, h in got if s == 503]
    assert full and all(s in (200, 503) for s, _ in got), got  # 4 running + 2 queued: the rest are refused
    assert all("x-trnrt-queue-full" in h and "retry-after" in h for h in full)
    assert health == [200]
    # through the router, the same overflow is retried (on the other engine, or later) until served
    got = _concurrently(16, lambda i: request(deployment.url, "POST", "/generate",
                                              {"text": f"routed {i} {uuid.uuid4().hex}", "sampling_params": LONG})[0])
    assert got == [200] * 16, got
    assert all(workers(deployment.url).values())


def _sigkill_of_an_engine_under_load_loses_no_request(deployment):
    u = deployment.url
    results: list[tuple[float, float, int]] = []  # (start, end, status)
    stop = threading.Event()

    def client(k: int):
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                s, _ = request(u, "POST", "/generate", {"text": f"client {k} request {i} {uuid.uuid4().hex}",
                                                       "sampling_params": {"max_new_tokens": 24}}, timeout=20)
            except OSError:
                s = -1
            results.append((t0, time.monotonic(), s))
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = deployment.engines[0]
    vport = int(victim.rsplit(":", 1)[1])
    os.kill(engine_pid(vport), signal.SIGKILL)
    killed_at = time.monotonic()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    statuses = [s for _, _, s in results]
    assert statuses and all(s == 200 for s in statuses), statuses  # none lost, before, during or after
    after = [(t0, t1) for t0, t1, _ in results if t0 > killed_at]
    assert after and max(t1 - t0 for t0, t1 in after) < 5.0
    assert any(t1 - killed_at < 5.0 for _, t1 in after)

    # the supervisor restarts it on the same port; the router's health checks bring it back
    deadline = time.monotonic() + 40
    while not (workers(u).get(victim) and request(victim, "GET", "/health")[0] == 200):
        assert time.monotonic() < deadline, deployment.log()
        time.sleep(0.2)
    assert re.search(rf"engine \d \({re.escape(victim)}\) exited with code -9; restarting", deployment.log())
    assert re.search(rf"engine \d serving again at {re.escape(victim)}", deployment.log())
    # fresh prompts (no prefix match) go to the engine with the fewest requests in flight
    got = _concurrently(8, lambda i: request(u, "POST", "/generate", {"text": f"fresh {i} {uuid.uuid4().hex}",
                                                                      "sampling_params": {"max_new_tokens": 40}})[0])
    assert got == [200] * 8
    assert finished(victim) > 0, "the restarted engine got no traffic through the router"


def _sigterm_of_an_engine_drains_it_and_the_router_retries_elsewhere(deployment):
    u = deployment.url
    victim = deployment.engines[1]
    stop = threading.Event()
    results: list[int] = []

    def client(k: int):
        i = 0
        while not stop.is_set():
            s, _ = request(u, "POST", "/generate", {"text": f"drain {k} {i} {uuid.uuid4().hex}",
                                                   "sampling_params": {"max_new_tokens": 24}}, timeout=20)
            results.append(s)
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.8)
    os.kill(engine_pid(int(victim.rsplit(":", 1)[1])), signal.SIGTERM)
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert results and all(s == 200 for s in results), results
    assert finished(deployment.engines[0]) > 0
    # it exits 0 once drained, and the supervisor restarts it (the teardown stops the lot meanwhile)
    pattern = rf"engine \d \({re.escape(victim)}\) exited with code 0; restarting"
    deadline = time.monotonic() + 15
    while not re.search(pattern, deployment.log()):
        assert time.monotonic() < deadline, deployment.log()
        time.sleep(0.1)


@needs_router
def test_dp_2_behind_sglang_router(deployment):
    """Every check against one deployment, in this order (one test, so that pytest-xdist cannot
    split the checks over two workers, each starting its own deployment; the last two kill or
    drain an engine)."""
    _chat_completions_and_generate_plain_and_streamed(deployment)
    _a_repeated_long_prefix_lands_on_one_engine(deployment)
    _get_load_moves_with_traffic(deployment)
    _flush_cache_reaches_both_engines(deployment)
    _client_errors_do_not_make_the_router_refuse_valid_requests(deployment)
    _a_full_queue_is_a_503_the_router_retries_not_a_dead_engine(deployment)
    _sigkill_of_an_engine_under_load_loses_no_request(deployment)
    _sigterm_of_an_engine_drains_it_and_the_router_retries_elsewhere(deployment)
