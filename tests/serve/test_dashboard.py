"""GET /dashboard: a self-contained page polling /v1/stats.

Without a browser: the route, the page's content (no external assets, the CSP), its polling
contract (every /v1/stats key it reads is in a real snapshot) and that the stats it shows carry no
request text. With a headless Chromium (Debian's `chromium-headless-shell` or `chromium`): the
page runs against a live server and shows its numbers; only that part is skipped without one.

`TRNRT_UPDATE_SCREENSHOTS=1` also writes docs/dashboard.png (under load from a few client threads).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serve_support import make_scripted_engine, start_server, stop_server

from trnrt.serve.dashboard import CSP, PAGE, READS

SECRET = "okapi-marmalade-prompt-marker"
DOCS = Path(__file__).resolve().parents[2] / "docs"
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "headless_shell")


def _browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def dash_server(tokenizer_factory):
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory, step_delay_s=0.002), tokenizer_factory,
                          ServeSettings(served_model_name="trnrt-tiny"), threads=16)
    for i in range(5):
        st, body, _ = server.raw("POST", "/v1/completions", {
            "model": "trnrt-tiny", "prompt": f"{SECRET} {i}", "max_tokens": 3 + i})
        assert st == 200, body
    yield server
    stop_server(server)


def test_route_serves_one_self_contained_page(dash_server):
    st, body, headers = dash_server.raw("GET", "/dashboard")
    assert st == 200 and headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"] == CSP and "default-src 'none'" in CSP and "connect-src 'self'" in CSP
    assert body == PAGE and body.startswith("<!doctype html>")
    # no external assets: nothing is loaded from anywhere but the page itself
    assert not re.search(r"\b(src|href)\s*=", body, re.I)
    assert "<link" not in body and "@import" not in body and "url(" not in body
    assert not re.search(r"https?://", body)
    # it polls the stats relative to itself (works behind a path prefix), JSON, no caching
    assert 'fetch("v1/stats"' in body and '"Accept": "application/json"' in body and 'cache: "no-store"' in body
    assert dash_server.raw("POST", "/dashboard", {})[0] == 405


def test_every_key_the_page_reads_is_in_a_real_snapshot(dash_server):
    snap = dash_server.stats()
    keys: set[str] = set()

    def walk(d):
        if isinstance(d, dict):
            for k, v in d.items():
                keys.add(k)
                walk(v)
        elif isinstance(d, list):
            for v in d:
                walk(v)

    walk(snap)
    missing = [k for k in READS if k not in keys]
    assert not missing, missing
    for k in READS:
        assert k in PAGE, k
    assert snap["version"] == 1 and snap["engines"][0]["recent_requests"]


def test_the_stats_it_shows_hold_no_request_text(dash_server):
    st, body, _ = dash_server.raw("POST", "/v1/chat/completions", {
        "model": "trnrt-tiny", "messages": [{"role": "user", "content": f"{SECRET} SCRIPT:reason"}]})
    assert st == 200
    text = json.dumps(dash_server.stats())
    assert SECRET not in text and "Paris" not in text and "Hello world" not in text
    rec = dash_server.stats()["engines"][0]["recent_requests"][-1]
    assert set(rec) == {"finished_at_s", "finish_reason", "prompt_tokens", "output_tokens", "cached_tokens",
                        "queue_ms", "ttft_ms", "itl_ms", "e2e_ms"}
    assert all(v is None or isinstance(v, (int, float, str)) for v in rec.values())
    assert rec["finish_reason"] == "stop" and rec["output_tokens"] == body["usage"]["completion_tokens"]


def _paced_proxy(target: str, delay_s: float):
    """Forwards GETs to `target`, holding each /v1/stats answer `delay_s`: under Chromium's virtual
    time (which stands still while a fetch is pending) the polls are then paced in real time, so the
    page's rates are real rates."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/v1/stats"):
                time.sleep(delay_s)
            with urllib.request.urlopen(target + self.path, timeout=10) as r:
                body, ctype = r.read(), r.headers.get("Content-Type", "text/plain")
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _chromium(browser: str, url: str, *args: str, budget_ms: int, timeout_s: float = 90) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--window-size=1400,1130", f"--virtual-time-budget={budget_ms}", *args, url]
    if browser.endswith("chromium-headless-shell") or browser.endswith("headless_shell"):
        cmd.remove("--headless")  # the shell is headless already
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def test_renders_live_numbers_in_headless_chromium(dash_server, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no headless Chromium on PATH (apt-get install chromium-headless-shell); "
                    "the route, content and polling contract are tested above without one")
    proxy, url = _paced_proxy(dash_server.url, 0.15)
    try:
        r = _chromium(browser, url + "/dashboard?interval=0.5", "--dump-dom", budget_ms=2500)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    polls = re.search(r'data-polls="(\d+)"', dom)
    assert polls and int(polls.group(1)) >= 3, dom[-3000:]
    done = dash_server.stats()["counters"]["requests_finished_total"]

    def cell(id_):
        m = re.search(rf'id="{id_}"[^>]*>([^<]*)<', dom)
        return m.group(1) if m else None

    assert cell("t-done") == str(done)  # live numbers, from this server's /v1/stats
    assert cell("status").startswith("live · poll")
    assert "engine-0" in dom and "trnrt-tiny" in dom
    assert dom.count("<td>length</td>") + dom.count("<td>stop</td>") >= min(done, 20)  # the recent requests
    assert SECRET not in dom

    if os.environ.get("TRNRT_UPDATE_SCREENSHOTS") == "1":
        _screenshot(browser, dash_server, DOCS / "dashboard.png")


def _screenshot(browser: str, server, out: Path) -> None:
    """docs/dashboard.png: the page over ~15 s of load from four client threads."""
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            server.raw("POST", "/v1/completions", {"model": "trnrt-tiny", "prompt": "SCRIPT:long " * (1 + 3 * i),
                                                   "max_tokens": 16 + 8 * i})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    proxy, url = _paced_proxy(server.url, 0.45)
    try:
        time.sleep(1.0)
        r = _chromium(browser, url + "/dashboard?interval=0.5", f"--screenshot={out}", budget_ms=15000, timeout_s=120)
        assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    finally:
        stop.set()
        proxy.shutdown()
        proxy.server_close()
        for t in threads:
            t.join(10)
