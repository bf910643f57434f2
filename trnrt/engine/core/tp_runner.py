"""The broadcast between rank 0 and the worker ranks, in one place.

Rank 0's engine holds a `MirroredRunner`: every runner call that touches model state or runs a
graph (`MIRRORED_CALLS`: a step, the prefix cache's state copies, the speculative runner's
per-request release, the cache tiers' allocation, a warm-up, a cache flush) is first broadcast
as (op, args) on a CPU gloo group (`RankBroadcaster`), then run on rank 0's own runner. Each
worker (`serve_rank`) receives the same ops in the same order and makes the same call on its
own runner, so every rank runs the same step over the same inputs (RowInputs: the tokens, block
tables, slots, seeds and the logits processors' inputs); inside a step the model's collectives
(the world group) pair the ranks up. What a runner does inside a call (the speculative
decoder's verify, rollback and state copies, the drafter's MTP steps) is a deterministic function
of its inputs and of the previous calls, so it is mirrored with the call that makes it.

Sampling agrees on every rank because the logits are all-gathered to the whole vocabulary and
the seeds travel in the rows; rank 0's tokens are the ones the engine uses. Every rank folds the
tokens it sampled into a running digest (`TokenDigest`); every `check_every` steps and at
shutdown rank 0 gathers every rank's digest, step count, memory (RSS, weights, state: `RankMemory`)
and collective counts (`check`), and a mismatch is logged as an error and counted in /v1/stats'
`parallel` section. Each step's collectives (calls and wall seconds, timed in
trnrt.parallel.collectives._issue) are rank 0's count deltas around the step.

A call that raises on every rank (same inputs, same failure) is survived: the engine fails that
step's requests and goes on. A call that raises on some ranks only ends the server, as a dead rank
does; which one it was is settled by a short exchange that runs only after a failure
(trnrt.engine.core.tp_failure). A broken channel (a rank is gone) is fatal on rank 0 (`on_fatal`:
the engine process exits non-zero; trnrt.engine.core.tp_launch).
"""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import threading
import time
from array import array

from trnrt.engine.core.tp_failure import FAILED_OP, answer_rank_zero_failure, confirm_on_rank_zero, confirm_on_worker

log = logging.getLogger("trnrt.engine.core.tp")

MIRRORED_CALLS = ("execute", "apply_cache_ops", "release", "allocate_cache_tiers", "warm_up", "flush_cache")
HEARTBEAT_S = 1.0  # an idle rank 0 pings the ranks this often: a remote rank's death is seen within it


class RankBroadcaster:
    """Rank 0 -> every rank: (op, args) objects on a gloo group (pickled; the row inputs are small
    Python lists); `gather` collects one object from every rank on every rank."""

    def __init__(self, group, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.seconds = 0.0  # time spent in this channel's collectives (rank 0: sends)
        self.calls = 0

    def send(self, op: str, *args) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.broadcast_object_list([(op, args)], src=0, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    def recv(self) -> tuple[str, tuple]:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class TokenDigest:
    """A running hash of every token a rank's runner sampled (rows in order, with the speculative
    rows' extra tokens), and the number of steps folded in."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=8)
        self.steps = 0

    def add(self, results) -> None:
        ids = array("q")
        for r in results:
            ids.append(int(r.token_id))
            ids.extend(int(t) for t in r.extra_token_ids)
            ids.append(-1)  # row separator
        self._h.update(ids.tobytes())
        self.steps += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a tied or viewed weight counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


class RankMemory:
    """What a rank's runner holds, by use: `weight_bytes` (the model's parameters and buffers:
    the rank's shards), `state_bytes` (its ModelState and MTP state: KV pages, per-slot state) and
    `cache_tier_bytes` (the prefix cache's state checkpoints and host tiers, once allocated). The
    weights are counted once; the rest at each report (a few tensors)."""

    def __init__(self, runner):
        self._runner = runner
        self._weights: int | None = None

    def report(self) -> dict:
        r = self._runner
        if r is None:
            return {}
        out = {}
        try:
            if self._weights is None:
                m = r.model
                self._weights = _storage_bytes([*m.parameters(), *m.buffers()])
            out["weight_bytes"] = self._weights
            st = r.state
            mtp = getattr(st, "mtp", None)
            out["state_bytes"] = _storage_bytes([*st.tensors(), *(mtp.tensors() if mtp is not None else ())])
            tiers = [t for k in ("_ckpt", "_host_ckpt", "_host_pages") for t in (getattr(r, k, None) or {}).values()]
            out["cache_tier_bytes"] = _storage_bytes(tiers)
        except Exception:  # a runner without these (a test double): report what there is
            log.debug("rank memory", exc_info=True)
        return out


def spec_requests(runner) -> int | None:
    """Requests a speculative runner's drafter keeps state for (None: not speculative)."""
    drafter = getattr(runner, "drafter", None)
    return drafter.num_requests() if drafter is not None else None


def rank_report(rank: int, digest: TokenDigest, ctx, channel: RankBroadcaster, runner=None,
                memory: RankMemory | None = None) -> dict:
    """What a rank answers to a check: its digest and step count, memory (process RSS and, with
    `memory`, the runner's weights / state / cache tiers), its collectives' counts and seconds, and
    the requests its speculative drafter still tracks (`spec_requests`: every rank must forget a
    finished or aborted request, so the ranks agree on it between steps)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = None
    counts = ctx.stats.snapshot() if ctx is not None else {"calls": {}, "bytes": {}, "seconds": {}}
    return {"rank": rank, "pid": os.getpid(), "steps": digest.steps, "digest": digest.hexdigest(),
            "rss_bytes": rss, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **(memory.report() if memory is not None else {}),
            "collective_calls": sum(counts["calls"].values()), "collective_bytes": sum(counts["bytes"].values()),
            "collective_s": round(sum(counts["seconds"].values()), 6), "channel_s": round(channel.seconds, 6),
            "spec_requests": spec_requests(runner)}


class MirroredRunner:
    """Rank 0's runner: the local runner's interface, each MIRRORED_CALLS call broadcast first.

    Everything else (attributes, read-only queries such as `checkpoint_nbytes`) is the local
    runner's. `on_fatal(message)` is called (it does not return) when the channel breaks.
    """

    def __init__(self, runner, channel: RankBroadcaster, ctx, *, parallel, check_every: int, on_fatal, on_close=None,
                 model_kind: str = "replicated", reports: list | None = None):
        self.__dict__.update(_runner=runner, _channel=channel, _ctx=ctx, _parallel=parallel,
                             _check_every=check_every, _on_fatal=on_fatal, _on_close=on_close,
                             _lock=threading.Lock(), _digest=TokenDigest(), _closed=False, _model_kind=model_kind,
                             _checks=0, _mismatches=0, _last_reports=list(reports or []), _step_s=0.0,
                             _last_send=time.monotonic(), _memory=RankMemory(runner),
                             _coll_s=0.0, _coll_calls=0, _coll_last_s=None, _coll_last_calls=None)
        threading.Thread(target=self._heartbeat, name="trnrt-tp-heartbeat", daemon=True).start()

    def __getattr__(self, name):  # only called for what this class does not define
        return getattr(self.__dict__["_runner"], name)

    def __setattr__(self, name, value):  # e.g. the engine setting runner attributes
        setattr(self._runner, name, value)

    # -- mirrored calls ------------------------------------------------------------------------

    def _mirror(self, op: str, *args):
        with self._lock:
            if self._closed:
                raise RuntimeError("the tensor-parallel ranks are stopped")
            self._send(op, *args)
            try:
                return getattr(self._runner, op)(*args)
            except Exception as e:  # did every rank fail? (only after a failure: healthy steps pay nothing)
                confirm_on_rank_zero(self._channel, op, e, self._on_fatal)
                raise

    def _send(self, op: str, *args) -> None:  # under self._lock
        try:
            self._channel.send(op, *args)
        except Exception as e:  # a rank is gone: nothing can run any more
            self._on_fatal(f"broadcasting {op!r} to the tensor-parallel ranks failed: {e}")
            raise
        self.__dict__["_last_send"] = time.monotonic()

    def _heartbeat(self) -> None:
        """While the engine is idle, a 'ping' every HEARTBEAT_S: a send to a rank whose process
        is gone fails at once (its sockets are closed), so a dead rank on another node ends the
        engine within seconds even when no request comes (this node's ranks: the watchdog)."""
        while not self._closed:
            time.sleep(HEARTBEAT_S / 4)
            if time.monotonic() - self._last_send < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed:
                    self._send("ping")
            except Exception:
                return
            finally:
                self._lock.release()

    def execute(self, rows):
        # The step's collectives: the delta of rank 0's counts around the call (they are timed
        # in collectives._issue, eager calls only; warm-up and checks are outside any step).
        counts = self._ctx.stats if self._ctx is not None else None
        n0, s0 = counts.totals() if counts is not None else (0, 0.0)
        t0 = time.perf_counter()
        results = self._mirror("execute", rows)
        d = self.__dict__
        d["_step_s"] += time.perf_counter() - t0
        if counts is not None:
            n1, s1 = counts.totals()
            d["_coll_last_calls"], d["_coll_last_s"] = n1 - n0, s1 - s0
            d["_coll_calls"] += n1 - n0
            d["_coll_s"] += s1 - s0
        self._digest.add(results)
        if self._check_every and self._digest.steps % self._check_every == 0:
            self.check()
        return results

    def apply_cache_ops(self, ops):
        return self._mirror("apply_cache_ops", list(ops))

    def release(self, request_ids):
        return self._mirror("release", list(request_ids))

    def allocate_cache_tiers(self, num_checkpoints: int, num_host_pages: int, num_host_checkpoints: int):
        return self._mirror("allocate_cache_tiers", num_checkpoints, num_host_pages, num_host_checkpoints)

    def warm_up(self):
        return self._mirror("warm_up")

    @property
    def flush_cache(self):
        if not hasattr(self._runner, "flush_cache"):
            raise AttributeError("flush_cache")
        return lambda: self._mirror("flush_cache")

    # -- agreement -------------------------------------------------------------------------------

    def check(self) -> bool:
        """Gather every rank's digest (engine thread, between steps); True when all agree."""
        with self._lock:
            if self._closed:
                return not self._mismatches
            try:
                self._send("check")
                reports = self._channel.gather(rank_report(0, self._digest, self._ctx, self._channel, self._runner,
                                                           self._memory))
            except Exception as e:
                self._on_fatal(f"the tensor-parallel agreement check failed: {e}")
                raise
        agree = len({(r["digest"], r["steps"]) for r in reports}) == 1
        d = self.__dict__
        d["_checks"] += 1
        d["_last_reports"] = reports
        if not agree:
            d["_mismatches"] += 1
            log.error("tensor-parallel ranks disagree on their sampled tokens after %d steps: %s", self._digest.steps,
                      ", ".join(f"rank {r['rank']}: {r['digest']} ({r['steps']} steps)" for r in reports))
        return agree

    def close(self) -> None:
        """A last check, then stop the workers (they exit 0); idempotent. The check's outcome is
        logged either way (a supervisor's log shows that the ranks agreed to the end)."""
        if self._closed:
            return
        try:
            agree = self.check()
            reports = self._last_reports
            log.log(logging.INFO if agree else logging.ERROR,
                    "tensor-parallel ranks at close: %s after %d steps (%s; %d checks, %d mismatches)",
                    "agree" if agree else "DISAGREE", self._digest.steps,
                    ", ".join(f"rank {r['rank']}: {r['digest']} ({r['steps']} steps)" for r in reports),
                    self._checks, self._mismatches)
            with self._lock:
                self.__dict__["_closed"] = True
                self._channel.send("stop")
        except Exception:
            log.warning("stopping the tensor-parallel ranks failed", exc_info=True)
        finally:
            self.__dict__["_closed"] = True
            if self._on_close is not None:
                self._on_close()

    def stats(self) -> dict:
        """/v1/stats' `parallel` section (any thread): the layout, each rank's last report (memory,
        steps, digest; rank 0's is fresh, the others' are from the last check) and the agreement,
        the broadcast's and the model collectives' share of the steps (rank 0's view)."""
        d = self.__dict__
        steps = self._digest.steps
        own = rank_report(0, self._digest, self._ctx, self._channel, self._runner, self._memory)
        ranks = {r["rank"]: r for r in self._last_reports}
        ranks[0] = own
        coll_s, step_s = d["_coll_s"], d["_step_s"]
        last_s = d["_coll_last_s"]
        return {
            **self._parallel.reported(), "model": self._model_kind, "steps": steps,
            "agreement": {"checks": self._checks, "mismatches": self._mismatches,
                          "agree": self._mismatches == 0, "check_every": self._check_every},
            "broadcast_ms_per_step": round(1e3 * self._channel.seconds / steps, 4) if steps else None,
            "step_ms": round(1e3 * step_s / steps, 4) if steps else None,
            "step_s_total": round(step_s, 6),
            "collective_calls_per_step": round(d["_coll_calls"] / steps, 3) if steps else None,
            "collective_calls_last_step": d["_coll_last_calls"],
            "collective_s_last_step": None if last_s is None else round(last_s, 6),
            "collective_s_total": round(coll_s, 6),
            "collective_calls_total": d["_coll_calls"],
            "collective_ms_per_step": round(1e3 * coll_s / steps, 4) if steps else None,
            "collective_share": round(coll_s / step_s, 4) if step_s > 0 else None,
            "ranks": [ranks[k] for k in sorted(ranks)],
        }


def serve_rank(runner, channel: RankBroadcaster, ctx, rank: int) -> int:
    """A worker's loop: mirror rank 0's calls until it says stop; returns the exit status (0).
    A call that raises is survived when rank 0's raised too, else the worker exits
    (trnrt.engine.core.tp_failure); a broken channel raises (the worker exits non-zero)."""
    digest = TokenDigest()
    memory = RankMemory(runner)
    while True:
        op, args = channel.recv()
        if op == "stop":
            log.info("rank %d: stopped by rank 0 after %d steps", rank, digest.steps)
            return 0
        if op == "check":
            channel.gather(rank_report(rank, digest, ctx, channel, runner, memory))
            continue
        if op == "ping":
            continue
        if op == FAILED_OP:  # rank 0's call raised where ours did not: rank 0 stops the server
            answer_rank_zero_failure(channel, rank, args)
            continue
        if op not in MIRRORED_CALLS:
            raise RuntimeError(f"rank {rank}: unknown op {op!r} from rank 0")
        try:
            out = getattr(runner, op)(*args)
        except Exception as e:
            confirm_on_worker(channel, rank, op, e)  # returns only when rank 0 failed too
            continue
        if op == "execute":
            digest.add(out)
