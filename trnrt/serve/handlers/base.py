"""What every generation route shares: admit -> parse -> render -> submit -> drain -> close.

A route handler takes an admission slot (`Admission`, 503 when the HTTP layer is full) before it
reads the body, parses it with its API's protocol module, renders and tokenizes, builds engine
requests, and calls `submit()`, which submits them together (`EngineClient.submit_many`).
The returned `Submitted` drains the engine streams (checking for a client that left) and, in
`close()` — which runs in a `finally` for JSON bodies and from the WSGI body's close() for SSE —
aborts whatever has not finished and releases the admission slot. `respond()` hands a renderer
(output/) either the collected outputs (one JSON body) or the stream (SSE). Everything that can
fail because of the input fails before the first byte, so it gets a proper 4xx; failures after
that become the API's in-band error event. A stream's headers wait for its first engine output, so
a request the engine refuses at once (queue full: a system abort before any token) still gets a
plain HTTP 503 rather than a 200 stream holding an error.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterator, Protocol

from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.request import GenerateRequest, InvalidRequestError
from trnrt.serve.http import sse
from trnrt.serve.http.body import read_json
from trnrt.serve.http.errors import APIError, bad_request, unavailable
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.assembler import system_error

log = logging.getLogger("trnrt.serve")


class Renderer(Protocol):
    """An API's response shape over the outputs of one HTTP request's engine requests."""

    def collect(self, outputs: Iterator[tuple[int, RequestOutput]]):
        """The whole non-streamed body (JSON-able)."""

    def sse(self, outputs: Iterator[tuple[int, RequestOutput]]) -> Iterator[bytes]:
        """SSE events, ending with the API's terminator."""

    def error_event(self, err: APIError) -> list[bytes]:
        """The in-band events for an error after the stream started."""


def begin(st: ServeState, req, parse):
    """The common start of a POST: shutdown check, body parsing, model check, this thread's tokenizer."""
    st.check_accepting()
    body = read_json(req, st.settings.max_request_bytes)
    if body.get("no_logs") is True:  # SGLang's field: keep this request out of the production log
        req.context.trnrt_no_logs = True
    creq = parse(body)
    st.check_model(getattr(creq, "model", None))
    return creq, st.tokinfo()


def require_prompt_logprobs(st: ServeState, param: str, err: Callable[[str, str | None], APIError] = bad_request
                            ) -> None:
    """A request asking for prompt logprobs on a server started without --prompt-logprobs: a 400
    naming the route's own field (`param`) and the flag, before any tokenization."""
    if not getattr(st.engine, "prompt_logprobs", False):
        from trnrt.engine.core.intake import PROMPT_LOGPROBS_OFF_MESSAGE

        raise err(PROMPT_LOGPROBS_OFF_MESSAGE.format(param=param), param)


def client_gone(req) -> Callable[[], bool]:
    probe = req.env.get("waitress.client_disconnected")
    return probe if probe is not None else (lambda: False)


class Admission:
    """One admission slot of the HTTP layer (503 when full), held from before the body is parsed
    and tokenized until the response is written, so tokenization work counts against admission too.

    Use as a context manager around parse -> render -> submit: an exception (or a handler that
    returns without submitting) releases the slot; `submit(..., admission=adm)` hands it to the
    `Submitted`, whose close() releases it.
    """

    def __init__(self, st: ServeState):
        st.acquire()
        self.st = st
        self.held = True
        self.transferred = False

    def release(self) -> None:
        if self.held:
            self.held = False
            self.st.release()

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        if not self.transferred:
            self.release()


class Submitted:
    """The engine requests of one HTTP request in flight: their streams, draining, and cleanup."""

    def __init__(self, st: ServeState, reqs: list[GenerateRequest], streams: list,
                 admission: Admission | None = None, req=None):
        self.st, self.reqs, self.streams = st, reqs, streams
        self.admission = admission
        self.route = req.path if req is not None else None  # None: an internal probe, never logged
        self.no_logs = bool(getattr(req.context, "trnrt_no_logs", False)) if req is not None else False
        self.done = [False] * len(reqs)
        self.closed = False

    def outputs(self, gone: Callable[[], bool]) -> Iterator[tuple[int, RequestOutput]]:
        """(index, output) until every request finished; raises sse.ClientGone if the client left."""
        for i, o in sse.drain_streams(self.streams, gone, self.st.settings.poll_interval_s):
            if o.finished:
                self.done[i] = True
            yield i, o

    def close(self) -> None:
        """Abort what has not finished (a no-op for finished requests) and release admission."""
        if self.closed:
            return
        self.closed = True
        for g, d in zip(self.reqs, self.done):
            if not d:
                self.st.engine.abort(g.request_id)
        if self.admission is not None:
            self.admission.release()
        else:
            self.st.release()
        if self.st.prod_log is not None:  # the production log joins this with the engine's timings
            self.st.prod_log.on_request_closed(self.route, [g.request_id for g in self.reqs],
                                               no_logs=self.no_logs, stream=bool(self.reqs and self.reqs[0].stream))


def submit(st: ServeState, reqs: list[GenerateRequest], field_name: Callable[[str | None], str | None],
           err: Callable[[str, str | None], APIError] = bad_request, *, admission: Admission | None = None,
           req=None) -> Submitted:
    """Submit `reqs` together; an engine refusal is a 4xx naming the field as the client spelled it
    (`field_name` maps engine names). With `admission` the slot taken before parsing is handed to
    the result; without, one is taken here (503 when the HTTP layer is full). With `req`, a
    client that left while its prompt was tokenized is not submitted at all."""
    own = admission is None
    if own:
        admission = Admission(st)
    try:
        if req is not None and client_gone(req)():
            raise bad_request("client closed the request")  # nobody reads it; nothing to run
        streams = st.engine.submit_many(reqs)
    except BaseException as e:
        if own:
            admission.release()
        if isinstance(e, InvalidRequestError):
            name, msg = field_name(e.field), str(e)
            if e.field and name and msg.startswith(e.field + " "):  # the message names it as the client did
                msg = name + msg[len(e.field):]
            raise err(msg, name)
        if isinstance(e, Exception) and not isinstance(e, APIError):
            # engine stopped or broken: not the client's fault, not a 500 either
            log.warning("engine refused request %s: %s", reqs[0].request_id if reqs else "-", e)
            raise unavailable(f"The engine cannot accept requests: {e}")
        raise
    admission.transferred = True
    return Submitted(st, reqs, list(streams), admission, req=req)


def sse_headers(resp) -> None:
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


def respond(req, resp, sub: Submitted, renderer: Renderer, stream: bool) -> None:
    """An SSE body (closed by the server when done or when the client goes away) or the
    collected JSON; `sub` is closed either way."""
    gone = client_gone(req)
    if stream:
        outputs = _first_output(sub, gone)  # before the headers: a system abort is still a plain HTTP error
        sse_headers(resp)
        resp.stream = sse.StreamBody(_sse_body(sub, renderer, outputs, req.path), sub.close)
        return
    try:
        resp.media = renderer.collect(sub.outputs(gone))
    except sse.ClientGone:
        raise bad_request("client closed the request")  # nobody reads it; the abort is what matters
    finally:
        sub.close()


def _first_output(sub: Submitted, gone) -> Iterator[tuple[int, RequestOutput]]:
    """Wait for the first engine output of a streamed request before anything is written. If it
    is a system abort (queue full, displaced by a higher priority request, shutdown) the request
    never started: raise its HTTP error (SGLang's envelope, QUEUE_FULL_HEADERS where they apply)
    and close `sub`. Otherwise return every output, that one first."""
    rest = sub.outputs(gone)
    try:
        first = next(rest, None)
    except sse.ClientGone:
        sub.close()
        raise bad_request("client closed the request")  # nobody reads it; the abort is what matters
    except BaseException:
        sub.close()
        raise
    if first is None:
        return rest
    err = system_error(first[1]) if first[1].finished else None
    if err is not None:
        sub.close()  # aborts the other requests of a batch
        raise err
    return itertools.chain([first], rest)


def _sse_body(sub: Submitted, renderer: Renderer, outputs, route: str = "-") -> Iterator[bytes]:
    try:
        yield from renderer.sse(outputs)
    except sse.ClientGone:
        return
    except APIError as e:  # after the headers the status cannot change: report in-band
        yield from renderer.error_event(e)
    except Exception as e:
        log.exception("stream of %s on %s failed", sub.reqs[0].request_id if sub.reqs else "-", route)
        yield from renderer.error_event(APIError(500, f"Internal server error: {type(e).__name__}",
                                                 type_="internal_error"))
    finally:
        sub.close()
