"""`trnrt top --once` against a tiny loopback http.server, the HTTP source, and the no-torch rule."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.top.format import fmt_duration, fmt_ms, instant_rates
from trnrt.top.source import HttpStatsSource, SourceError, stats_url

runner = CliRunner()


@pytest.fixture
def stats_server(make_snapshot):
    """Serves {path: (status, body)} on 127.0.0.1 (loopback only), on a free port."""
    routes = {"/v1/stats": (200, json.dumps(make_snapshot(0)).encode())}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = routes.get(self.path, (404, b'{"error": "not found"}'))
            key = routes.get("api_key")  # set by a test: answer 401 without `Bearer <key>`
            if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
                status, body = 401, b'{"error": {"message": "Invalid or missing API key"}}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()


def _dead_url() -> str:
    # A port that was free a moment ago and has nothing listening now: connection refused.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_once_prints_a_table(stats_server):
    url, _ = stats_server
    r = runner.invoke(app, ["top", url, "--once"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    for needle in ("glm-5.3-flash", "preset batch8", "compiled", "1h00m", "7 running", "2 queued",
                   "TTFT", "50ms", "1.23s", "96/128 75%", "engine-0", "engine-1", "25%"):
        assert needle in out, needle
    assert f"{url}/v1/stats" in out


def test_once_unreachable_exits_1_with_a_message():
    url = _dead_url()
    r = runner.invoke(app, ["top", url, "--once", "--timeout", "1"])
    assert r.exit_code == 1
    assert "cannot reach" in r.stderr and url in r.stderr
    assert r.stdout == ""


def test_once_bad_answers_exit_1(stats_server):
    url, routes = stats_server
    r = runner.invoke(app, ["top", url + "/nope", "--once"])
    assert r.exit_code == 1 and "HTTP 404" in r.stderr
    routes["/v1/stats"] = (200, b'{"version": 99}')
    r = runner.invoke(app, ["top", url, "--once"])
    assert r.exit_code == 1 and "schema version 99" in r.stderr
    routes["/v1/stats"] = (200, b"<html>")
    r = runner.invoke(app, ["top", url, "--once"])
    assert r.exit_code == 1 and "bad /v1/stats body" in r.stderr


def test_api_key_option_and_envvar(stats_server):
    url, routes = stats_server
    routes["api_key"] = "sk-top"
    r = runner.invoke(app, ["top", url, "--once"], env={"COLUMNS": "120", "TRNRT_API_KEY": ""})
    assert r.exit_code == 1 and "HTTP 401" in r.stderr and "TRNRT_API_KEY" in r.stderr
    r = runner.invoke(app, ["top", url, "--once", "--api-key", "wrong"], env={"TRNRT_API_KEY": ""})
    assert r.exit_code == 1 and "HTTP 401" in r.stderr and "wrong API key" in r.stderr
    assert "wrong" not in r.stderr.replace("wrong API key", "")  # the key itself is never printed
    r = runner.invoke(app, ["top", url, "--once", "--api-key", "sk-top"], env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "engine-1" in r.stdout, r.output
    r = runner.invoke(app, ["top", url, "--once"], env={"COLUMNS": "120", "TRNRT_API_KEY": "sk-top"})
    assert r.exit_code == 0 and "engine-1" in r.stdout, r.output
    assert HttpStatsSource(url, api_key="sk-top").fetch()["version"] == 1


def test_usage_errors_and_demo():
    assert runner.invoke(app, ["top", "--interval", "0"]).exit_code == 2
    r = runner.invoke(app, ["top", "--demo", "--once"], env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "engine-1" in r.stdout


def test_http_source(stats_server):
    url, _ = stats_server
    snap = HttpStatsSource(url).fetch()
    assert snap["version"] == 1 and len(snap["engines"]) == 2
    with pytest.raises(SourceError):
        HttpStatsSource(_dead_url(), timeout_s=1).fetch()


@pytest.mark.parametrize(
    "given,expected",
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000/v1/stats"),
        ("http://h:1/", "http://h:1/v1/stats"),
        ("h:1", "http://h:1/v1/stats"),
        ("http://h:1/v1/stats", "http://h:1/v1/stats"),
        ("https://router/engines/0/v1/stats/", "https://router/engines/0/v1/stats"),
    ],
)
def test_stats_url(given, expected):
    assert stats_url(given) == expected


def test_instant_rates_and_formatting(make_snapshot):
    s0, s1 = make_snapshot(0), make_snapshot(1)
    assert instant_rates(s0, s1) == {"gen_tps": 240.0, "prompt_tps": 400.0, "rps": 4.0}
    # First poll, or a restarted server (counters went backwards): the server's 1-minute rates.
    first = instant_rates(None, s1)
    assert first["gen_tps"] == pytest.approx(s1["rates"]["1m"]["generation_tokens_per_s"])
    assert instant_rates(s1, s0)["gen_tps"] == pytest.approx(s0["rates"]["1m"]["generation_tokens_per_s"])
    assert [fmt_ms(None), fmt_ms(0.5), fmt_ms(42.4), fmt_ms(1500)] == ["-", "0.5ms", "42ms", "1.50s"]
    assert [fmt_duration(5), fmt_duration(725), fmt_duration(3660), fmt_duration(2 * 86400 + 7200)] == [
        "5s", "12m05s", "1h01m", "2d02h"]


def test_top_never_imports_torch():
    code = "import trnrt.top.app, trnrt.cli.top, sys; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
