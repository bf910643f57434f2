"""`trnrt serve` start-up checks: a busy port and key sources are settled before the model loads."""

from __future__ import annotations

import socket
import time

import pytest
from typer.testing import CliRunner


def _invoke(args, env=None):
    from trnrt.cli import app

    return CliRunner().invoke(app, ["serve", *args], env=env or {})


def test_busy_port_is_a_usage_error_naming_the_flag(tok_dir):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        t0 = time.monotonic()
        r = _invoke(["--scripted", "--model", str(tok_dir), "--port", str(port)])
        assert r.exit_code == 2, r.output
        assert "--port" in r.output and "in use" in r.output
        assert time.monotonic() - t0 < 10  # refused before any model or engine is built
    finally:
        s.close()


@pytest.fixture
def captured(monkeypatch):
    """Stop `serve` right after it built its settings; return them."""
    import trnrt.cli.serve_engine as serve_mod

    seen = {}

    def fake_build(args):
        seen["args"] = args
        raise SystemExit(0)

    monkeypatch.setattr(serve_mod, "start_engine", fake_build)
    return seen


def test_api_key_sources(tmp_path, captured, tok_dir):
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\n")
    base = ["--scripted", "--model", str(tok_dir), "--port", "0"]
    _invoke([*base, "--api-key-file", str(keyfile)])
    assert captured["args"].api_key == "from-file"
    _invoke(base, env={"TRNRT_API_KEY": "from-env"})
    assert captured["args"].api_key == "from-env"
    r = _invoke([*base, "--api-key", "x", "--api-key-file", str(keyfile)])
    assert r.exit_code == 2 and "--api-key-file" in r.output
    r = _invoke([*base, "--api-key-file", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "--api-key-file" in r.output
    (tmp_path / "empty").write_text("\n")
    r = _invoke([*base, "--api-key-file", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no key" in r.output
