"""The interface the server (and the offline LLM API) uses to talk to an engine.

`serve` and `trnrt.LLM` depend only on this protocol and its plain-data answers (`EngineLoad`,
`FlushResult`). The one implementation is `trnrt.engine.core.engine.Engine`; its API tests run it with a
scripted runner (`trnrt.engine.runner.scripted_runner`) in place of the model, so they exercise the real
scheduler, stop checks, detokenizer and page accounting. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Protocol, runtime_checkable

from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.request import GenerateRequest

# SGLang's /flush_cache answers (python/sglang/srt/managers/scheduler.py, tokenizer_manager.py),
# kept word for word: clients and dashboards match on them.
FLUSH_OK_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_BUSY_MESSAGE = "Flush cache failed.\n"
FLUSH_TIMEOUT_MESSAGE = "Timed out waiting for idle state."
FLUSH_IN_PROGRESS_MESSAGE = "Another flush_cache is already in progress."
# SGLang's message for a request aborted before it was scheduled.
ABORT_WAITING_MESSAGE = "Abort in waiting queue"


class EngineDeadError(RuntimeError):
    """The engine is shutting down, or its thread or process died; no new requests are accepted.
    (Defined here, with the protocol, so that a client in another process raises the same type.)"""


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the served model that request validation needs."""

    model_path: str
    served_model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    preset: str = "default"
    backend: str = "eager"
    compiled: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FlushResult:
    """The answer of `EngineClient.flush_cache`: whether the caches were emptied, and SGLang's
    message saying so (or why not)."""

    ok: bool
    message: str

    def to_dict(self) -> dict:
        return {"success": self.ok, "message": self.message}


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is (SGLang's `/get_load` numbers plus the page and slot gauges).

    Published by the engine thread after every step, so reading it never waits for a step.

    num_running_reqs / num_waiting_reqs: requests holding a slot / queued (preempted ones included).
    num_pending_reqs: requests submitted and not finished, including those the engine thread has
        not taken from its inbox yet.
    num_used_tokens: tokens the used pages can hold (num_used_pages * page_size).
    num_total_tokens: prompt + output tokens of every running and waiting request.
    num_waiting_uncached_tokens: prompt tokens of the waiting requests (no prefix cache yet: all).
    max_total_num_tokens: tokens the usable pages hold (num_total_pages * page_size).
    max_running_requests: the scheduler's max_num_seqs.
    token_usage: num_used_tokens / max_total_num_tokens.
    gen_throughput: output tokens per second over the last minute (the stats collector's window).
    cache_hit_rate: prefix-cache hit rate: cached prompt tokens / prompt tokens admitted since
        start (0.0 with the cache off).
    prefix_cache: the radix cache is on.
    num_cached_pages: device pages held by the radix cache (shared with running requests or not).
    num_evictable_pages: of those, pages no running request uses (freed on demand).
    num_used_checkpoints / num_total_checkpoints: the device state-checkpoint pool.
    num_host_used_pages / num_host_total_pages, num_host_used_checkpoints /
        num_host_total_checkpoints: the host tier (hierarchical cache; 0 when off).
    spec_accept_length / spec_accept_rate: speculative decoding since start, from the stats
        collector (StatsCollector.spec_summary): tokens emitted per verify (accepted drafts + 1)
        and accepted / proposed drafts; None while it is off or before the first verify.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_pending_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_waiting_uncached_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    num_used_pages: int = 0
    num_total_pages: int = 0
    num_used_slots: int = 0
    num_total_slots: int = 0
    page_size: int = 0
    prefix_cache: bool = False
    num_cached_pages: int = 0
    num_evictable_pages: int = 0
    num_used_checkpoints: int = 0
    num_total_checkpoints: int = 0
    num_host_used_pages: int = 0
    num_host_total_pages: int = 0
    num_host_used_checkpoints: int = 0
    num_host_total_checkpoints: int = 0
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "EngineLoad":
        return dataclasses.replace(self, **changes)


class RequestStream(Protocol):
    """Incremental outputs of one submitted request, in order; the last has finished=True."""

    request_id: str

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Next output, or None if none arrived within `timeout` seconds."""

    def __iter__(self) -> Iterator[RequestOutput]:
        """Iterate until (and including) the finished output."""


@runtime_checkable
class EngineClient(Protocol):
    """Thread-safe handle on an engine running on its own thread. Every method may be called from
    any thread (the HTTP workers, the admin routes, `trnrt.LLM`)."""

    model_info: ModelInfo

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request. Raises InvalidRequestError (naming the field) if it can never run, or
        if its request_id is still in flight ("Duplicate request ID detected: <rid>", field "rid")."""

    def submit_many(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """Queue several requests together (admitted in the same step), all or nothing: raises like
        `submit` (also for a request_id repeated inside the batch) and then queues none."""

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still queued or running; a no-op otherwise. Asynchronous (returns
        before the engine thread acts). Frees its pages and slot; its stream ends with an abort."""

    def abort_requests(self, prefix: str = "", *, abort_all: bool = False, message: str = "Aborted",
                       timeout_s: float = 5.0) -> list[str]:
        """Abort every queued or running request whose id starts with `prefix` (all of them with
        `abort_all`; an empty prefix without abort_all aborts nothing): SGLang's /abort_request.

        Synchronous: waits up to `timeout_s` for the engine thread and returns the aborted ids (an
        empty list, with nothing aborted, if the engine thread did not get to it in time). A queued
        request ends with the message "Abort in waiting queue", a running one with `message`; each
        keeps the tokens and text it already received.
        """

    def flush_cache(self, timeout_s: float = 0.0) -> FlushResult:
        """Empty the engine's caches, only when nothing is queued, running or submitted (SGLang's
        /flush_cache). With timeout_s == 0 a busy engine refuses at once; with timeout_s > 0 the
        flush waits for the engine to become idle (new requests keep being admitted meanwhile) or
        gives up after timeout_s. One deferred flush at a time."""

    def load(self) -> EngineLoad:
        """The engine's current load (published after each step: never waits for the engine thread)."""

    def server_info(self) -> dict:
        """The engine's resolved settings (JSON-able; SGLang's /server_info engine part)."""

    def is_idle(self) -> bool:
        """Nothing queued, running, or submitted and not yet taken by the engine thread."""

    def stats(self) -> dict:
        """A JSON-able snapshot of live state and counters (the /v1/stats body)."""

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to drain_timeout_s, abort the rest."""
