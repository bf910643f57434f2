"""A mirrored call that raises on every rank, or on one rank alone (trnrt.engine.core.tp_failure),
without processes: rank 0's MirroredRunner and a worker's serve_rank on two threads, the op channel
as queues, the model's collective as a barrier (a rank that leaves aborts it, as a dead peer's
closed sockets fail a gloo collective). The exits are recorded instead of taken."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from trnrt.engine.core import tp_failure
from trnrt.engine.core.tp_config import ParallelConfig
from trnrt.engine.core.tp_runner import MirroredRunner, serve_rank

WAIT_S = 1.0


class Gone(Exception):
    """The worker thread's stand-in for os._exit."""


class Link:
    """The op channel between two threads: `down` carries rank 0's ops, the gathers meet in `g0`/`g1`."""

    def __init__(self):
        self.down, self.g0, self.g1 = queue.Queue(), queue.Queue(), queue.Queue()
        self.worker_gone = threading.Event()


class Chan0:
    seconds, calls = 0.0, 0

    def __init__(self, link):
        self.link = link

    def send(self, op, *args):
        if self.link.worker_gone.is_set():
            raise ConnectionError("the worker is gone")
        self.link.down.put((op, args))

    def gather(self, obj):
        self.link.g0.put(obj)
        try:
            return [obj, self.link.g1.get(timeout=1.5 * WAIT_S)]
        except queue.Empty:
            raise ConnectionError("the worker did not answer") from None


class Chan1:
    seconds, calls = 0.0, 0

    def __init__(self, link):
        self.link = link

    def recv(self):
        while not self.link.worker_gone.is_set():
            try:
                return self.link.down.get(timeout=0.02)
            except queue.Empty:
                pass
        raise Gone()

    def gather(self, obj):
        self.link.g1.put(obj)
        return [self.link.g0.get(timeout=3 * WAIT_S), obj]


class Runner:
    """`execute` meets the other rank at the barrier (the model's collective); `fail[(call, where)]`
    makes call number `call` raise before or after it."""

    def __init__(self, barrier, fail):
        self.barrier, self.fail, self.calls = barrier, fail, 0
        self.model = None

    def execute(self, rows):
        self.calls += 1
        if (self.calls, "before") in self.fail:
            raise RuntimeError(f"boom before, call {self.calls}")
        self.barrier.wait(timeout=10 * WAIT_S)
        if (self.calls, "after") in self.fail:
            raise RuntimeError(f"boom after, call {self.calls}")
        return [SimpleNamespace(token_id=5, extra_token_ids=[]) for _ in rows]


class Pair:
    """Rank 0 (a MirroredRunner, `fatal` records on_fatal) and a worker thread running serve_rank
    (`exits` records its lone-failure exits)."""

    def __init__(self, monkeypatch, fail0=(), fail1=()):
        monkeypatch.setenv(tp_failure.FAILURE_WAIT_ENV, str(WAIT_S))
        self.link = Link()
        self.barrier = threading.Barrier(2)
        self.fatal, self.exits, self.worker_code = [], [], None

        def fake_exit(rank, op, error, why):  # the worker leaves: its collective partner sees it
            self.exits.append((time.monotonic(), rank, op, error, why))
            self.link.worker_gone.set()
            self.barrier.abort()
            if threading.current_thread() is self.worker:
                raise Gone()  # a timer's call returns: the worker's recv sees worker_gone

        monkeypatch.setattr(tp_failure, "exit_lone_failure", fake_exit)
        self.r0 = MirroredRunner(Runner(self.barrier, set(fail0)), Chan0(self.link), None,
                                 parallel=ParallelConfig(tp_size=2), check_every=0,
                                 on_fatal=lambda m: self.fatal.append((time.monotonic(), m)))
        self.worker = threading.Thread(target=self._serve, args=(Runner(self.barrier, set(fail1)),), daemon=True)
        self.worker.start()

    def _serve(self, runner):
        try:
            self.worker_code = serve_rank(runner, Chan1(self.link), None, 1)
        except Gone:
            pass

    def step(self):
        return self.r0.execute([SimpleNamespace(seed=0)])


def test_a_failure_every_rank_shares_fails_the_step_and_the_ranks_go_on(monkeypatch):
    p = Pair(monkeypatch, fail0={(2, "before")}, fail1={(2, "before")})
    p.step()
    with pytest.raises(RuntimeError, match="boom before, call 2"):
        p.step()
    p.step()  # both ranks are in step again
    p.r0.close()
    p.worker.join(5)
    assert p.worker_code == 0 and not p.fatal and not p.exits
    assert p.r0.stats()["agreement"]["mismatches"] == 0


def test_a_worker_failing_alone_before_a_collective_exits_within_the_wait(monkeypatch):
    p = Pair(monkeypatch, fail1={(1, "before")})
    t0 = time.monotonic()
    with pytest.raises(Exception):
        p.step()  # rank 0 waits in the collective until the worker leaves
    (t_exit, rank, op, error, why), = p.exits
    assert (rank, op) == (1, "execute") and "RuntimeError: boom before, call 1" in error
    assert "did not report a failure" in why
    assert WAIT_S * 0.9 <= t_exit - t0 < WAIT_S + 2
    assert p.fatal, "rank 0 went on after its peer left"


def test_a_worker_failing_alone_after_the_collective_exits_when_rank_0_goes_on(monkeypatch):
    p = Pair(monkeypatch, fail1={(1, "after")})
    p.step()  # rank 0 succeeded
    try:
        p.step()  # the worker sees 'execute' instead of 'failed' and leaves
    except Exception:
        pass
    p.worker.join(5)
    (_, rank, op, error, why), = p.exits
    assert (rank, op) == (1, "execute") and "boom after" in error and "went on" in why


def test_rank_0_failing_alone_before_a_collective_is_fatal_within_the_wait(monkeypatch):
    p = Pair(monkeypatch, fail0={(1, "before")})
    t0 = time.monotonic()
    with pytest.raises(Exception):
        p.step()
    assert p.fatal, "rank 0's lone failure was survived"
    t_fatal, message = p.fatal[0]
    assert "rank 0's 'execute' raised RuntimeError: boom before, call 1" in message, message
    assert t_fatal - t0 < WAIT_S + 2
    p.barrier.abort()  # the worker leaves its collective (production: rank 0's exit kills it)


def test_rank_0_failing_alone_after_the_collective_is_fatal_at_once(monkeypatch):
    p = Pair(monkeypatch, fail0={(1, "after")})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom after"):
        p.step()
    t_fatal, message = p.fatal[0]
    assert "rank(s) [1] did not fail" in message and "boom after" in message, message
    assert t_fatal - t0 < WAIT_S  # the worker answered: no wait
    assert not p.exits
