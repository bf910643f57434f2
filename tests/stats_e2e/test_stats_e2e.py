"""End to end: known traffic through a real server (real engine, tiny model), then /v1/stats,
`trnrt top --once` and /metrics must all report exactly that traffic.

Traffic (sent once per session by the `traffic` fixture, five of it concurrently):
  - 5 completions, prompts of PROMPT_LENS token ids, max_tokens MAX_TOKENS, ignore_eos: "length",
    exactly MAX_TOKENS[i] output tokens each;
  - 1 completion whose stop_token_ids hold the whole vocabulary: "stop" after exactly 1 token;
  - 1 streamed completion (max_tokens ABORT_MAX) whose client disconnects after the first token:
    "abort", after k output tokens, k read from the engine's own final output (SpyEngine).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

PROMPT_LENS = [3, 5, 8, 13, 21]
MAX_TOKENS = [4, 6, 8, 10, 12]
STOP_PROMPT_LEN = 7
ABORT_PROMPT_LEN = 9
ABORT_MAX = 900  # ~15 s of decoding on a CPU: the disconnect lands long before it could finish


def prompt(n: int, offset: int) -> list[int]:
    return [100 + offset + i for i in range(n)]  # plain BPE ids, clear of the special tokens


def completion(server, body: dict) -> dict:
    status, data, _ = server.request("POST", "/v1/completions", {"model": "trnrt-tiny", "temperature": 0, **body})
    assert status == 200, data
    return json.loads(data)


def aborted_stream(server) -> int:
    """Start a streamed completion, read until its first token arrives, hang up. Returns the
    number of content chunks read (>= 1)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": "trnrt-tiny", "prompt": prompt(ABORT_PROMPT_LEN, 500), "max_tokens": ABORT_MAX,
            "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **server.headers})
    sock = conn.sock  # getresponse() may hand the socket over to the response
    r = conn.getresponse()
    assert r.status == 200
    chunks = 0
    while chunks == 0:
        line = r.fp.readline()
        assert line, "stream ended before the first token"
        if line.startswith(b"data: {"):
            chunks += 1
    sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    r.close()
    conn.close()
    return chunks


@pytest.fixture(scope="module")
def traffic(real_server):
    server = real_server
    before = server.stats()["counters"]
    assert before["requests_arrived"] == 0, "the session server must start fresh"
    vocab = server.engine.model_info.vocab_size

    results: dict = {}
    errors: list = []

    def run(key, fn, *args):
        try:
            results[key] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, completion, server, {
        "prompt": prompt(n, 10 * i), "max_tokens": m, "ignore_eos": True}))
        for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))]
    threads.append(threading.Thread(target=run, args=("stop", completion, server, {
        "prompt": prompt(STOP_PROMPT_LEN, 300), "max_tokens": 5, "stop_token_ids": list(range(vocab))})))
    threads.append(threading.Thread(target=run, args=("abort", aborted_stream, server)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    # The disconnect is noticed between engine outputs; wait for the abort to land.
    deadline = time.monotonic() + 10
    while server.stats()["counters"]["requests_finished_total"] < 7:
        assert time.monotonic() < deadline, server.stats()["counters"]
        time.sleep(0.02)
    snap = server.wait_idle()

    finals = dict(server.engine.finals)
    aborted = [o for o in finals.values() if o.finish_reason.type == "abort"]
    assert len(finals) == 7 and len(aborted) == 1, finals
    k = aborted[0].num_output_tokens
    assert 1 <= results["abort"] <= k < ABORT_MAX, (results["abort"], k)
    return {"snap": snap, "results": results, "aborted_tokens": k, "finals": finals}


def expected_counters(k: int) -> dict:
    prompt_tokens = sum(PROMPT_LENS) + STOP_PROMPT_LEN + ABORT_PROMPT_LEN
    return {
        "requests_arrived": 7,
        "requests_finished": {"stop": 1, "length": 5, "abort": 1, "error": 0},
        "requests_finished_total": 7,
        "prompt_tokens": prompt_tokens,
        "finished_prompt_tokens": prompt_tokens,
        "cached_tokens": 0,
        "generation_tokens": sum(MAX_TOKENS) + 1 + k,
        "errors": 0,
        "aborts": 1,
        "preemptions": 0,
    }


def test_responses_are_the_known_traffic(traffic):
    """The traffic is what the module says (so the expected counters below are exact)."""
    res = traffic["results"]
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        assert res[i]["choices"][0]["finish_reason"] == "length"
        assert res[i]["usage"]["prompt_tokens"] == n and res[i]["usage"]["completion_tokens"] == m
    assert res["stop"]["choices"][0]["finish_reason"] == "stop"
    assert res["stop"]["usage"]["prompt_tokens"] == STOP_PROMPT_LEN
    assert res["stop"]["usage"]["completion_tokens"] == 1
    # The engine's own books (every final RequestOutput) agree with the responses.
    finals = traffic["finals"].values()
    assert sum(o.num_prompt_tokens for o in finals) == expected_counters(0)["prompt_tokens"]
    assert sum(o.num_output_tokens for o in finals) == sum(MAX_TOKENS) + 1 + traffic["aborted_tokens"]


def test_v1_stats_counters_equal_the_traffic(traffic):
    snap, k = traffic["snap"], traffic["aborted_tokens"]
    assert snap["counters"] == expected_counters(k)
    assert snap["engines"][0]["counters"] == expected_counters(k)
    lat = snap["latency"]
    # Every request produced a token: 7 queue times and TTFTs; E2E only for stop/length (6);
    # one ITL sample per token after each request's first (tokens come one per step here).
    assert lat["queue_ms"]["total_count"] == 7
    assert lat["ttft_ms"]["total_count"] == 7
    assert lat["e2e_ms"]["total_count"] == 6
    assert lat["itl_ms"]["total_count"] == expected_counters(k)["generation_tokens"] - 7
    for key in ("queue_ms", "ttft_ms", "e2e_ms", "itl_ms"):
        assert lat[key]["count"] == lat[key]["total_count"]  # all inside the 60 s window
        assert lat[key]["p50"] is not None and lat[key]["p50"] >= 0
    assert 0 < lat["ttft_ms"]["p50"] <= lat["e2e_ms"]["p99"]
    assert snap["live"]["running"] == 0 and snap["live"]["slots_total"] >= 64
    assert snap["prefix_hit_rate"] == 0.0


def test_top_once_shows_the_counters(traffic, real_server):
    from trnrt.cli import app

    k = traffic["aborted_tokens"]
    exp = expected_counters(k)
    runner = CliRunner()
    key = real_server.api_key
    r = runner.invoke(app, ["top", real_server.url, "--once", "--api-key", key], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    for needle in ("trnrt-tiny (preset default, eager, trnrt ",
                   "0 running · 0 queued · 7 finished · 1 aborted · 0 errors",
                   "7 arrived · finished: 1 stop, 5 length, 1 abort, 0 error · 0 preemptions",
                   f"{exp['prompt_tokens']} prompt · {exp['generation_tokens']} output · 0 cached",
                   f"{real_server.url}/v1/stats"):
        assert needle in out, (needle, out)
    # The latency table's sample counts (n column) and the engine column's done/aborts rows.
    n_col = dict(re.findall(r"│ (TTFT|ITL|E2E|queue)\s+│[^│]+│[^│]+│[^│]+│\s+(\d+) │", out))
    assert n_col == {"TTFT": "7", "ITL": str(exp["generation_tokens"] - 7), "E2E": "6", "queue": "7"}, out
    assert re.search(r"│ done\s+│\s+7 │", out) and re.search(r"│ aborts\s+│\s+1 │", out), out
    # Without the key, the server says 401 and top says why.
    r = runner.invoke(app, ["top", real_server.url, "--once"], env={"TRNRT_API_KEY": ""})
    assert r.exit_code == 1 and "HTTP 401" in r.stderr and "TRNRT_API_KEY" in r.stderr
    r = runner.invoke(app, ["top", real_server.url, "--once"], env={"TRNRT_API_KEY": key, "COLUMNS": "200"})
    assert r.exit_code == 0 and "7 finished" in r.stdout


def test_live_dashboard_against_the_server(traffic, real_server):
    """The Textual app itself (headless) polling the real server with the API key."""
    import asyncio

    from textual.widgets import DataTable, Static

    from trnrt.top.app import TopApp
    from trnrt.top.source import HttpStatsSource

    async def run() -> tuple[str, dict]:
        app = TopApp(HttpStatsSource(real_server.url, api_key=real_server.api_key), interval=0.2)
        async with app.run_test(size=(170, 34)) as pilot:
            while app.polls_applied < 2:
                await pilot.pause(0.05)
            summary = str(app.query_one("#summary", Static).render())
            table = app.query_one("#engines", DataTable)
            row = dict(zip((c.value for c in table.columns), table.get_row("engine-0")))
            assert app.last_error is None, app.last_error
        return summary, row

    summary, row = asyncio.run(run())
    assert "trnrt-tiny · preset default · eager · " in summary and "7 done · 0 errors" in summary, summary
    assert (row["finished"], row["aborts"], row["errors"], row["running"]) == ("7", "1", "0", "0"), row


def _samples(text: str, parser) -> dict:
    """{(sample name, frozenset(labels without engine/model)): value} of an exposition."""
    out = {}
    for fam in parser(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("engine", "model")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def test_metrics_counters_equal_the_traffic(traffic, real_server):
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
    from prometheus_client.parser import text_string_to_metric_families

    k = traffic["aborted_tokens"]
    exp = expected_counters(k)
    status, data, headers = real_server.request("GET", "/metrics")
    assert status == 200
    assert headers["Content-Type"] == CONTENT_TYPE_PLAIN_0_0_4
    text = data.decode()
    m = _samples(text, text_string_to_metric_families)

    def v(name, **labels):
        return m[(name, frozenset(labels.items()))]

    assert v("trnrt_requests_arrived_total") == 7
    for reason, n in exp["requests_finished"].items():
        assert v("trnrt_requests_finished_total", finish_reason=reason) == n
    assert v("trnrt_prompt_tokens_total") == exp["prompt_tokens"]
    assert v("trnrt_generation_tokens_total") == exp["generation_tokens"]
    assert v("trnrt_cached_tokens_total") == 0
    assert v("trnrt_request_aborts_total") == 1 and v("trnrt_request_errors_total") == 0
    assert v("trnrt_preemptions_total") == 0
    assert v("trnrt_requests_running") == 0 and v("trnrt_requests_queued") == 0
    assert v("trnrt_time_to_first_token_seconds_count") == 7
    assert v("trnrt_e2e_request_latency_seconds_count") == 6
    assert v("trnrt_request_queue_time_seconds_count") == 7
    assert v("trnrt_inter_token_latency_seconds_count") == exp["generation_tokens"] - 7
    # Summaries agree with /v1/stats: same cumulative sums (seconds) and the same p50 (ms there).
    lat = traffic["snap"]["latency"]
    assert v("trnrt_time_to_first_token_seconds_sum") == pytest.approx(lat["ttft_ms"]["total_sum_s"])
    assert v("trnrt_time_to_first_token_seconds", quantile="0.5") == pytest.approx(lat["ttft_ms"]["p50"] / 1000)
    # Labels: the served model name and the engine id.
    assert 'engine="engine-0"' in text and 'model="trnrt-tiny"' in text
    info = [s for f in text_string_to_metric_families(text) if f.name == "trnrt_engine_info" for s in f.samples]
    assert len(info) == 1 and info[0].value == 1
    assert {k: info[0].labels[k] for k in ("engine", "served_model_name", "preset", "backend", "compiled")} == {
        "engine": "engine-0", "served_model_name": "trnrt-tiny", "preset": "default", "backend": "eager",
        "compiled": "false"}


def test_metrics_openmetrics_negotiation(traffic, real_server):
    """A Prometheus server asks for OpenMetrics; prometheus_client picks the format and type."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    status, data, headers = real_server.request(
        "GET", "/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    m = _samples(data.decode(), text_string_to_metric_families)
    assert m[("trnrt_requests_arrived_total", frozenset())] == 7
    generated = expected_counters(traffic["aborted_tokens"])["generation_tokens"]
    assert m[("trnrt_generation_tokens_total", frozenset())] == generated


def test_auth_rules(real_server):
    """/v1/stats and /metrics need the key (401 in OpenAI's envelope); /health does not."""
    for path in ("/v1/stats", "/metrics"):
        status, data, _ = real_server.request("GET", path, auth=False)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
        status, _, _ = real_server.request("GET", path, auth=False, headers={"Authorization": "Bearer nope"})
        assert status == 401
    status, _, _ = real_server.request("GET", "/health", auth=False)
    assert status == 200


def test_metrics_nan_quantiles_before_traffic():
    """An idle engine's summaries have NaN quantiles, which the parser accepts (no traffic yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    from trnrt.stats import StatsCollector
    from trnrt.stats.prometheus import to_prometheus

    fams = {f.name: f for f in text_string_to_metric_families(to_prometheus(StatsCollector().snapshot()).decode())}
    q = [s for s in fams["trnrt_time_to_first_token_seconds"].samples if "quantile" in s.labels]
    assert q and all(math.isnan(s.value) for s in q)
