"""Admin and info routes, as SGLang 0.5.23 answers them (docs/API.md "Admin and info routes").

    GET      /model_info        (deprecated alias /get_model_info)
    GET      /server_info       (deprecated alias /get_server_info)
    GET      /v1/loads          ?include= &dp_rank= &format=json|prometheus
    GET      /get_load          the historical per-rank list (sglang-router's power_of_two reads it)
    GET      /health_generate   a real one-token generation, or progress of the running requests
    POST     /abort_request     {"rid": "<id or prefix>", "abort_all": false} -> 200, empty body
    GET/POST /flush_cache       ?timeout= ; 200 / 400 with SGLang's plain-text messages

Everything here talks to the engine through the EngineClient contract only (`load`, `server_info`,
`stats`, `flush_cache`, `abort_requests`, `submit_many` via handlers.base). With --api-key every
route needs the key (AuthMiddleware); /flush_cache and /abort_request take --admin-api-key
instead when one is set (ADMIN_PATHS).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path

import falcon

from trnrt.engine.request import GenerateRequest, SamplingParams
from trnrt.serve.handlers.base import submit
from trnrt.serve.http.body import read_json
from trnrt.serve.http.errors import unavailable
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.loads import (PROMETHEUS_CONTENT_TYPE, get_load_entry, load_entry, loads_document, select,
                                      to_prometheus)
from trnrt.serve.protocol.admin import parse_abort, parse_flush_timeout, parse_loads_query

log = logging.getLogger("trnrt.serve")

# SGLang's "admin-optional" routes: --admin-api-key replaces --api-key on these when it is set.
ADMIN_PATHS = ("/flush_cache", "/abort_request")

# Backends that run on an accelerator (one engine = one device); the others run on the CPU.
_ACCELERATOR_BACKENDS = ("cuda", "neuron")


def _public(d: dict) -> dict:
    """`d` without any key that names an API key: /server_info must never show one."""
    return {k: v for k, v in d.items() if "api_key" not in str(k).lower()}


class _Deprecated:
    """SGLang logs a warning when a deprecated alias is used; once per route is enough here."""

    def __init__(self, alias: str | None, current: str):
        self._alias, self._current, self._warned = alias, current, False

    def warn(self, req) -> None:
        if self._alias is not None and req.path == self._alias and not self._warned:
            self._warned = True
            log.warning("%s is deprecated and will be removed in a future version; use %s",
                        self._alias, self._current)


class ModelInfo:
    """GET /model_info: SGLang's model facts. model_type and architectures come from the
    checkpoint's config.json (null when the model path has none, e.g. a scripted engine)."""

    def __init__(self, state: ServeState, alias: str | None = None):
        self.state = state
        self._deprecated = _Deprecated(alias, "/model_info")
        self._config: dict | None = None

    def _checkpoint_config(self) -> dict:
        if self._config is None:  # read once: the checkpoint does not change while serving
            cfg: dict = {}
            try:
                with open(Path(self.state.engine.model_info.model_path) / "config.json", encoding="utf-8") as f:
                    loaded = json.load(f)
                cfg = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                pass
            self._config = cfg
        return self._config

    def body(self) -> dict:
        st = self.state
        cfg = self._checkpoint_config()
        return {
            "model_path": st.engine.model_info.model_path,
            "served_model_name": st.model_name,
            "tokenizer_path": st.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": st.settings.reasoning_parser,
            "tool_call_parser": st.settings.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures"),
        }

    def on_get(self, req, resp) -> None:
        self._deprecated.warn(req)
        resp.media = self.body()


class ServerInfo:
    """GET /server_info: one flat dict, SGLang's shape.

    Layers, later ones winning: the launch options (ServeSettings.server_args), the engine's
    resolved settings (`engine.server_info()`), the server's own settings (every ServeSettings
    field; context_length and served_model_name as the server enforces them), then SGLang's
    fixed keys (status, version, max_total_num_tokens, page_size, internal_states). API keys are
    never included.
    """

    def __init__(self, state: ServeState, alias: str | None = None):
        self.state = state
        self._deprecated = _Deprecated(alias, "/server_info")

    def body(self, req) -> dict:
        import dataclasses

        st = self.state
        s = st.settings
        engine_info = dict(st.engine.server_info())
        load = st.engine.load().to_dict()
        out: dict = {}
        out.update(s.server_args)
        out.update(engine_info)
        out.update({f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "server_args"})
        port = s.server_args.get("port") or None
        if port is None and req.env.get("SERVER_PORT", "").isdigit():
            port = int(req.env["SERVER_PORT"])  # --port 0 or no CLI: the port this request came in on
        max_tokens = engine_info.get("max_total_num_tokens", load.get("max_total_num_tokens"))
        internal = dict(engine_info)
        internal.update({
            "dp_rank": 0,
            "world_size": 1,
            "effective_max_running_requests_per_dp": engine_info.get("max_running_requests"),
            "last_gen_throughput": load.get("gen_throughput", 0.0),
            # tokens per verify since start (SGLang's; bench_serving reads it); None while
            # speculative decoding is off or before its first verify
            "avg_spec_accept_length": load.get("spec_accept_length"),
            # the engine reports its token capacity, not its memory in GB
            "memory_usage": {"weight": None, "kvcache": None, "token_capacity": max_tokens, "graph": None},
        })
        out.update({
            "host": s.server_args.get("host") or s.bind_host,
            "port": port,
            "served_model_name": st.model_name,
            "tokenizer_path": st.tokenizer_path,
            "context_length": st.context_len,
            "max_req_input_len": st.context_len - 1,
            "tp_size": s.server_args.get("tp_size", 1),
            "ep_size": s.server_args.get("ep_size", 1),
            "dp_size": 1,
            "status": "ready",
            "version": st.version,
            "max_total_num_tokens": max_tokens,
            "page_size": engine_info.get("page_size", load.get("page_size")),
            "internal_states": [_public(internal)],
        })
        return _public(out)

    def on_get(self, req, resp) -> None:
        self._deprecated.warn(req)
        resp.media = self.body(req)


class Loads:
    """GET /v1/loads: SGLang 0.5.23's load document; one engine is DP rank 0 (any other
    `dp_rank` gets an empty `loads` list, as SGLang answers an out-of-range rank)."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        st = self.state
        q = parse_loads_query(req.params)
        entries = []
        if q.dp_rank in (None, 0):
            entries.append(select(load_entry(st.engine.load().to_dict()), q.include))
        if q.fmt == "prometheus":
            resp.content_type = PROMETHEUS_CONTENT_TYPE
            resp.text = to_prometheus(entries)
            return
        on_accelerator = st.engine.model_info.backend in _ACCELERATOR_BACKENDS
        # The device's name is not in the engine contract (and serve never imports torch): null.
        resp.media = loads_document(entries, version=st.version, accelerator=None,
                                    num_accelerators=1 if on_accelerator else 0)


class GetLoad:
    """GET /get_load: `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]` (SGLang before
    0.5.23; sglang-router's power_of_two policy sums `num_tokens`)."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        resp.media = [get_load_entry(self.state.engine.load().to_dict())]


class HealthGenerate:
    """GET /health_generate: 200 once the engine shows it generates, 503 if it does not within
    `health_generate_timeout_s` (SGLang's 20 s) or while shutting down.

    SGLang answers as soon as any scheduler output arrives after the probe is sent, so a busy
    server answers at once. Here: when requests are running, the engine's token and finish
    counters (/v1/stats) moving is that output, and it comes within one step. Otherwise (idle, or no
    progress within BUSY_WAIT_S) a real one-token greedy generation is submitted (its prompt is the
    first token of "ping", read from the tokenizer) and its first output answers; the counters
    moving meanwhile answers too. The probe is aborted when the answer is sent, whatever it is.
    """

    BUSY_WAIT_S = 1.0
    POLL_S = 0.02
    PROBE_TEXT = "ping"

    def __init__(self, state: ServeState):
        self.state = state
        self._probe_ids: list[int] | None = None
        self._lock = threading.Lock()

    def _progress(self) -> int:
        counters = self.state.engine.stats().get("counters", {})
        return int(counters.get("generation_tokens", 0)) + int(counters.get("requests_finished_total", 0))

    def _probe_prompt(self) -> list[int]:
        with self._lock:
            if self._probe_ids is None:
                ids = list(self.state.tokinfo().tokenizer.encode(self.PROBE_TEXT, add_special_tokens=False))[:1]
                self._probe_ids = ids or list(self.state.engine.model_info.eos_token_ids[:1])
            return list(self._probe_ids)

    def _submit_probe(self):
        """The probe in flight (a handlers.base.Submitted), or None when the HTTP layer is full:
        then the admitted requests' progress alone decides."""
        st = self.state
        if st.active_requests >= st.settings.max_concurrent_requests:
            return None
        prompt = self._probe_prompt()
        if not prompt:
            raise unavailable("health check: the tokenizer gives no token to probe with")
        probe = GenerateRequest(prompt, SamplingParams(max_new_tokens=1, temperature=0.0),
                                request_id=f"HEALTH_CHECK_{uuid.uuid4().hex}", stream=True)
        return submit(st, [probe], lambda f: f, err=lambda message, field: unavailable(message))

    def on_get(self, req, resp) -> None:
        st = self.state
        st.check_accepting()
        start = time.monotonic()
        deadline = start + st.settings.health_generate_timeout_s
        p0 = self._progress()
        if st.engine.load().num_running_reqs > 0 and self._wait_progress(p0, min(deadline, start + self.BUSY_WAIT_S)):
            return self._ok(resp)
        sub = self._submit_probe()
        try:
            while True:
                st.check_accepting()
                if sub is not None:
                    out = sub.streams[0].get(timeout=self.POLL_S)
                    if out is not None:
                        if out.finished:
                            sub.done[0] = True
                        fr = out.finish_reason
                        if out.error is not None or (fr is not None and fr.status_code is not None):
                            raise unavailable(f"health check generation failed: {out.error or fr.message}")
                        return self._ok(resp)
                else:
                    time.sleep(self.POLL_S)
                if self._progress() != p0:
                    return self._ok(resp)
                if time.monotonic() >= deadline:
                    raise unavailable(f"health check timed out: no generation within "
                                      f"{st.settings.health_generate_timeout_s:g} s")
        finally:
            if sub is not None:
                sub.close()  # aborts the probe if it has not finished; releases its admission slot

    def _wait_progress(self, p0: int, until: float) -> bool:
        while time.monotonic() < until:
            self.state.check_accepting()
            if self._progress() != p0:
                return True
            time.sleep(self.POLL_S)
        return False

    @staticmethod
    def _ok(resp) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = ""


class AbortRequest:
    """POST /abort_request: abort every queued or running request whose id starts with `rid`, or
    all with `abort_all` (SGLang's prefix rule; an empty rid alone aborts nothing). 200 with an
    empty body, whatever matched. Each aborted request ends with its output so far and finish
    reason abort ("Aborted", or "Abort in waiting queue" for a queued one): a normal finish on
    every API, not an error."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        a = parse_abort(read_json(req, st.settings.max_request_bytes))
        aborted = st.engine.abort_requests(a.rid, abort_all=a.abort_all)
        log.info("/abort_request rid=%r abort_all=%s: %d request(s) aborted", a.rid, a.abort_all, len(aborted))
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = ""


class FlushCache:
    """GET or POST /flush_cache[?timeout=T]: empty the engine's caches when it is idle.

    200 with SGLang's "Cache flushed..." text when it flushed; 400 with SGLang's text otherwise
    ("Flush cache failed." when busy and timeout is 0; "Timed out waiting for idle state." or
    "Another flush_cache is already in progress." with a timeout). Plain text, as SGLang answers.
    """

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        timeout_s = parse_flush_timeout(req.params)
        result = self.state.engine.flush_cache(timeout_s=timeout_s)
        resp.status = 200 if result.ok else 400
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = result.message

    on_post = on_get
