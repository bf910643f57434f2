"""Run a function on N local gloo ranks once and collect what each returns (a JSON-able dict).

Each rank: one torch thread, MASTER_ADDR=127.0.0.1 on a free port, the process group made by
`ParallelContext.initialise` with a timeout (a dead rank fails the others instead of hanging
them), its result written to `out_dir/rank{r}.json`. The parent waits at most `timeout_s` for
all of them, kills what is left after that, and re-raises a rank's exception with its traceback.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

PG_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable, world_size: int, out_dir: Path, timeout_s: float = 180.0, **kwargs) -> list[dict]:
    """fn(ctx, **kwargs) -> dict on every rank (ctx: that rank's ParallelContext); the dicts by rank."""
    import torch.multiprocessing as mp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pc = mp.start_processes(_rank_main, args=(fn, world_size, port, str(out_dir), kwargs), nprocs=world_size,
                            join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not pc.join(timeout=0.5):  # raises ProcessRaisedException / ProcessExitedException
        if time.monotonic() > deadline:
            for p in pc.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, kwargs: dict) -> None:
    import torch
    import torch.distributed as dist

    from trnrt.parallel.context import ParallelContext

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = ParallelContext.initialise(rank, world_size, backend="gloo", timeout_s=PG_TIMEOUT_S)
    try:
        result = fn(ctx, **kwargs)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
