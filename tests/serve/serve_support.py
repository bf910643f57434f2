"""Serve test fixtures: a tokenizer dir, scripted engines, a real waitress server on a free port.

Exact-output tests use the scripted engine, the real Engine with a scripted runner in place of the
model: a script looks for `SCRIPT:<name>` in the prompt text and the runner replays SCRIPTS[name]
token by token as the sampled tokens (default: SCRIPTS["plain"]); the model's EOS ends an
exhausted script.

REAL ENGINE HOOK: `make_real_engine()` below returns None until the real engine lands; then it
must return an EngineClient for the tiny model. Tests using the `any_server` fixture run once per
engine kind ("scripted", "real"); the "real" run is skipped while the hook returns None.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SCRIPTS = {
    "plain": "Hello world! How are you today?<|endoftext|>",
    "reason": "Let me think about the capital.</think>The capital of France is Paris.<|user|>",
    "tool": ("I should check the weather.</think><tool_call>get_weather<arg_key>city</arg_key>"
             "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><|observation|>"),
    "tool45": ("</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><|observation|>"),
    "unicode": "北京 天气 你好 世界<|endoftext|>",
    "long": "The quick brown fox jumps over the lazy dog. " * 40,
    "stopword": "one two three STOP four five<|endoftext|>",
}


def record_engine_kwargs(monkeypatch) -> dict:
    """Make Engine.from_model_dir record its keyword arguments and raise ValueError (build_engine's
    usage-error path: `trnrt serve` exits 2 without starting a server). Returns the record. The
    engine is built in this process (the patch does not reach an engine process)."""
    import trnrt.cli.serve_engine as serve_mod
    from trnrt.engine.core import engine as engine_mod

    monkeypatch.setattr(serve_mod, "use_engine_process", lambda args: False)

    seen: dict = {}

    def fake_from_model_dir(*a, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(engine_mod.Engine, "from_model_dir", staticmethod(fake_from_model_dir))
    return seen


def write_tokenizer_dir(path: Path) -> Path:
    """The tiny model's tokenizer + chat template when available, else the test tokenizer."""
    try:
        from trnrt.models.tiny.tokenizer import write_tokenizer_files

        path.mkdir(parents=True, exist_ok=True)
        write_tokenizer_files(path)
        import trnrt.models.tiny as tiny

        shutil.copy(Path(tiny.__file__).with_name("chat_template.jinja"), path / "chat_template.jinja")
        return path
    except ImportError:
        from tokenizer_util import write_test_tokenizer

        return write_test_tokenizer(path)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer_factory(tok_dir):
    from trnrt.serve import hf_tokenizer_factory

    return hf_tokenizer_factory(str(tok_dir))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_factory):
    return tokenizer_factory()


def make_script(tokenizer):
    """SCRIPT:<name> in the prompt -> SCRIPTS[name] as token ids."""
    cache: dict[str, list[int]] = {}

    def script(prompt_ids: list[int]) -> list[int]:
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        name = "plain"
        if "SCRIPT:" in text:
            name = text.rsplit("SCRIPT:", 1)[1].split()[0].strip(".,<|")
            if name not in SCRIPTS:  # the name may run into a special token: longest known prefix
                name = max((k for k in SCRIPTS if name.startswith(k)), key=len, default=name)
        if name == "fail":
            raise RuntimeError("scripted failure")
        if name not in cache:
            cache[name] = tokenizer.encode(SCRIPTS.get(name, SCRIPTS["plain"]), add_special_tokens=False)
        return list(cache[name])

    return script


def eos_ids(tokenizer) -> tuple[int, ...]:
    added = tokenizer.added_tokens_encoder
    return tuple(added[s] for s in ("<|endoftext|>", "<|user|>", "<|observation|>") if s in added)


def make_scripted_engine(tokenizer_factory, **kw):
    """The real Engine with a scripted runner (`Engine.scripted`): real scheduler, stop checks,
    detokenizer, streams and page accounting, outputs from `make_script`. `kw` goes to
    Engine.scripted (step_delay_s, max_running_requests, max_model_len, ...); its runner is
    `engine.runner` (`.paused` holds the engine inside a step) and `engine.submitted` holds the
    last submitted GenerateRequests."""
    from trnrt.engine.core.engine import Engine

    from trnrt.engine.cache.cache_config import PrefixCacheConfig

    tok = tokenizer_factory()
    kw.setdefault("max_model_len", 1024)
    # the radix cache is on, as under `trnrt serve` (the scripted runner checks every resume)
    kw.setdefault("prefix_cache_config", PrefixCacheConfig())
    return Engine.scripted(tok, make_script(tok), eos_token_ids=eos_ids(tok), **kw)


# === REAL ENGINE HOOK =============================================================================
def make_real_engine():
    """Return an EngineClient for the tiny model, or None to skip the "real" runs.

    Wire when trnrt.engine.core.engine lands, e.g.:
        from trnrt.engine.core.engine import Engine
        from trnrt.models.tiny import default_model_dir
        return Engine.from_model_dir(default_model_dir(), max_running_requests=64)
    The server then uses the model dir's own tokenizer (see `any_server`).
    """
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir

    # the radix cache is on, as under `trnrt serve`
    return Engine.from_model_dir(default_model_dir(), max_running_requests=64,
                                 prefix_cache_config=PrefixCacheConfig())
# ==================================================================================================


@dataclass
class Server:
    url: str
    port: int
    engine: object
    app: object
    srv: object
    thread: object = None  # the waitress loop thread (serve.server.start_in_thread)

    def client(self, **kw):
        import openai

        kw.setdefault("_strict_response_validation", True)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "sk-test"), max_retries=0,
                             timeout=30, **kw)

    def raw(self, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None,
            timeout: float = 30):
        """(status, parsed JSON or text, headers) over a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = data.decode("utf-8", "replace")
        return r.status, parsed, dict(r.getheaders())

    def sse_events(self, path: str, body: dict, timeout: float = 300) -> list:
        """The parsed `data:` events of a streamed POST (without `[DONE]`); asserts a 200."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        conn.close()
        return events

    def post(self, path: str, body: dict, timeout: float = 300):
        """(status, parsed body) of a POST."""
        status, data, _ = self.raw("POST", path, body, timeout=timeout)
        return status, data

    def stats(self) -> dict:
        return self.raw("GET", "/v1/stats")[1]


def start_server(engine, tokenizer_factory, settings=None, threads=None) -> Server:
    from trnrt.serve import create_app
    from trnrt.serve.server import make_server, start_in_thread

    app = create_app(engine, tokenizer_factory, settings)
    srv = make_server(app, host="127.0.0.1", port=0, threads=threads)
    thread = start_in_thread(srv, "waitress-test")
    port = srv.effective_port
    return Server(url=f"http://127.0.0.1:{port}", port=port, engine=engine, app=app, srv=srv, thread=thread)


def stop_server(server: Server) -> None:
    from trnrt.serve import get_state

    server.engine.shutdown(0.0)  # aborts what runs, so the workers finish their responses
    from trnrt.serve.server import stop_in_thread

    get_state(server.app).wait_idle(5.0)
    stop_in_thread(server.srv, server.thread)


@pytest.fixture(scope="session")
def scripted_server(tokenizer_factory):
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    # A 1 MiB body limit keeps the oversize-body test cheap.
    server = start_server(engine, tokenizer_factory,
                          ServeSettings(served_model_name="trnrt-tiny", max_request_bytes=1 << 20))
    yield server
    stop_server(server)


@pytest.fixture(scope="session", params=["scripted", "real"])
def any_server(request, tokenizer_factory, scripted_server):
    """The same API tests against the scripted engine and (once wired) the real one."""
    if request.param == "scripted":
        yield scripted_server
        return
    engine = make_real_engine()
    if engine is None:
        pytest.skip("real engine not wired yet (tests/serve/conftest.py: make_real_engine)")
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    factory = hf_tokenizer_factory(engine.model_info.model_path)
    # Same context cap and body limit as the scripted server, so the bad-input corpus applies as is.
    server = start_server(engine, factory, ServeSettings(served_model_name="trnrt-tiny", context_length=1024,
                                                         max_request_bytes=1 << 20))
    yield server
    stop_server(server)


def live(server: Server) -> dict:
    """The engine's live gauges from /v1/stats (trnrt.stats schema: running, queued, pages_used, slots_used, ...)."""
    return server.stats()["live"]


def counters(server: Server) -> dict:
    """The engine's counters from /v1/stats (aborts, errors, requests_finished_total, ...)."""
    return server.stats()["counters"]


def assert_idle(server: Server, timeout_s: float = 5.0) -> dict:
    """Wait until nothing runs or waits and no page or slot is in use.

    Reads /v1/stats `live.running`, `live.queued`, `live.pages_used`, `live.slots_used`: the real
    engine's snapshot must carry them (trnrt.stats schema).
    """
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        s = live(server)
        if s["running"] == 0 and s["queued"] == 0 and s["pages_used"] == 0 and s["slots_used"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {s}")
        time.sleep(0.02)


def spawn_serve(tok_dir, *args: str):
    """`trnrt serve --scripted --model TOK_DIR --port 0 ARGS` in a subprocess; waits for its ready
    line. Returns (process, base URL). The caller kills the process in a `finally`."""
    import os
    import re
    import subprocess
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "trnrt", "serve", "--scripted", "--model", str(tok_dir), "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, lines = None, []
    # generous: a loaded CI box took ~50 s just to import torch in the child (it returns when ready)
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        proc.wait()
        raise AssertionError("trnrt serve did not become ready:\n" + "".join(lines))
    return proc, url
