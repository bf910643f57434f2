"""`trnrt serve`: flags, the ready line, graceful shutdown on SIGTERM with exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from serve_support import record_engine_kwargs, spawn_serve


def test_help_lists_sglang_flags():
    from typer.testing import CliRunner

    from trnrt.cli import app

    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200, env={"COLUMNS": "200"}).output
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--max-running-requests",
                 "--context-length", "--tool-call-parser", "--reasoning-parser", "--threads", "--stream-interval"):
        assert flag in out, flag
    assert "--scripted" not in out  # hidden


def test_stream_interval_reaches_the_engine_and_is_validated(monkeypatch):
    from typer.testing import CliRunner

    from trnrt.cli import app, server_args as serve_cli
    from trnrt.engine.core import engine as engine_mod

    seen = record_engine_kwargs(monkeypatch)
    r = CliRunner().invoke(app, ["serve", "--stream-interval", "4"])
    assert r.exit_code == 2 and seen["stream_interval"] == 4
    r = CliRunner().invoke(app, ["serve", "--stream-interval", "0"])
    assert r.exit_code == 2 and "stream-interval" in r.output
    assert serve_cli.ServerArgs().stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval"):
        engine_mod.Engine(None, None, None, None, None, start=False, stream_interval=0)


def test_cli_import_is_light():
    code = "import sys, trnrt.cli; assert 'trnrt.serve.app' not in sys.modules and 'waitress' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bad_parser_flag_is_usage_error(tok_dir):
    from typer.testing import CliRunner

    from trnrt.cli import app

    r = CliRunner().invoke(app, ["serve", "--scripted", "--model", str(tok_dir), "--tool-call-parser", "qwen"])
    assert r.exit_code == 2


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("sig,layout", [(signal.SIGTERM, "--engine-in-process"), (signal.SIGINT, "--engine-in-process"),
                                        (signal.SIGTERM, "--engine-process")])
def test_serve_ready_line_and_graceful_shutdown(tok_dir, sig, layout):
    """The ready line carries the URL; on a signal, new requests get 503, the in-flight stream
    finishes whole (drain), and the process exits 0 (with the engine core in its own process too,
    which is gone afterwards)."""
    proc, url = spawn_serve(tok_dir, "--served-model-name", "tiny", "--max-running-requests", "4",
                            "--scripted-step-delay", "0.02", layout)
    try:
        r = _post(url + "/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 4})
        assert r["choices"][0]["finish_reason"] in ("stop", "length")
        # A stream in flight: 16 echo tokens at 20 ms per step.
        body = json.dumps({"model": "tiny", "prompt": "one two three four five six seven eight nine ten eleven",
                           "max_tokens": 16, "stream": True}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}), timeout=10)
        first = stream.readline()
        assert first.startswith(b"data: ")
        kids = _children(proc.pid)  # the engine process (and multiprocessing's resource tracker)
        assert (layout == "--engine-process") == any(b"spawn_main" in pathlib_read(f"/proc/{k}/cmdline") for k in kids)
        proc.send_signal(sig)
        time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(url + "/v1/completions", {"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert e.value.code == 503 and json.loads(e.value.read())["error"]["type"] == "service_unavailable"
        rest = stream.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        assert proc.wait(timeout=15) == 0
        assert _wait_gone(kids)  # no engine process left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pathlib_read(f"/proc/{p}/cmdline") for p in pids):  # gone (a zombie has no cmdline)
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    import pathlib

    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_a_dead_engine_process_fails_its_requests_and_health(tok_dir):
    """The engine core dies (SIGKILL): the stream in flight ends with an error event, new requests
    and /health get 503, and the server still shuts down cleanly on a signal."""
    proc, url = spawn_serve(tok_dir, "--served-model-name", "tiny", "--scripted-step-delay", "0.02",
                            "--engine-process")
    try:
        kids = [k for k in _children(proc.pid)
                if b"spawn_main" in pathlib_read(f"/proc/{k}/cmdline")]
        assert len(kids) == 1, kids
        body = json.dumps({"model": "tiny", "prompt": "one two three", "max_tokens": 2000, "stream": True,
                           "ignore_eos": True}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}), timeout=10)
        assert stream.readline().startswith(b"data: ")
        os.kill(kids[0], signal.SIGKILL)
        rest = stream.read().decode()
        assert "engine process exited" in rest and rest.rstrip().endswith("data: [DONE]")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert e.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(url + "/v1/completions", {"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert e.value.code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pathlib_read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_bad_log_level_is_usage_error(monkeypatch):
    """--log-level takes debug|info|warning|error|critical in any case; anything else is a usage
    error naming the flag (exit 2) before a model is loaded."""
    from typer.testing import CliRunner

    import trnrt.cli.serve_engine as serve_mod
    from trnrt.cli import app
    from trnrt.engine.core import engine as engine_mod

    built = []

    def fake_from_model_dir(*a, **kw):
        built.append(kw)
        raise ValueError("stop here")  # build_engine's ValueError path: exit 2, no server

    monkeypatch.setattr(engine_mod.Engine, "from_model_dir", staticmethod(fake_from_model_dir))
    monkeypatch.setattr(serve_mod, "use_engine_process", lambda args: False)  # the patch is in this process
    r = CliRunner().invoke(app, ["serve", "--log-level", "bogus"], terminal_width=200, env={"COLUMNS": "200"})
    assert r.exit_code == 2 and not built
    assert "--log-level" in r.output and "critical" in r.output
    r = CliRunner().invoke(app, ["serve", "--log-level", "WARNING"])
    assert r.exit_code == 2 and len(built) == 1 and "stop here" in r.output  # accepted, then build_engine


def test_server_args_are_the_commands_options():
    """Every `trnrt serve` option is the ServerArgs field of its name, and ServerArgs.from_cli of
    the command's defaults is ServerArgs(): one default per option."""
    import dataclasses

    import typer

    from trnrt.cli import app
    from trnrt.cli.server_args import ServerArgs

    cmd = typer.main.get_command(app).commands["serve"]
    params = {p.name: p.default for p in cmd.params if p.name != "help"}
    assert set(params) == {f.name for f in dataclasses.fields(ServerArgs)}
    assert ServerArgs.from_cli(params) == ServerArgs()
