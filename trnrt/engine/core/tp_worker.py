"""A worker rank's process: `python -m trnrt.engine.core.tp_worker --rank R ...`.

Started by rank 0 (trnrt.engine.core.tp_launch.start_rank_zero) or by a node launcher
(`trnrt serve --node-rank R`). It joins the process group, receives the RankSetup, builds its
runner (trnrt.engine.core.tp_build), reports that it has loaded, then mirrors rank 0's runner calls
(trnrt.engine.core.tp_runner.serve_rank) until rank 0 says stop (exit 0). It exits non-zero when
the channel breaks (rank 0 died), at once when the process that started it is gone, and with
LONE_FAILURE_EXIT_CODE (4) when one of its calls raised where rank 0's did not
(trnrt.engine.core.tp_failure).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from trnrt.engine.core.tp_config import ParallelConfig

log = logging.getLogger("trnrt.engine.core.tp")

PARENT_GONE_EXIT_CODE = 1


def _watch_parent(parent_pid: int, rank: int) -> None:
    """Exit when our parent (rank 0's engine process, or the node launcher) is gone: a SIGKILLed
    parent cannot tell us, and waiting on a collective for its timeout is too long."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                log.error("rank %d: the process that started it (pid %d) is gone; exiting", rank, parent_pid)
                os._exit(PARENT_GONE_EXIT_CODE)
            time.sleep(0.25)

    threading.Thread(target=watch, name="trnrt-tp-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trnrt.engine.core.tp_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--init-addr", required=True)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(a.log_level).upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s rank{a.rank} %(name)s: %(message)s")
    if a.parent_pid:
        _watch_parent(a.parent_pid, a.rank)
    import torch
    import torch.distributed as dist

    from trnrt.engine.core.tp_build import build_runner
    from trnrt.engine.core.tp_launch import join_group
    from trnrt.engine.core.tp_runner import RankMemory, TokenDigest, rank_report, serve_rank
    from trnrt.engine.runner.threads import apply_torch_threads

    torch.set_num_threads(1)  # loading; the runner's own count is set below
    node_rank = a.rank * a.nnodes // a.world_size
    parallel = ParallelConfig(tp_size=a.world_size, ep_size=a.ep_size, nnodes=a.nnodes, node_rank=node_rank,
                              dist_init_addr=a.init_addr if a.nnodes > 1 else None)
    try:
        ctx, channel = join_group(a.rank, parallel, a.init_addr)
        op, (setup,) = channel.recv()
        if op != "setup":
            raise RuntimeError(f"rank {a.rank}: expected the setup from rank 0, got {op!r}")
        runner = build_runner(setup, ctx, ranks_per_node=parallel.ranks_per_node)
        apply_torch_threads(runner.torch_threads, f"tensor-parallel rank {a.rank}")
        channel.gather(rank_report(a.rank, TokenDigest(), ctx, channel, runner, RankMemory(runner)))
        with runner.thread_context():
            code = serve_rank(runner, channel, ctx, a.rank)
    except Exception as e:
        log.error("rank %d: %s: %s; exiting", a.rank, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
