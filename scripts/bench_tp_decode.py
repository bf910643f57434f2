"""TP=2 decode step against TP=1 on the CPU (gloo), and the share of the step spent in collectives.

    PYTHONPATH=$PWD python scripts/bench_tp_decode.py [--model DIR] [--batches 1 8] [--steps 40]

Runs greedy decode steps through the eager ModelRunner (the real step path: pack, model forward,
greedy sampler) of:
  tp1 x1   load_model's model, one torch thread;
  tp1 x2   the same, two torch threads (TP=2 uses two cores: the fair comparison);
  tp2      the rank model (rank_model.load_rank_model, ep 1 and ep 2) on 2 gloo processes of
           one thread each; every rank runs the same rows.
Per batch size: the median step (ms) over `--steps` steps after warm-up and, for TP=2, the median
of the summed wall time of the step's collectives (all-reduce / all-gather, timed around
`trnrt.parallel.collectives._issue`, the one place they are issued) and their count per step.
Rows decode from a short prompt at positions < 64 (a 128-token table). Not a test: no assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

BS = 16


def _run(model, batch: int, steps: int, timed: list[float] | None = None) -> list[float]:
    """Step times (s) of `steps` greedy decode steps of `batch` rows after a prefill and warm-up."""
    import torch

    from trnrt.config.engine_config import EngineConfig
    from trnrt.engine.output.outputs import RowInput
    from trnrt.engine.runner.model_runner import ModelRunner

    cfg = EngineConfig(block_size=BS, max_model_len=128, decode_batch_buckets=(1, 2, 4, 8), prefill_token_buckets=(16,),
                       num_blocks=8 * batch + 2, num_slots=batch + 1, max_top_logprobs=1)
    state = model.allocate_state(cfg.num_blocks, BS, cfg.num_slots)
    runner = ModelRunner(model, state, cfg, model.config.vocab_size)
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(batch)]

    def row(ids, start, i):
        return RowInput(token_ids=list(ids), start_pos=start, block_ids=blocks[i], slot_id=i + 1, temperature=0.0,
                        top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None)

    last = [runner.execute([row([3 + i, 5, 7, 11], 0, i)])[0].token_id for i in range(batch)]
    pos, out = 4, []
    with torch.inference_mode():
        for s in range(steps + 5):
            if timed is not None:
                timed.clear()
            t0 = time.perf_counter()
            res = runner.execute([row([last[i]], pos, i) for i in range(batch)])
            dt = time.perf_counter() - t0
            last, pos = [r.token_id for r in res], pos + 1
            if s >= 5:  # warm-up steps left out
                out.append((dt, sum(timed) if timed is not None else 0.0, len(timed) if timed is not None else 0))
    return out


def _timed_collectives(timed: list[float]) -> None:
    """Time every collective (around collectives._issue, which all_reduce / all_gather call)."""
    from trnrt.parallel import collectives

    issue = collectives._issue

    def timed_issue(ctx, kind, x, op):
        t0 = time.perf_counter()
        y = issue(ctx, kind, x, op)
        timed.append(time.perf_counter() - t0)
        return y

    collectives._issue = timed_issue


def _rank(rank: int, world: int, port: int, model_dir: str, batches: list[int], steps: int, ep: int, out: str):
    import torch
    import torch.distributed as dist

    from trnrt.models.glm5_next.rank_model import load_rank_model
    from trnrt.parallel.context import ParallelContext

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = ParallelContext.initialise(rank, world, ep_size=ep, backend="gloo", timeout_s=120)
    try:
        model = load_rank_model(model_dir, torch.float32, ctx)
        timed: list[float] = []
        _timed_collectives(timed)
        res = {b: _run(model, b, steps, timed) for b in batches}
        from trnrt.parallel.collectives import all_reduce

        x = torch.zeros(8, model.config.hidden_size)  # a decode step's [B, D] at batch 8
        timed.clear()
        for _ in range(200):  # back-to-back, no compute between: the collective's own latency
            all_reduce(x, ctx)
        res["bare_all_reduce_us"] = statistics.median(timed) * 1e6
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
        dist.barrier()  # neither rank tears the group down under the other's last collective
    finally:
        dist.destroy_process_group()


def _tp2(model_dir: str, batches: list[int], steps: int, ep: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(2, port, model_dir, batches, steps, ep, d), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]
    # a step ends when its slower rank ends: the per-step max over the ranks
    print(f"tp2 ep{ep}: a bare all-reduce of [8, D] fp32 takes {ranks[0]['bare_all_reduce_us']:.0f} us "
          "(median of 200 back to back)")
    return {b: [max((r[str(b)][i] for r in ranks), key=lambda x: x[0]) for i in range(len(ranks[0][str(b)]))]
            for b in batches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    import torch

    from trnrt.models import kernels
    from trnrt.models.glm5_next.weights import load_model
    from trnrt.models.tiny import default_model_dir

    kernels.load()
    model_dir = str(a.model or default_model_dir())
    rows = {}
    model = load_model(model_dir, torch.float32)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rows[f"tp1 x{threads}"] = {b: _run(model, b, a.steps) for b in a.batches}
    torch.set_num_threads(1)
    for ep in (1, 2):
        rows[f"tp2 ep{ep}"] = _tp2(model_dir, a.batches, a.steps, ep)
    med = statistics.median
    print(f"{'layout':<10} {'batch':>5} {'step ms':>8} {'vs tp1 x1':>9} {'coll ms':>8} {'coll %':>7} {'coll/step':>9}")
    for name, by_b in rows.items():
        for b in a.batches:
            st = [x[0] for x in by_b[b]]
            base = med(x[0] for x in rows["tp1 x1"][b])
            coll = med(x[1] for x in by_b[b])
            n = by_b[b][0][2]
            print(f"{name:<10} {b:>5} {med(st) * 1e3:>8.2f} {base / med(st):>8.2f}x {coll * 1e3:>8.2f} "
                  f"{100 * coll / med(st):>6.1f}% {n:>9}")
    print(f"(medians of {a.steps} steps; torch {torch.__version__}; {os.cpu_count()} CPUs)", file=sys.stderr)


if __name__ == "__main__":
    main()
