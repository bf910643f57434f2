"""The interface the server (and the offline LLM API) uses to talk to an engine.

`serve` depends only on this protocol, so its tests run against a scripted engine that replays
given token ids, and the same tests run against the real engine. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, runtime_checkable

from trnrt.engine.outputs import RequestOutput
from trnrt.engine.request import GenerateRequest


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


class RequestStream(Protocol):
    """Incremental outputs of one submitted request, in order; the last has finished=True."""

    request_id: str

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Next output, or None if none arrived within `timeout` seconds."""

    def __iter__(self) -> Iterator[RequestOutput]:
        """Iterate until (and including) the finished output."""


@runtime_checkable
class EngineClient(Protocol):
    """Thread-safe handle on an engine running on its own thread."""

    model_info: ModelInfo

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request; raises InvalidRequestError (naming the field) if it can never run."""

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still queued or running; a no-op otherwise. Frees its pages and slot."""

    def stats(self) -> dict:
        """A JSON-able snapshot of live state and counters (the /v1/stats body)."""

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to drain_timeout_s, abort the rest."""
