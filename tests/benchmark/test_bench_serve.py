"""`trnrt bench serve` end to end against one shared `trnrt serve --scripted` (a subprocess), and
once with a server it starts itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "serve"))

from serve_support import spawn_serve, write_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="module")
def bench_tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("bench-tok"))


_NO_HEAVY_MAIN = (
    "import sys; from trnrt.cli import main; sys.argv = ['trnrt'] + sys.argv[1:]\n"
    "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
    "heavy = [m for m in ('torch', 'transformers', 'trnrt.engine', 'trnrt.serve') if m in sys.modules]\n"
    "assert not heavy, heavy\nsys.exit(code)\n"
)


@pytest.fixture(scope="module")
def self_started_run(bench_tok_dir):
    """`trnrt bench serve` without --url, in a subprocess started before the shared server (so the
    two server start-ups overlap): it starts `trnrt serve --scripted` on the test tokenizer, runs, and
    stops it. The client process asserts that it never imported torch, transformers, the engine or
    the server."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _NO_HEAVY_MAIN, "bench", "serve", "--model", str(bench_tok_dir),
         "--serve-arg=--scripted", "--serve-arg=--drain-timeout", "--serve-arg=1", "--num-prompts", "4",
         "--max-concurrency", "2", "--random-output-len", "5", "--random-range-ratio", "1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def server_url(bench_tok_dir, self_started_run):
    # A small per-step delay keeps requests in flight together, so concurrency is observable.
    proc, url = spawn_serve(bench_tok_dir, "--scripted-step-delay", "0.002", "--drain-timeout", "1")
    try:
        yield url
    finally:
        proc.kill()
        proc.wait()


def invoke(*args: str):
    from typer.testing import CliRunner

    from trnrt.cli import app

    return CliRunner().invoke(app, ["bench", "serve", *args])


def run_json(*args: str) -> dict:
    r = invoke(*args, "--json", "--disable-progress")
    assert r.exit_code == 0, (r.exit_code, r.output, r.exception)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_each_endpoint(server_url, endpoint, tmp_path):
    out = tmp_path / "res.jsonl"
    s = run_json("--url", server_url, "--endpoint", endpoint, "--num-prompts", "8", "--max-concurrency", "4",
                 "--random-input-len", "24", "--random-output-len", "12", "--random-range-ratio", "1",
                 "--output-file", str(out))
    assert s["endpoint"] == endpoint
    assert (s["completed"], s["failed"]) == (8, 0), s["errors"]
    assert s["total_output_tokens"] == 8 * 12 and s["output_tokens_reported"]  # ignore_eos: exactly as asked
    assert s["input_tokens_reported"] and s["total_input_tokens"] >= 8 * 24  # >= 1 token per word
    assert 1 <= s["max_concurrent_requests"] <= 4
    for k in ("request_throughput", "output_throughput", "total_throughput", "mean_ttft_ms", "median_ttft_ms",
              "p99_ttft_ms", "median_itl_ms", "p90_e2e_latency_ms", "mean_tpot_ms", "duration"):
        assert s[k] > 0, k
    assert s["median_e2e_latency_ms"] >= s["median_ttft_ms"]
    [line] = out.read_text().splitlines()
    assert json.loads(line) == s


def test_random_ids_shared_prefix_multi_turn(server_url):
    s = run_json("--url", server_url, "--backend", "sglang", "--dataset-name", "random-ids", "--num-prompts", "4",
                 "--random-input-len", "20", "--random-output-len", "6", "--random-range-ratio", "1")
    # token ids: input lengths are exact
    assert (s["completed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 80, 24)
    s = run_json("--url", server_url, "--dataset-name", "shared-prefix", "--gsp-num-groups", "2",
                 "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40", "--gsp-question-len", "8",
                 "--gsp-output-len", "5", "--max-concurrency", "2")
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 30)
    s = run_json("--url", server_url, "--dataset-name", "multi-turn", "--num-prompts", "2", "--multi-turn-turns",
                 "3", "--random-input-len", "10", "--random-output-len", "4", "--random-range-ratio", "1",
                 "--request-rate", "50")
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["num_requests"]) == (6, 0, 24, 6)
    assert s["max_concurrent_requests"] <= 2  # one request in flight per conversation


def test_concurrency_is_bounded(server_url):
    from trnrt.benchmark import datasets as ds
    from trnrt.benchmark.client import Target, served_model
    from trnrt.benchmark.runner import run_benchmark

    t = Target(server_url)
    t.model = served_model(t)
    out = run_benchmark(t, "chat", ds.gen_random(12, 8, 24, 1.0, seed=2), max_concurrency=3)
    assert all(r.success for r in out.results) and len(out.results) == 12
    assert out.peak_in_flight == 3


def test_table_and_usage_errors(server_url):
    r = invoke("--url", server_url, "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "3",
               "--disable-progress")
    assert r.exit_code == 0, r.output
    for name in ("Successful requests", "Output token throughput (tok/s)", "Median TTFT (ms)", "P99 ITL (ms)",
                 "Mean TPOT (ms)", "Median E2E Latency (ms)"):
        assert name in r.stdout
    r = invoke("--url", server_url, "--dataset-name", "random-ids")  # chat cannot take token ids
    assert r.exit_code == 2 and "random-ids" in r.stderr
    r = invoke("--url", server_url, "--backend", "sglang", "--endpoint", "/v1/completions")
    assert r.exit_code == 2 and "--backend" in r.stderr
    r = invoke("--url", server_url, "--serve-arg=--scripted")
    assert r.exit_code == 2 and "--serve-arg" in r.stderr
    from typer.testing import CliRunner

    from trnrt.cli import app

    r = CliRunner().invoke(app, ["bench", "--batch", "2", "serve", "--url", server_url])
    assert r.exit_code == 2 and "--batch" in r.stderr


def test_unreachable_server_exit_1():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = invoke("--url", f"http://127.0.0.1:{port}", "--ready-timeout", "0", "--disable-progress")
    assert r.exit_code == 1 and "not ready" in r.stderr


def test_starts_its_own_server_and_imports_no_torch(self_started_run):
    out, err = self_started_run.communicate(timeout=120)
    assert self_started_run.returncode == 0, err[-3000:]
    s = json.loads(out.strip().splitlines()[-1])
    assert s["started_server"] and (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 20)
