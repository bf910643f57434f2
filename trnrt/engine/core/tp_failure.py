"""After a mirrored runner call raised on some rank: did every rank fail, or this one alone?

A healthy step exchanges nothing extra; this module runs only after a failure. The ranks run the
same call on the same inputs, so most failures (a bad input that raises before any collective) are
shared, and the engine then fails that step's requests and goes on (as at TP = 1). A failure on one
rank alone (an OOM of its shard, a bug in its slice) leaves the others waiting in a model collective
for TRNRT_TP_TIMEOUT_S, and the ranks' states may have diverged: it must end the server at once,
as a dead rank does (rank 0 exits RANK_DIED_EXIT_CODE, the server answers 503 and exits 3).

The exchange, on the op channel (trnrt.engine.core.tp_runner.RankBroadcaster):

* rank 0's call raised: rank 0 sends ("failed", op, error) and gathers one answer from every rank;
  a worker whose same call raised answers its own error, a worker whose call succeeded answers
  None. Every rank failed: a shared failure, rank 0 re-raises to the engine. Otherwise (a worker
  answered None, or did not answer within `failure_wait_s()` because it is still waiting in a
  model collective for rank 0): `on_fatal`, naming the ranks and the error.
* a worker's call raised: it waits up to `failure_wait_s()` for rank 0's "failed". It comes: a
  shared failure, the worker answers and goes on. Anything else comes (rank 0 went on), or
  nothing (rank 0 waits in a collective for this rank): the failure is this rank's alone, it logs
  one line naming the rank, the call and the error and exits LONE_FAILURE_EXIT_CODE; rank 0's
  watchdog (or, on another node, the broken channel) then takes the server down.

The waits are timers, not collective timeouts: the op channel's timeout is long (idle engines), and
a timer bounds the wait whatever the transport does with a peer that is not listening.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("trnrt.engine.core.tp")

FAILED_OP = "failed"
FAILURE_WAIT_ENV = "TRNRT_TP_FAILURE_WAIT_S"
# Long enough for a loaded rank 0 to reach the same failure (the ranks start a call together and
# run the same code up to it), short enough that a lone failure ends the server within ~10 s.
DEFAULT_FAILURE_WAIT_S = 3.0
# A worker whose call failed where rank 0's did not (its watchdog line on rank 0 says so).
LONE_FAILURE_EXIT_CODE = 4


def failure_wait_s() -> float:
    env = os.environ.get(FAILURE_WAIT_ENV, "").strip()
    return float(env) if env else DEFAULT_FAILURE_WAIT_S


def describe(exc: BaseException) -> str:
    """'RuntimeError: message' (one line, bounded: it travels in the channel and the log)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:
            pass


def exit_lone_failure(rank: int, op: str, error: str, why: str) -> None:
    """A worker's lone failure: one critical line, then exit at once (no return). os._exit: the
    main thread may sit in a collective that will never complete."""
    log.critical("tensor-parallel rank %d: %r raised %s, and %s: the failure is this rank's alone; exiting "
                 "(code %d) so that the server stops and is restarted", rank, op, error, why, LONE_FAILURE_EXIT_CODE)
    _flush_logs()
    os._exit(LONE_FAILURE_EXIT_CODE)


def _timer(seconds: float, fn, *args) -> threading.Timer:
    t = threading.Timer(seconds, fn, args)
    t.daemon = True
    t.start()
    return t


def confirm_on_rank_zero(channel, op: str, exc: BaseException, on_fatal) -> None:
    """Rank 0's call `op` raised `exc` (after it was broadcast; under the runner's lock). Returns
    when every rank failed the same call (the caller re-raises); else `on_fatal` (no return)."""
    error = describe(exc)
    wait_s = failure_wait_s()
    timer = _timer(wait_s, on_fatal, f"rank 0's {op!r} raised {error}, and the tensor-parallel ranks did not all "
                                     f"answer within {wait_s:.0f} s (a rank is still in a model collective: the "
                                     f"failure is rank 0's alone)")
    try:
        channel.send(FAILED_OP, op, error)
        answers = channel.gather({"rank": 0, "failed": error})
    except Exception as e:
        timer.cancel()
        on_fatal(f"rank 0's {op!r} raised {error}, and telling the tensor-parallel ranks failed: {e}")
        raise
    timer.cancel()
    alone = [a["rank"] for a in answers if not a.get("failed")]
    if alone:
        on_fatal(f"rank 0's {op!r} raised {error}, but tensor-parallel rank(s) {alone} did not fail: the failure is "
                 f"rank 0's alone and the ranks' states may differ")
        return
    log.warning("%r failed on every tensor-parallel rank (%s): that step's requests fail, the ranks go on", op,
                "; ".join(f"rank {a['rank']}: {a['failed']}" for a in answers))


def confirm_on_worker(channel, rank: int, op: str, exc: BaseException) -> None:
    """A worker's call `op` raised `exc`. Returns when rank 0 reports that it failed too (a shared
    failure: the worker goes on); else the worker exits LONE_FAILURE_EXIT_CODE (no return)."""
    error = describe(exc)
    wait_s = failure_wait_s()
    timer = _timer(wait_s, exit_lone_failure, rank, op, error, f"rank 0 did not report a failure within {wait_s:.0f} s")
    nxt, args = channel.recv()
    timer.cancel()
    if nxt != FAILED_OP:
        exit_lone_failure(rank, op, error, f"rank 0 went on ({nxt!r} came next)")
    log.warning("rank %d: %r failed as on rank 0 (%s)", rank, op, error, exc_info=exc)
    channel.gather({"rank": rank, "failed": error})


def answer_rank_zero_failure(channel, rank: int, args: tuple) -> None:
    """A worker got rank 0's "failed" for a call that succeeded here: say so (rank 0 then stops)."""
    op, error = (tuple(args) + (None, None))[:2]
    log.error("tensor-parallel rank %d: rank 0's %r raised %s, which succeeded here", rank, op, error)
    channel.gather({"rank": rank, "failed": None})
