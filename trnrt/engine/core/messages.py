"""The engine thread's inbox: one typed message per client call. Pure Python.

Client threads never touch engine state: `Engine.submit`, `abort`, `abort_requests`, `flush_cache`
and `load(fresh=True)` each put one of these messages on the inbox (a queue.Queue) and the engine
thread handles them in order, between steps. A message that wants an answer carries a `Reply`,
a one-shot future the engine thread fills and the caller waits on.

Order is the contract: a request submitted before an abort-by-prefix is in the engine when the
abort is handled, so the abort sees it; a flush sees every submission made before it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from trnrt.engine.request import GenerateRequest

T = TypeVar("T")


class Reply(Generic[T]):
    """A one-shot, thread-safe answer to an inbox message.

    States: pending -> claimed (the engine thread started acting on the message) -> done, or
    pending -> cancelled (the caller gave up first). Claiming and cancelling race under one lock,
    so exactly one side wins: a caller whose `cancel()` succeeded knows the message had no effect;
    one whose `cancel()` failed knows the answer is coming and waits for it. `set` may also come
    from the waiting side (a deferred flush that timed out answers itself); the first value wins.
    """

    __slots__ = ("_lock", "_event", "_state", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._state = "pending"
        self._value: T | None = None

    def claim(self) -> bool:
        """Engine thread: start acting on the message. False if the caller already cancelled it
        (then do nothing) or it was answered already."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "claimed"
            return True

    def cancel(self) -> bool:
        """Caller: withdraw the message before the engine thread claimed it. False if it was
        claimed or answered already (the answer is, or will be, there)."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "cancelled"
        self._event.set()
        return True

    def set(self, value: T) -> bool:
        """Answer; the first answer wins. False (and ignored) if already answered or cancelled."""
        with self._lock:
            if self._state in ("done", "cancelled"):
                return False
            self._state = "done"
            self._value = value
        self._event.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until answered or cancelled; True if that happened within `timeout` seconds."""
        return self._event.wait(timeout)

    @property
    def done(self) -> bool:
        """Answered (a value is there) or cancelled."""
        return self._state in ("done", "cancelled")

    @property
    def cancelled(self) -> bool:
        return self._state == "cancelled"

    @property
    def value(self) -> T | None:
        """The answer (None until answered)."""
        return self._value


@dataclass
class SubmitMsg:
    """Admit `requests` (already validated on the client thread), each with its stream, in one step."""

    requests: list[GenerateRequest]
    streams: list[Any]  # OutputStream, aligned with requests


@dataclass
class AbortMsg:
    """Abort one request by exact id (a client went away); no answer. A no-op if it is not live."""

    request_id: str
    message: str = "aborted by client"


@dataclass
class AbortMatchingMsg:
    """Abort every live request whose id starts with `prefix`, or all of them with `abort_all`
    (an empty prefix without abort_all matches nothing).

    `message` goes to running requests, `waiting_message` to queued ones (None: `message` too);
    `status_code` is put on each FinishReason (503 for a shutdown, None for client/admin aborts).
    The reply, if any, gets the list of aborted request ids.
    """

    prefix: str = ""
    abort_all: bool = False
    message: str = "Aborted"
    waiting_message: str | None = None
    status_code: int | None = None
    reply: Reply[list[str]] | None = None

    def matches(self, request_id: str) -> bool:
        return self.abort_all or (bool(self.prefix) and request_id.startswith(self.prefix))


@dataclass
class FlushCacheMsg:
    """Empty the caches when the engine is idle. `deadline` (time.monotonic) None: now or never;
    else keep the flush pending until idle or the deadline. The reply gets a FlushResult."""

    deadline: float | None
    reply: Reply = field(default_factory=Reply)


@dataclass
class LoadQueryMsg:
    """Compute an EngineLoad on the engine thread, after every earlier message was handled (so it
    counts every request submitted before the query). The reply gets the EngineLoad."""

    reply: Reply = field(default_factory=Reply)


InboxMessage = SubmitMsg | AbortMsg | AbortMatchingMsg | FlushCacheMsg | LoadQueryMsg
