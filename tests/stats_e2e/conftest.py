"""A real `trnrt serve` stack (waitress + Falcon app + the real Engine on the embedded tiny model).

`real_server` starts one server with an API key on a free port for the whole session; the engine
is wrapped in `SpyEngine`, which records every request's final RequestOutput (what the engine itself
says it did: prompt and output token counts, finish type) without changing what the server sees.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

import pytest

API_KEY = "sk-stats-e2e"


class SpyEngine:
    """Delegates to a real Engine; remembers each request's final output (engine ground truth)."""

    def __init__(self, engine):
        self._engine = engine
        self.finals: dict[str, object] = {}  # request_id -> final RequestOutput
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, request):
        return self.submit_many([request])[0]

    def submit_many(self, requests):
        streams = self._engine.submit_many(requests)
        for stream in streams:
            put = stream.put

            def spy_put(out, _put=put):
                if out.finished:
                    with self._lock:
                        self.finals[out.request_id] = out
                _put(out)

            stream.put = spy_put  # the engine thread calls stream.put; the HTTP worker reads as usual
        return streams


@dataclass
class RealServer:
    url: str
    port: int
    engine: SpyEngine
    app: object
    srv: object
    api_key: str = API_KEY
    headers: dict = field(default_factory=lambda: {"Authorization": f"Bearer {API_KEY}"})

    def request(self, method: str, path: str, body: dict | None = None, auth: bool = True,
                headers: dict | None = None, timeout: float = 60):
        """(status, body bytes, headers) over a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json", **(self.headers if auth else {}), **(headers or {})}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data, dict(r.getheaders())

    def stats(self) -> dict:
        status, data, _ = self.request("GET", "/v1/stats")
        assert status == 200, data
        return json.loads(data)

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """The snapshot once nothing runs, waits or holds a page or slot."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.stats()
            live = snap["live"]
            if not (live["running"] or live["queued"] or live["pages_used"] or live["slots_used"]):
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {live}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def real_server():
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, create_app, get_state, hf_tokenizer_factory
    from trnrt.serve.server import make_server, start_in_thread, stop_in_thread

    # As `trnrt serve --served-model-name trnrt-tiny --api-key ...` builds it: the name reaches the
    # engine too (the stats' model label), not only the HTTP layer.
    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=64, served_model_name="trnrt-tiny")
    spy = SpyEngine(engine)
    app = create_app(spy, hf_tokenizer_factory(engine.model_info.model_path),
                     ServeSettings(api_key=API_KEY, served_model_name="trnrt-tiny"))
    srv = make_server(app, host="127.0.0.1", port=0, threads=16)
    thread = start_in_thread(srv, "waitress-stats-e2e")
    port = srv.effective_port
    yield RealServer(url=f"http://127.0.0.1:{port}", port=port, engine=spy, app=app, srv=srv)
    engine.shutdown(0.0)
    get_state(app).wait_idle(5.0)
    stop_in_thread(srv, thread)
