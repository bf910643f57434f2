"""The Falcon WSGI app: `create_app(engine_client, tokenizer_factory, settings) -> falcon.App`.

The app holds no model: it validates, renders chat templates and tokenizes on the waitress worker
thread (one tokenizer per thread, made by `tokenizer_factory`), submits token ids to the engine
through the `EngineClient` protocol, and turns the engine's outputs into OpenAI responses.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import falcon

from trnrt.engine.client import EngineClient
from trnrt.serve import errors
from trnrt.serve.errors import OpenAIError

log = logging.getLogger("trnrt.serve")

TOOL_CALL_PARSERS = ("glm47", "glm45")
REASONING_PARSERS = ("glm45",)


@dataclass
class ServeSettings:
    """Server-side settings (not graph-shaping: never part of EngineConfig).

    served_model_name: the model id clients must name (None: the engine's `served_model_name`).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
    context_length: cap on prompt + completion tokens (None: the engine's `max_model_len`).
    tool_call_parser / reasoning_parser: GLM parsers, or None to pass raw text through.
    max_concurrent_requests: generation requests the HTTP layer holds at once (each holds a
        waitress thread); beyond it a request gets 503 at once, so control routes keep a thread.
    max_request_bytes: larger bodies get 413.
    poll_interval_s: how often a waiting worker checks for a disconnected client.
    default_chat_template_kwargs: merged under each request's chat_template_kwargs.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    context_length: int | None = None
    tool_call_parser: str | None = "glm47"
    reasoning_parser: str | None = "glm45"
    max_concurrent_requests: int = 128
    max_request_bytes: int = 16 * 1024 * 1024
    poll_interval_s: float = 0.05
    default_chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")


class TokenizerInfo:
    """One thread's tokenizer plus what the routes read from it (markers, special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = dict(getattr(tokenizer, "added_tokens_encoder", {}) or {})
        # Markers are looked up by text, never by hard-coded id.
        self.marker_ids = {s: added[s] for s in ("<think>", "</think>", "<tool_call>", "</tool_call>") if s in added}
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
            if getattr(tok, "special", False):
                special.add(tok.content)
        special.discard("")
        self.special_tokens = special
        self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)))
                            if special else None)
        self._piece_cache: dict[int, str] = {}

    @property
    def has_think(self) -> bool:
        return "<think>" in self.marker_ids and "</think>" in self.marker_ids

    def strip_special(self, text: str) -> str:
        """Remove special-token texts (what skip_special_tokens would have removed)."""
        return self._special_re.sub("", text) if (self._special_re and text) else text

    def piece(self, token_id: int) -> str:
        """The text of one token (for logprobs)."""
        s = self._piece_cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._piece_cache) < 65536:
                self._piece_cache[token_id] = s
        return s


class ServeState:
    """Everything the resources share: engine, settings, per-thread tokenizers, admission."""

    def __init__(self, engine: EngineClient, tokenizer_factory: Callable[[], object], settings: ServeSettings):
        self.engine = engine
        self.settings = settings
        self.tokenizer_factory = tokenizer_factory
        info = engine.model_info
        self.model_name = settings.served_model_name or info.served_model_name
        self.context_len = min(settings.context_length or info.max_model_len, info.max_model_len)
        self.created = int(time.time())
        self.shutting_down = threading.Event()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._active = 0
        self._idle = threading.Condition(self._lock)

    def tokinfo(self) -> TokenizerInfo:
        """This thread's tokenizer (HF fast tokenizers must not be shared across threads)."""
        ti = getattr(self._local, "ti", None)
        if ti is None:
            ti = self._local.ti = TokenizerInfo(self.tokenizer_factory())
        return ti

    def check_accepting(self) -> None:
        if self.shutting_down.is_set():
            raise OpenAIError(503, "The server is shutting down.", type_="service_unavailable")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    def acquire(self) -> None:
        """Admit one generation request or answer 503 (the HTTP layer is at capacity)."""
        with self._lock:
            if self._active >= self.settings.max_concurrent_requests:
                raise OpenAIError(503, "The server is at capacity (max_concurrent_requests); retry later.",
                                  type_="service_unavailable")
            self._active += 1

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    @property
    def active_requests(self) -> int:
        with self._lock:
            return self._active

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation request is in flight (graceful shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every route but /health (as SGLang exempts it)."""

    def __init__(self, api_key: str):
        self._key = api_key.encode()

    def process_request(self, req, resp) -> None:
        if req.path == "/health":
            return
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise OpenAIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                              type_="authentication_error", code="invalid_api_key")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(req, max_bytes: int) -> dict:
    """The request body as a JSON object, or a 400/413 naming what is wrong.

    The Content-Type is not checked (curl's default form type is common); the body must be JSON.
    """
    length = req.content_length
    if length is not None and length > max_bytes:
        raise OpenAIError(413, f"Request body too large: {length} bytes (limit {max_bytes}).")
    data = req.bounded_stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OpenAIError(413, f"Request body too large (limit {max_bytes} bytes).")
    if not data.strip():
        raise errors.bad_request("Request body is empty; expected a JSON object.")
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise errors.bad_request("Request body is not valid UTF-8.")
    except (ValueError, RecursionError) as e:
        raise errors.bad_request(f"Could not parse JSON body: {e}")
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object.")
    return body


class Health:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        self.state.check_accepting()
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = ""


class Stats:
    """GET /v1/stats: the engine's live snapshot, as the engine reports it."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.text = json.dumps(self.state.engine.stats(), ensure_ascii=False)


class Metrics:
    """GET /metrics: the /v1/stats figures in a Prometheus exposition format (trnrt.stats.prometheus).

    One snapshot per scrape, rendered by prometheus_client; the format and its content type come
    from prometheus_client's `choose_encoder` for the request's Accept header (text 0.0.4 by default,
    OpenMetrics or text 1.0.0 when a scraper asks), as prometheus_client's own WSGI app does.
    Needs the API key when one is set, like /v1/stats (docs/API.md).
    """

    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.registry import CollectorRegistry

        from trnrt.stats.prometheus import SnapshotCollector

        snapshot = self.state.engine.stats()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: snapshot))
        encoder, content_type = choose_encoder(req.get_header("Accept") or "")
        resp.content_type = content_type
        resp.data = encoder(registry)


def create_app(engine_client: EngineClient, tokenizer_factory: Callable[[], object],
               settings: ServeSettings | None = None) -> falcon.App:
    """Build the WSGI app.

    Args:
        engine_client: anything satisfying trnrt.engine.client.EngineClient (real or scripted).
        tokenizer_factory: returns a fresh HF tokenizer; called once per waitress thread.
        settings: ServeSettings (defaults if None).

    The app's ServeState is `app.serve_state` (server.py uses it for admission and shutdown).
    """
    from trnrt.serve import openai_routes

    settings = settings or ServeSettings()
    state = ServeState(engine_client, tokenizer_factory, settings)
    middleware = [AuthMiddleware(settings.api_key)] if settings.api_key else []
    app = ServeApp(middleware=middleware)
    app.serve_state = state
    errors.register(app)
    app.add_route("/health", Health(state))
    app.add_route("/v1/stats", Stats(state))
    app.add_route("/metrics", Metrics(state))
    openai_routes.add_routes(app, state)
    return app


class ServeApp(falcon.App):
    """falcon.App (which uses __slots__) plus a place for the ServeState."""

    serve_state: ServeState


def get_state(app: falcon.App) -> ServeState:
    """The ServeState behind an app made by create_app."""
    return app.serve_state


def hf_tokenizer_factory(model_dir: str) -> Callable[[], object]:
    """A factory loading the HF tokenizer in `model_dir` (transformers imported lazily)."""

    def make():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    return make
