"""The `priority` request field, --abort-on-priority-when-disabled, and the engine's queue limits
(--max-queued-requests, --max-queued-tokens) as the three generation routes answer them: SGLang's
503 envelope, a plain HTTP 503 for a stream refused before its first chunk, and the queue-full
headers."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from serve_support import eos_ids, make_script, make_scripted_engine, start_server

MODEL = "trnrt-tiny"
GEN, COMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
QUEUE_FULL = "The request queue is full."
DISPLACED = "The request is aborted by a higher priority request."
PRIORITY_DISABLED = "Using priority is disabled for this server. Please send a new request without a priority."


def body(path: str, stream: bool = False, text: str = "SCRIPT:plain hi", **extra) -> dict:
    if path == GEN:
        b = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": stream}
    elif path == COMP:
        b = {"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0, "stream": stream}
    else:
        b = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0,
             "stream": stream}
    b.update(extra)
    return b


def sglang_503(message: str) -> dict:
    return {"object": "error", "message": message, "type": "503", "param": None, "code": 503}


def stop_servers(engine, *servers) -> None:
    from trnrt.serve import get_state
    from trnrt.serve.server import stop_in_thread

    engine.shutdown(0.0)
    for s in servers:
        get_state(s.app).wait_idle(5.0)
        stop_in_thread(s.srv, s.thread)


@pytest.fixture(scope="module")
def plain(tokenizer_factory):
    """One scripted engine (no priority scheduling) behind two servers: the default settings, and
    --abort-on-priority-when-disabled."""
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    ignoring = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL))
    refusing = start_server(engine, tokenizer_factory,
                            ServeSettings(served_model_name=MODEL, abort_on_priority_when_disabled=True))
    yield ignoring, refusing
    stop_servers(engine, ignoring, refusing)


def queue_engine(tokenizer_factory, **sched):
    """A scripted engine running one request at a time, with SchedulerConfig changes `sched`."""
    from trnrt.engine.core.engine import Engine

    tok = tokenizer_factory()
    e = Engine.scripted(tok, make_script(tok), eos_token_ids=eos_ids(tok), max_running_requests=1,
                        max_model_len=1024, start=False)
    scfg = dataclasses.replace(e.scheduler_config, max_num_seqs=1, **sched)
    return Engine(e.runner, e.tokenizer, e.model_info, e.engine_config, scfg, submit_log_size=64)


@pytest.fixture(scope="module")
def queued(tokenizer_factory):
    """max_num_seqs=1, max_queued_requests=1, priority scheduling on (larger is preferred)."""
    from trnrt.serve import ServeSettings

    engine = queue_engine(tokenizer_factory, max_queued_requests=1, enable_priority_scheduling=True)
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, enable_priority_scheduling=True))
    yield srv
    engine.runner.paused.clear()
    stop_servers(engine, srv)


# --- the field ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
def test_priority_reaches_the_engine(plain, path):
    srv, _ = plain
    for prio in (7, -3, None):
        extra = {"priority": prio} if prio is not None else {}
        status, data, _ = srv.raw("POST", path, body(path, rid=f"prio-{path[-4:]}-{prio}", **extra))
        assert status == 200, data  # ignored without priority scheduling (SGLang)
        g = next(r for r in reversed(srv.engine.submitted) if r.request_id == f"prio-{path[-4:]}-{prio}")
        assert g.priority == prio


def test_generate_batch_priorities(plain):
    srv, _ = plain
    status, data, _ = srv.raw("POST", GEN, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2},
                                            "rid": "bprio", "priority": [1, None]})
    assert status == 200, data
    got = {r.request_id: r.priority for r in srv.engine.submitted if r.request_id.startswith("bprio_")}
    assert got == {"bprio_0": 1, "bprio_1": None}


@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
@pytest.mark.parametrize("value", [True, False, 1.5, "1", [1], {"p": 1}, 2 ** 63, float("inf")],
                         ids=["true", "false", "1.5", "str", "list", "obj", "2^63", "inf"])
def test_priority_must_be_an_integer(plain, path, value):
    srv, _ = plain
    raw = body(path, priority=value)
    import json

    text = json.dumps(raw).replace("Infinity", "1e999")  # JSON has no Infinity: a number too big for a float
    status, data, _ = srv.raw("POST", path, text)
    assert status == 400, data
    err = data["error"]
    assert "priority" in (err if isinstance(err, str) else f"{err['param']} {err['message']}"), data


def test_integral_float_priority(plain):
    """The OpenAI routes read 2.0 as 2 (as every integer there, SGLang's pydantic lax mode);
    /generate's contract does not."""
    srv, _ = plain
    assert srv.raw("POST", COMP, body(COMP, priority=2.0))[0] == 200
    status, data, _ = srv.raw("POST", GEN, body(GEN, priority=2.0))
    assert status == 400 and "priority" in data["error"], data


@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_abort_on_priority_when_disabled(plain, path, stream):
    _, srv = plain
    status, data, headers = srv.raw("POST", path, body(path, stream, priority=1))
    assert status == 503 and data == sglang_503(PRIORITY_DISABLED), data
    assert "X-Trnrt-Queue-Full" not in headers  # retrying the same request will not help
    assert srv.raw("POST", path, body(path, stream, priority=None))[0] == 200  # null: no priority
    assert srv.raw("POST", path, body(path, stream))[0] == 200


# --- the queue limit ---------------------------------------------------------------------------
class Fired:
    """Requests sent from threads; `results[name]` = (status, parsed body or text, headers)."""

    def __init__(self, srv):
        self.srv = srv
        self.results: dict = {}
        self.threads: list[threading.Thread] = []

    def fire(self, name: str, path: str, b: dict) -> None:
        def run():
            self.results[name] = self.srv.raw("POST", path, b, timeout=30)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> dict:
        for t in self.threads:
            t.join(30)
        return self.results


def wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def pending(srv) -> int:
    return srv.engine.load().num_pending_reqs


def hold_one_running(srv, fired: Fired) -> None:
    """Pause the runner with request `running` inside a step (it holds the only running seat)."""
    srv.engine.runner.paused.set()
    fired.fire("running", GEN, body(GEN))
    wait_for(srv.engine.runner.paused.holding.is_set, "the running request's step")


def assert_queue_full(result, message: str = QUEUE_FULL) -> None:
    status, data, headers = result
    assert status == 503 and data == sglang_503(message), (status, data)
    assert headers.get("Retry-After") == "1" and headers.get("X-Trnrt-Queue-Full") == "1", headers
    assert headers.get("Content-Type", "").startswith("application/json"), headers  # not an SSE stream


def test_queue_full_is_503_on_every_route(queued):
    """One running, one waiting (max_queued_requests=1): every further request, streamed or not,
    on every route, is refused with SGLang's 503 and the queue-full headers."""
    srv = queued
    fired = Fired(srv)
    try:
        hold_one_running(srv, fired)
        fired.fire("waiting", COMP, body(COMP))
        wait_for(lambda: pending(srv) == 2, "the waiting request")
        refused = [(f"{p}-{s}", p, s) for p in (GEN, COMP, CHAT) for s in (False, True)]
        for name, path, stream in refused:
            fired.fire(name, path, body(path, stream))
        wait_for(lambda: pending(srv) == 2 + len(refused), "every request to be submitted")
    finally:
        srv.engine.runner.paused.clear()
    results = fired.join()
    assert results["running"][0] == 200 and results["waiting"][0] == 200, results
    for name, _, _ in refused:
        assert_queue_full(results[name])


def test_higher_priority_displaces_the_worst_waiting_request(queued):
    srv = queued
    fired = Fired(srv)
    try:
        hold_one_running(srv, fired)
        fired.fire("low", COMP, body(COMP, stream=True, priority=0))  # waits, then is displaced
        wait_for(lambda: pending(srv) == 2, "the low-priority request")
        fired.fire("high", CHAT, body(CHAT, stream=True, priority=100))  # displaces it
        wait_for(lambda: pending(srv) == 3, "the high-priority request")
        fired.fire("worse", GEN, body(GEN, priority=-5))  # worse than the one waiting: refused
        wait_for(lambda: pending(srv) == 4, "the worse request")
    finally:
        srv.engine.runner.paused.clear()
    results = fired.join()
    assert results["running"][0] == 200
    assert_queue_full(results["low"], DISPLACED)
    status, text, headers = results["high"]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text, text
    assert_queue_full(results["worse"])


QUEUED_TOKENS = 8  # --max-queued-tokens of the `token_queued` engine
LONG_TEXT = "SCRIPT:plain " + " ".join(["word"] * 60)


@pytest.fixture(scope="module")
def token_queued(tokenizer_factory):
    """max_num_seqs=1, max_queued_tokens=QUEUED_TOKENS, no priority scheduling."""
    from trnrt.serve import ServeSettings

    engine = queue_engine(tokenizer_factory, max_queued_tokens=QUEUED_TOKENS)
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL))
    yield srv
    engine.runner.paused.clear()
    stop_servers(engine, srv)


def test_queued_tokens_limit_is_503_on_every_route(token_queued, tokenizer_factory):
    """One running; a prompt longer than --max-queued-tokens arrives at the empty waiting queue and
    is queued (it runs); then every request, however short, would go past the limit: SGLang's
    queue-full 503 with the queue-full headers, streamed or not, on every route."""
    srv = token_queued
    assert len(tokenizer_factory().encode(LONG_TEXT, add_special_tokens=False)) > QUEUED_TOKENS
    fired = Fired(srv)
    try:
        hold_one_running(srv, fired)
        fired.fire("long", GEN, body(GEN, text=LONG_TEXT))
        wait_for(lambda: pending(srv) == 2, "the long request")
        refused = [(f"{p}-{s}", p, s) for p in (GEN, COMP, CHAT) for s in (False, True)]
        for name, path, stream in refused:
            fired.fire(name, path, body(path, stream))
        wait_for(lambda: pending(srv) == 2 + len(refused), "every request to be submitted")
    finally:
        srv.engine.runner.paused.clear()
    results = fired.join()
    assert results["running"][0] == 200 and results["long"][0] == 200, results
    for name, _, _ in refused:
        assert_queue_full(results[name])
    assert srv.raw("POST", COMP, body(COMP))[0] == 200  # nothing waits now: a short one is queued


# --- how the routes answer the engine's refusals (fabricated finishes: no engine support needed) --
class FakeStream:
    """An engine stream that hands out fixed outputs, one per get()."""

    def __init__(self, request_id: str, outputs: list):
        self.request_id = request_id
        self._outs = list(outputs)

    def get(self, timeout=None):
        return self._outs.pop(0) if self._outs else None

    def __iter__(self):
        while self._outs:
            yield self._outs.pop(0)


class RefusingEngine:
    """The scripted engine, except that a request whose id starts with `qfull` / `displaced` ends at
    once with the engine's queue-full / displaced abort, and one starting with `midabort` gets a
    token, then a 503 abort."""

    def __init__(self, engine):
        self._e = engine

    def __getattr__(self, name):
        return getattr(self._e, name)

    def submit_many(self, reqs):
        from trnrt.engine.output.outputs import RequestOutput
        from trnrt.engine.request import FinishReason

        fake = ("qfull", "displaced", "midabort")
        real = iter(self._e.submit_many([r for r in reqs if not r.request_id.startswith(fake)]))
        out = []
        for r in reqs:
            n = len(r.prompt_token_ids)
            if r.request_id.startswith(("qfull", "displaced")):
                msg = QUEUE_FULL if r.request_id.startswith("qfull") else DISPLACED
                out.append(FakeStream(r.request_id, [RequestOutput(
                    r.request_id, finished=True, num_prompt_tokens=n,
                    finish_reason=FinishReason("abort", message=msg, status_code=503))]))
            elif r.request_id.startswith("midabort"):
                out.append(FakeStream(r.request_id, [
                    RequestOutput(r.request_id, new_token_ids=[39], new_text="Hello", num_prompt_tokens=n,
                                  num_output_tokens=1),
                    RequestOutput(r.request_id, finished=True, num_prompt_tokens=n, num_output_tokens=1,
                                  finish_reason=FinishReason("abort", message="server shutting down", status_code=503))]))
            else:
                out.append(next(real))
        return out

    def submit(self, req):
        return self.submit_many([req])[0]


@pytest.fixture(scope="module")
def refusing(tokenizer_factory):
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    srv = start_server(RefusingEngine(engine), tokenizer_factory, ServeSettings(served_model_name=MODEL))
    yield srv
    stop_servers(engine, srv)


@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["qfull", "displaced"])
def test_refused_before_the_first_chunk_is_a_plain_503(refusing, path, stream, kind):
    result = refusing.raw("POST", path, body(path, stream, rid=f"{kind}-{path[-4:]}-{stream}"))
    assert_queue_full(result, QUEUE_FULL if kind == "qfull" else DISPLACED)


def test_batch_with_a_refused_item_is_503_and_frees_the_rest(refusing):
    from serve_support import assert_idle

    for stream in (False, True):
        # the refused item first: the drain polls it first, so its finish is the first output
        result = refusing.raw("POST", GEN, {"text": ["b", "SCRIPT:long a"], "rid": [f"qfull-{stream}", f"ok-{stream}"],
                                            "sampling_params": {"max_new_tokens": 200}, "stream": stream})
        assert_queue_full(result)
    assert_idle(refusing)  # the batch's other request was aborted


def test_system_abort_after_the_first_chunk_is_in_band(refusing):
    import json

    status, text, _ = refusing.raw("POST", CHAT, body(CHAT, True, rid="midabort-chat"))
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[-1] == {"error": sglang_503("server shutting down")}, events  # SGLang: inside `error`
    assert text.rstrip().endswith("data: [DONE]")
    status, text, _ = refusing.raw("POST", GEN, body(GEN, True, rid="midabort-gen"))
    assert status == 200
    last = json.loads([line for line in text.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "server shutting down",
                                                  "status_code": 503, "err_type": None}
    # not streamed: the status itself, no queue-full headers (the server is stopping, not full)
    status, data, headers = refusing.raw("POST", COMP, body(COMP, rid="midabort-comp"))
    assert status == 503 and data == sglang_503("server shutting down") and "Retry-After" not in headers


def test_http_capacity_503_carries_the_queue_full_headers(tokenizer_factory):
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, max_concurrent_requests=1))
    fired = Fired(srv)
    try:
        hold_one_running(srv, fired)
        for path in (GEN, COMP, CHAT):
            status, data, headers = srv.raw("POST", path, body(path))
            assert status == 503, data
            assert headers.get("Retry-After") == "1" and headers.get("X-Trnrt-Queue-Full") == "1", headers
    finally:
        engine.runner.paused.clear()
        fired.join()
        stop_servers(engine, srv)
