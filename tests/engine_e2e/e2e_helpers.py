"""Helpers for the end-to-end engine tests: collecting streams, waiting for idle, hooking steps."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from trnrt.engine.request import FinishReason, GenerateRequest, SamplingParams

TIMEOUT_S = 60.0
N_NEW = 12  # tokens generated per request in the parity tests
EOS_PROMPT = "The weather in Paris is"  # greedy output of this prompt supplies eos_engine's extra EOS id


@dataclass
class Collected:
    """Everything one request streamed."""

    request_id: str
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_outputs: int = 0
    finished: bool = False

    def add(self, out) -> None:
        self.num_outputs += 1
        self.output_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.chunks.append(out.new_text)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.error = out.error


def collect(stream, timeout: float = TIMEOUT_S) -> Collected:
    """Drain a stream to its finished output (fails instead of hanging if the engine stalls)."""
    c = Collected(stream.request_id)
    deadline = time.monotonic() + timeout
    while not c.finished:
        out = stream.get(timeout=max(0.0, deadline - time.monotonic()))
        assert out is not None, f"request {stream.request_id} produced nothing for {timeout} s"
        c.add(out)
    return c


class Collector:
    """Polls several streams without blocking (for staggered submissions)."""

    def __init__(self):
        self.streams: list = []
        self.results: list[Collected] = []

    def add(self, stream) -> None:
        self.streams.append(stream)
        self.results.append(Collected(stream.request_id))

    def poll(self) -> None:
        for s, c in zip(self.streams, self.results):
            while not c.finished:
                out = s.get(timeout=0)
                if out is None:
                    break
                c.add(out)

    def wait(self, cond, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if cond(self):
                return
            assert time.monotonic() < deadline, "timed out waiting for engine outputs"
            time.sleep(0.002)

    def wait_all(self, timeout: float = TIMEOUT_S) -> list[Collected]:
        self.wait(lambda c: all(r.finished for r in c.results), timeout)
        return self.results

    @property
    def num_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.results)


def submit(engine, ids: list[int], **params):
    req = GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(**params))
    return engine.submit(req)


def submit_together(engine, items: list[tuple[list[int], dict]]) -> list:
    """Submit several requests so that the engine thread sees them all in one inbox drain: the GIL is
    kept (switch interval 1 s) across the submits, which make no blocking call when every request
    has a seed (an unseeded one draws os.urandom)."""
    import sys

    assert all(p.get("seed") is not None for _, p in items)
    reqs = [GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(**p)) for ids, p in items]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        return [engine.submit(r) for r in reqs]
    finally:
        sys.setswitchinterval(interval)


def run(engine, ids: list[int], **params) -> Collected:
    return collect(submit(engine, ids, **params))


def greedy(engine, ids: list[int], n: int) -> list[int]:
    c = run(engine, ids, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert c.error is None and len(c.output_ids) == n, c
    return c.output_ids


def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_unfinished_requests() or not engine._inbox.empty():
        assert time.monotonic() < deadline, f"engine not idle: {engine.scheduler.stats()}"
        time.sleep(0.005)


def assert_clean(engine) -> None:
    """The engine is idle, alive, and holds no page or slot; the scheduler's books balance."""
    wait_idle(engine)
    assert engine.thread.is_alive()
    assert engine.cache.num_used_blocks == 0, f"{engine.cache.num_used_blocks} pages leaked"
    assert engine.cache.num_used_slots == 0, f"{engine.cache.num_used_slots} slots leaked"
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    engine.scheduler.check_integrity()


@contextlib.contextmanager
def hook_execute(engine, after=None, before=None):
    """Wrap engine.runner.execute (it runs on the engine thread, which alone owns engine state, so
    the hooks may read the scheduler). before(rows) runs before the model, after(rows, results) after.
    Yields the list of every step's rows."""
    runner = engine.runner
    inner = runner.execute
    steps: list = []

    def execute(rows):
        steps.append(list(rows))
        if before is not None:
            before(rows)
        results = inner(rows)
        if after is not None:
            after(rows, results)
        return results

    runner.execute = execute
    try:
        yield steps
    finally:
        del runner.execute


def slot_of(engine, request_id: str) -> int | None:
    """The slot of a live request (engine thread only, i.e. inside a hook)."""
    seq = engine.scheduler.get_sequence(request_id)
    return None if seq is None else seq.slot_id
