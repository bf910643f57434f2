"""State the route handlers share: server settings, per-thread tokenizers, admission.

`ServeSettings` are server-side (never graph-shaping, never part of EngineConfig). `ServeState`
holds the engine client, the settings, one tokenizer per waitress thread (HF fast tokenizers must
not be shared across threads) and the HTTP layer's admission counter.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from trnrt.engine.core.client import EngineClient
from trnrt.serve.http.errors import PRIORITY_DISABLED_MESSAGE, QUEUE_FULL_HEADERS, OpenAIError, SGLangObjectError

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
    incremental_streaming_output: SGLang's flag: /generate streams carry deltas, not cumulative text.
    stream_response_default_include_usage: SGLang's flag: every streamed OpenAI response ends with
        the usage chunk, as with stream_options.include_usage.
    allowed_origins / allowed_hosts / bind_host: the Origin and Host checks (trnrt.serve.http.origin).
    tokenizer_path: the tokenizer directory the server loads (None: the engine's `model_path`);
        /model_info reports it, and bench_serving and the router load their tokenizer from it.
    admin_api_key: SGLang's --admin-api-key. When set, the admin routes (/flush_cache,
        /abort_request) need it and no longer accept api_key; other routes are unaffected.
    server_args: launch settings to report on /server_info (host, port, threads, ...; the CLI
        passes its parsed options). Keys holding "api_key" are never reported.
    health_generate_timeout_s: how long /health_generate waits for the engine (SGLang's
        SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) before it answers 503.
    trust_request_chat_template: vLLM's --trust-request-chat-template. When set, a chat request's
        own `chat_template` (top level or in chat_template_kwargs) is rendered in a bounded
        sandbox (trnrt.serve.protocol.template_sandbox); otherwise it is a 400.
    enable_priority_scheduling / abort_on_priority_when_disabled: the engine's scheduling flags
        (SGLang's; the CLI copies them from SchedulerConfig). Without priority scheduling a
        request's `priority` is ignored, unless abort_on_priority_when_disabled: then such a
        request is refused with SGLang's 503 before it is tokenized.
    enable_hierarchical_cache: the engine keeps a host tier of its prefix cache (SGLang's
        --enable-hierarchical-cache); `/generate` then reports `meta_info.cached_tokens_details`.
    enable_response_store / response_store_size_mb / response_store_ttl_s: SGLang's
        --enable-response-store: /v1/responses keeps responses (for previous_response_id,
        GET and cancel) in a bounded store of that many MB, each kept that many seconds after
        its last write (0: no expiry).
    prod_dir / prod_max_mb / prod_backups / prod_gauges_s: the production log (trnrt.serve.prod_log;
        env TRNRT_PROD_DIR, TRNRT_PROD_MAX_MB, TRNRT_PROD_BACKUPS, TRNRT_PROD_GAUGES_S): one JSON
        line per finished request and gauges every prod_gauges_s, never request text; off when
        prod_dir is None.
    prompt_cache_mb: the prompt-token cache for chat turns (trnrt.serve.prompt_cache; env
        TRNRT_PROMPT_CACHE_MB); 0 is off.
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
    incremental_streaming_output: bool = False
    stream_response_default_include_usage: bool = False
    allowed_origins: tuple = ()
    allowed_hosts: tuple | None = None
    bind_host: str | None = None
    tokenizer_path: str | None = None
    admin_api_key: str | None = None
    server_args: dict = field(default_factory=dict)
    health_generate_timeout_s: float = 20.0
    trust_request_chat_template: bool = False
    enable_priority_scheduling: bool = False
    abort_on_priority_when_disabled: bool = False
    enable_hierarchical_cache: bool = False
    enable_response_store: bool = False
    response_store_size_mb: float = 256.0
    response_store_ttl_s: float = 3600.0
    prod_dir: str | None = field(default_factory=lambda: os.environ.get("TRNRT_PROD_DIR") or None)
    prod_max_mb: float = field(default_factory=lambda: _env_float("TRNRT_PROD_MAX_MB", 64.0))
    prod_backups: int = field(default_factory=lambda: int(_env_float("TRNRT_PROD_BACKUPS", 4)))
    prod_gauges_s: float = field(default_factory=lambda: _env_float("TRNRT_PROD_GAUGES_S", 10.0))
    prompt_cache_mb: float = field(default_factory=lambda: _env_float("TRNRT_PROMPT_CACHE_MB", 0.0))

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if not self.health_generate_timeout_s > 0:
            raise ValueError("health_generate_timeout_s must be > 0")
        if not self.response_store_size_mb > 0 or self.response_store_ttl_s < 0:
            raise ValueError("response_store_size_mb must be > 0 and response_store_ttl_s >= 0")
        if not self.prod_max_mb > 0 or self.prod_backups < 0 or not self.prod_gauges_s > 0:
            raise ValueError("prod_max_mb and prod_gauges_s must be > 0, prod_backups >= 0")
        if self.prompt_cache_mb < 0:
            raise ValueError("prompt_cache_mb must be >= 0")


def _env_float(name: str, default: float) -> float:
    """A number from the environment (unset or empty: `default`); anything else is a ValueError."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


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
        self.tokenizer_path = settings.tokenizer_path or info.model_path
        self.version = package_version()
        self.shutting_down = threading.Event()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._active = 0
        self._http = 0  # requests inside a handler (http_enter / http_leave)
        self._idle = threading.Condition(self._lock)
        # Opt-in observability next to the engine (never imported when off).
        self.prod_log = None
        if settings.prod_dir:
            from trnrt.serve.prod_log import ProdLog

            self.prod_log = ProdLog.for_server(engine, settings)
        if settings.prompt_cache_mb > 0:
            from trnrt.serve import prompt_cache

            prompt_cache.configure(settings.prompt_cache_mb, collector=getattr(engine, "stats_collector", None))

    def tokinfo(self) -> TokenizerInfo:
        """This thread's tokenizer (HF fast tokenizers must not be shared across threads)."""
        ti = getattr(self._local, "ti", None)
        if ti is None:
            ti = self._local.ti = TokenizerInfo(self.tokenizer_factory())
        return ti

    def check_accepting(self) -> None:
        if self.shutting_down.is_set():
            raise OpenAIError(503, "The server is shutting down.", type_="service_unavailable")
        if not getattr(self.engine, "alive", True):  # an engine process that exited (mp_client)
            raise OpenAIError(503, "The engine process exited.", type_="service_unavailable")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    def check_priority(self, priorities) -> None:
        """SGLang's --abort-on-priority-when-disabled: a request that sets `priority` on a server
        without priority scheduling gets 503 (SGLang's system-abort envelope on every route).
        Otherwise a priority is passed on (and ignored by the engine when scheduling is off)."""
        s = self.settings
        if (not s.enable_priority_scheduling and s.abort_on_priority_when_disabled
                and any(p is not None for p in priorities)):
            raise SGLangObjectError(503, PRIORITY_DISABLED_MESSAGE)

    def acquire(self) -> None:
        """Admit one generation request or answer 503 (the HTTP layer is at capacity)."""
        with self._lock:
            if self._active >= self.settings.max_concurrent_requests:
                raise OpenAIError(503, "The server is at capacity (max_concurrent_requests); retry later.",
                                  type_="service_unavailable", headers=QUEUE_FULL_HEADERS)
            self._active += 1

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    @property
    def active_requests(self) -> int:
        with self._lock:
            return self._active

    def http_enter(self) -> None:
        """A request entered the app (any route); see wait_http_idle."""
        with self._lock:
            self._http += 1

    def http_leave(self) -> None:
        with self._lock:
            self._http -= 1
            self._idle.notify_all()

    def wait_http_idle(self, timeout_s: float) -> bool:
        """Wait until no request is inside a handler (shutdown: a request still tokenizing when
        the signal came must get its 503 before the process exits). Streams leave their handler
        when the body starts; they are counted by admission (wait_idle)."""
        return self._wait_zero(lambda: self._http, timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation request is in flight (graceful shutdown)."""
        return self._wait_zero(lambda: self._active, timeout_s)

    def _wait_zero(self, count, timeout_s: float) -> bool:
        """Wait (up to timeout_s) until `count()`, read under the lock, is 0."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while count():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True



def package_version() -> str:
    """trnrt's installed version (package metadata), as /server_info and /v1/loads report it."""
    from importlib import metadata

    try:
        return metadata.version("trnrt")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0+src"


def hf_tokenizer_factory(model_dir: str) -> Callable[[], object]:
    """A factory loading the HF tokenizer in `model_dir` (transformers imported lazily)."""

    def make():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    return make


def get_state(app) -> "ServeState":
    """The ServeState behind an app made by trnrt.serve.app.create_app."""
    return app.serve_state
