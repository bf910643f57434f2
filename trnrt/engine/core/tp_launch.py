"""Starting the rank processes, the rendezvous, and taking everything down when a rank dies.

* `start_rank_zero(parallel, setup)` (rank 0, in the engine's process): start this node's worker
  ranks (`python -m trnrt.engine.core.tp_worker`), join the process group (torch.distributed's TCP
  rendezvous at --dist-init-addr, or 127.0.0.1 on a free port), broadcast the RankSetup, build the
  rank-0 runner, wait until every rank has loaded, and return the MirroredRunner.
* `run_node(parallel)` (`trnrt serve --node-rank R`, R > 0): start node R's ranks and wait; no HTTP.
* `RankWatchdog`: polls this node's rank processes; one that exits while the engine runs is
  fatal: one error line naming the rank, the others killed, and this process exits with
  RANK_DIED_EXIT_CODE at once (the server then answers 503 and exits non-zero: trnrt.serve.engine_watch),
  so that a supervisor (sglang-router, Kubernetes) restarts the whole group.

Two groups: the world group (the model's collectives, timeout $TRNRT_TP_TIMEOUT_S) and the op
channel (trnrt.engine.core.tp_runner.RankBroadcaster; the workers wait on it while the engine is
idle, so its timeout is long).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from trnrt.engine.core.tp_config import RANK_DIED_EXIT_CODE, ParallelConfig, split_addr

log = logging.getLogger("trnrt.engine.core.tp")

CHANNEL_TIMEOUT = datetime.timedelta(days=30)  # idle engines: the workers wait on the channel
STOP_WAIT_S = 5.0


def free_addr(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join_group(rank: int, parallel: ParallelConfig, addr: str):
    """init_process_group (gloo, TCP rendezvous at `addr`) -> (ParallelContext, RankBroadcaster)."""
    import torch.distributed as dist

    from trnrt.engine.core.tp_runner import RankBroadcaster
    from trnrt.parallel.context import ParallelContext

    host, port = split_addr(addr)
    ctx = ParallelContext.initialise(rank, parallel.tp_size, ep_size=parallel.ep_size, backend="gloo",
                                     timeout_s=parallel.pg_timeout_s(), init_method=f"tcp://{host}:{port}")
    group = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
    return ctx, RankBroadcaster(group, rank, parallel.tp_size)


def worker_command(rank: int, parallel: ParallelConfig, addr: str) -> list[str]:
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return [sys.executable, "-m", "trnrt.engine.core.tp_worker", "--rank", str(rank), "--world-size",
            str(parallel.tp_size), "--ep-size", str(parallel.ep_size), "--nnodes", str(parallel.nnodes),
            "--init-addr", addr, "--parent-pid", str(os.getpid()), "--log-level", str(level)]


def start_workers(ranks, parallel: ParallelConfig, addr: str) -> dict[int, subprocess.Popen]:
    """Start the worker ranks `ranks` on this host (their logs go to this process's stderr)."""
    procs = {}
    for r in ranks:
        procs[r] = subprocess.Popen(worker_command(r, parallel, addr), stdin=subprocess.DEVNULL)
        log.info("tensor-parallel rank %d started (pid %d)", r, procs[r].pid)
    return procs


def exit_reason(code: int) -> str:
    """What a worker's exit status says, for the watchdog's line ('' when it says nothing more)."""
    from trnrt.engine.core.tp_failure import LONE_FAILURE_EXIT_CODE

    return " (a call failed on that rank alone: its error is logged above)" if code == LONE_FAILURE_EXIT_CODE else ""


def remote_ranks(parallel: ParallelConfig) -> str:
    """'node 1: rank 1' / 'node 1: ranks 8-15, node 2: ...': the ranks this node does not run."""
    parts = []
    for n in range(parallel.nnodes):
        if n == parallel.node_rank:
            continue
        r = parallel.node_ranks(n)
        parts.append(f"node {n}: rank {r[0]}" if len(r) == 1 else f"node {n}: ranks {r[0]}-{r[-1]}")
    return ", ".join(parts)


class RankWatchdog:
    """Watches this node's rank processes; `closing` set, their exits are expected."""

    def __init__(self, procs: dict[int, subprocess.Popen], poll_s: float = 0.1, parallel: ParallelConfig | None = None):
        self.procs = procs
        self.parallel = parallel  # names the other nodes' ranks when the channel breaks
        self.poll_s = poll_s
        self.closing = False
        self._thread = threading.Thread(target=self._watch, name="trnrt-tp-watchdog", daemon=True)

    def start(self) -> "RankWatchdog":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self.closing and self.procs:
            for rank, p in self.procs.items():
                code = p.poll()
                if code is not None and not self.closing:
                    self.fatal(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}{exit_reason(code)}")
            time.sleep(self.poll_s)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def fatal(self, message: str) -> None:
        """Log, kill the other ranks and end this process with RANK_DIED_EXIT_CODE (no return).
        A broken channel usually means a rank died: the line names it when it was one of ours, else
        (several nodes) the ranks of the other nodes, one of which is gone."""
        if not message.startswith("tensor-parallel rank "):
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                dead = [(r, p) for r, p in self.procs.items() if p.poll() is not None]
                if dead:
                    r, p = dead[0]
                    message = f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode} ({message})"
                    break
                time.sleep(0.02)
            else:
                if self.parallel is not None and self.parallel.nnodes > 1:
                    message = f"a tensor-parallel rank on another node is gone ({remote_ranks(self.parallel)}) ({message})"
        log.critical("%s; the engine stops and the server exits (code %d): restart it", message, RANK_DIED_EXIT_CODE)
        self.kill_all()
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(RANK_DIED_EXIT_CODE)

    def stop(self) -> None:
        """The engine is shutting down: wait for the ranks (they were told to stop), kill what is left."""
        self.closing = True
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank pid %d did not stop; killing it", p.pid)
                p.kill()


def start_rank_zero(parallel: ParallelConfig, setup):
    """Rank 0's side of the start (see the module doc). Returns the MirroredRunner."""
    from trnrt.engine.core.tp_build import build_runner, model_kind
    from trnrt.engine.core.tp_runner import MirroredRunner, RankMemory, TokenDigest, rank_report

    addr = parallel.dist_init_addr or free_addr()
    t0 = time.monotonic()
    watchdog = RankWatchdog(start_workers([r for r in parallel.node_ranks(0) if r != 0], parallel, addr),
                            parallel=parallel).start()
    try:
        ctx, channel = join_group(0, parallel, addr)
        channel.send("setup", setup)
        runner = build_runner(setup, ctx, ranks_per_node=parallel.ranks_per_node)
        reports = channel.gather(rank_report(0, TokenDigest(), ctx, channel, runner, RankMemory(runner)))  # all loaded
    except BaseException:
        watchdog.closing = True
        watchdog.kill_all()
        raise
    log.info("tensor parallelism: %d ranks (ep %d, %d nodes, %s model) ready in %.1f s; rank memory %s",
             parallel.tp_size, parallel.ep_size, parallel.nnodes, model_kind(), time.monotonic() - t0,
             ", ".join(f"{r['rank']}: {(r['rss_bytes'] or 0) / 2**20:.0f} MiB RSS, "
                       f"{(r.get('weight_bytes') or 0) / 2**20:.0f} MiB weights" for r in reports))

    def on_close():
        watchdog.stop()
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:
            log.debug("destroy_process_group", exc_info=True)

    return MirroredRunner(runner, channel, ctx, parallel=parallel, check_every=parallel.resolved_check_every(),
                          on_fatal=watchdog.fatal, on_close=on_close, model_kind=model_kind(), reports=reports)


def run_node(parallel: ParallelConfig) -> int:
    """`trnrt serve --node-rank R` (R > 0): run node R's ranks until they stop. Returns 0 when all
    stopped cleanly, RANK_DIED_EXIT_CODE when one failed (the others are then killed)."""
    import signal

    procs = start_workers(parallel.node_ranks(), parallel, parallel.dist_init_addr)
    watchdog = RankWatchdog(procs)

    def on_signal(signum, frame):
        watchdog.closing = True
        for p in procs.values():
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed and not watchdog.closing:
            r, c = next(iter(failed.items()))
            log.critical("tensor-parallel rank %d (pid %d) exited with code %s%s; stopping node %d (code %d)", r,
                         procs[r].pid, c, exit_reason(c), parallel.node_rank, RANK_DIED_EXIT_CODE)
            watchdog.kill_all()
            return RANK_DIED_EXIT_CODE
        if all(c is not None for c in codes.values()):
            return 0 if not failed else RANK_DIED_EXIT_CODE
        time.sleep(0.2)
