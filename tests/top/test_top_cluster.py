"""`trnrt top` over several engines: a fake router (sglang-router 0.3.2's `GET /workers` shape) in
front of two real in-process servers on scripted engines, plus a worker that does not answer.

The counters `trnrt top ROUTER --once` shows per engine and in total must equal the traffic sent.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.top.source import (AutoStatsSource, EnginesStatsSource, RouterStatsSource, SourceError, combine,
                              worker_urls)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))

from serve_support import make_scripted_engine, start_server, stop_server, write_tokenizer_dir  # noqa: E402

runner = CliRunner()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _serve_json(routes: dict):
    """A loopback HTTP stub answering GET {path: JSON-able} (404 otherwise)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in routes:
                status, body = 200, json.dumps(routes[self.path]).encode()
            else:
                status, body = 404, b'{"error": "not found"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _worker(url: str, healthy: bool = True) -> dict:
    # the fields sglang-router 0.3.2 reports per worker (GET /workers)
    return {"id": "0b7c", "url": url, "model_id": "trnrt-tiny", "priority": 50, "cost": 1.0,
            "worker_type": "regular", "is_healthy": healthy, "load": 0, "connection_mode": "HTTP",
            "metadata": {"dp_size": "1", "tp_size": "1"}, "disable_health_check": False}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two scripted servers with known traffic, a fake router listing them and a dead worker."""
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    factory = hf_tokenizer_factory(str(write_tokenizer_dir(tmp_path_factory.mktemp("tok"))))
    servers = [start_server(make_scripted_engine(factory), factory, ServeSettings(served_model_name="trnrt-tiny"))
               for _ in range(2)]
    sent = []  # per server: (requests, prompt tokens, output tokens)
    for server, n in zip(servers, (3, 2)):
        prompt = out = 0
        for i in range(n):
            status, body, _ = server.raw("POST", "/v1/completions", {
                "model": "trnrt-tiny", "prompt": f"request {i} " * (i + 1), "max_tokens": 4 + i})
            assert status == 200, body
            prompt += body["usage"]["prompt_tokens"]
            out += body["usage"]["completion_tokens"]
        sent.append((n, prompt, out))
    dead = _dead_url()
    router, router_url = _serve_json({"/workers": {
        "workers": [_worker(s.url) for s in servers] + [_worker(dead, healthy=False)],
        "total": 3, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 3}}})
    yield {"servers": servers, "sent": sent, "router": router_url, "dead": dead}
    router.shutdown()
    router.server_close()
    for s in servers:
        stop_server(s)


def _row(out: str, label: str) -> list[str]:
    """The cells of the `--once` engine-table row whose first cell is `label`."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_router_once_shows_each_engine_and_a_total_equal_to_the_traffic(cluster):
    servers, sent = cluster["servers"], cluster["sent"]
    r = runner.invoke(app, ["top", cluster["router"], "--once"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    hosts = [s.url.split("//")[1] for s in servers]
    for h in hosts:
        assert h in out
    assert "router " + cluster["router"] in out and "3 workers, 2 healthy" in out
    assert cluster["dead"].split("//")[1] in out and "unreachable" in out
    # columns: engine A, engine B, the dead one, total
    assert _row(out, "state") == ["ok", "ok", "down", "2/3 ok"]
    assert _row(out, "arrived") == [str(sent[0][0]), str(sent[1][0]), "-", str(sent[0][0] + sent[1][0])]
    assert _row(out, "done") == [str(sent[0][0]), str(sent[1][0]), "-", str(sent[0][0] + sent[1][0])]
    assert _row(out, "prompt tokens") == [str(sent[0][1]), str(sent[1][1]), "-", str(sent[0][1] + sent[1][1])]
    assert _row(out, "output tokens") == [str(sent[0][2]), str(sent[1][2]), "-", str(sent[0][2] + sent[1][2])]
    # the summary's totals are over the engines that answered
    assert f"{sent[0][0] + sent[1][0]} arrived" in out


def test_router_source_snapshot(cluster):
    snap = RouterStatsSource(cluster["router"], timeout_s=1).fetch()
    ids = [e["id"] for e in snap["engines"]]
    assert ids == [s.url.split("//")[1] for s in cluster["servers"]] + [cluster["dead"].split("//")[1]]
    assert [e["state"] for e in snap["engines"]] == ["ok", "ok", "down"]
    assert snap["engines"][2]["router_healthy"] is False and snap["engines"][2]["error"]
    assert snap["counters"]["requests_arrived"] == sum(n for n, _, _ in cluster["sent"])
    assert snap["counters"]["generation_tokens"] == sum(o for _, _, o in cluster["sent"])
    assert snap["router"] == {"url": cluster["router"], "workers": 3, "healthy": 2}
    # the router's URL alone: /v1/stats is a 404 there, /workers a worker list
    auto = AutoStatsSource(cluster["router"], timeout_s=1)
    assert len(auto.fetch()["engines"]) == 3 and auto.description.startswith("router ")
    # an engine's URL stays an engine
    one = AutoStatsSource(cluster["servers"][0].url, timeout_s=1).fetch()
    assert len(one["engines"]) == 1 and one["engines"][0]["id"] == "engine-0"


def test_engine_urls_directly(cluster):
    urls = [s.url for s in cluster["servers"]] + [cluster["dead"]]
    r = runner.invoke(app, ["top", *urls, "--once", "--timeout", "1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    total = sum(n for n, _, _ in cluster["sent"])
    assert _row(r.stdout, "arrived")[-1] == str(total)
    assert _row(r.stdout, "state") == ["ok", "ok", "down", "2/3 ok"]
    # none answers: the rows are printed, marked down, and the exit status is 1
    r = runner.invoke(app, ["top", _dead_url(), _dead_url(), "--once", "--timeout", "1"], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "no engine answered" in r.stderr
    assert _row(r.stdout, "state")[-1] == "0/2 ok"


def test_the_live_dashboard_lists_the_engines_and_a_total(cluster):
    import asyncio

    from textual.widgets import DataTable

    from trnrt.top.app import TopApp

    # a generous per-engine timeout: on a loaded CI box a live engine's answer can take over a
    # second, and a timed-out engine is (rightly) shown down; the dead one refuses at once
    src = RouterStatsSource(cluster["router"], timeout_s=10)
    want = str(sum(n for n, _, _ in cluster["sent"]))

    async def run():
        import time

        top = TopApp(src, interval=0.2)
        async with top.run_test(size=(160, 36)) as pilot:
            deadline = time.monotonic() + 30
            while True:
                if top.last_snapshot is not None:
                    table = top.query_one("#engines", DataTable)
                    keys = [k.value for k in table.rows]
                    if len(keys) == 4 and table.get_cell("total", "finished") == want:
                        break
                assert time.monotonic() < deadline, "the dashboard never showed the traffic"
                await pilot.pause(0.05)
            table = top.query_one("#engines", DataTable)
            keys = [k.value for k in table.rows]
            assert len(keys) == 4 and keys[-1] == "total"
            assert table.get_cell(keys[2], "state") == "down"
            assert table.get_cell("total", "finished") == str(sum(n for n, _, _ in cluster["sent"]))

    asyncio.run(run())


def test_worker_list_shapes_and_router_errors():
    assert worker_urls({"workers": [{"url": "http://a:1", "is_healthy": True}], "total": 1}) == [("http://a:1", True)]
    assert worker_urls({"urls": ["http://a:1", "http://b:2"]}) == [("http://a:1", None), ("http://b:2", None)]
    assert worker_urls(["http://a:1"]) == [("http://a:1", None)]
    with pytest.raises(SourceError):
        worker_urls({"nope": 1})
    with pytest.raises(SourceError):  # the router itself unreachable: an error, shown in the banner
        RouterStatsSource(_dead_url(), timeout_s=1).fetch()
    # all engines down: still a snapshot, every row marked, zero totals
    snap = EnginesStatsSource([_dead_url()], timeout_s=1).fetch()
    assert snap["engines"][0]["state"] == "down" and snap["counters"] == {}
    assert combine([])["engines"] == []
