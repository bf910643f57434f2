"""Run a compiled TP graph (`trnrt compile --tp-size N`) on N gloo ranks against the eager rank model.

    trnrt compile --preset default --tp-size 2 --only decode-b1-t1-base --out OUT
    python scripts/tp_compiled_check.py OUT/default/cpu/tp2ep1 decode-b1-t1-base

Every rank loads its own rank model of the embedded tiny checkpoint, the ONE package of the graph
(cpu backend: its own weights and vocab_start / expert_start bound at load), runs it on a real
decode row (one token, slot 1, block 1) and runs the same step eagerly on a fresh state; prints
per rank the sampled tokens, max |Δ logprob| compiled vs eager and the top ids. `trnrt serve --tp-size N --compiled
DIR` runs such graphs (trnrt/compile/tp_loader.py, tests/parallel/test_tp_serve_compiled.py).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, art: str, gid: str, ep: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trnrt.compile.backends import get_backend
    from trnrt.compile.catalogue import expand
    from trnrt.compile.export import eager_callable, spec_inputs
    from trnrt.compile.tp import rank_model_and_state
    from trnrt.config.presets import read_preset
    from trnrt.models import kernels
    from trnrt.parallel.context import ParallelContext

    kernels.load()
    ctx = ParallelContext.initialise(rank, world, ep_size=ep, timeout_s=120)
    try:
        man = json.loads((Path(art) / "manifest.json").read_text())
        entry = next(g for g in man["graphs"] if g["id"] == gid)
        ec = read_preset(man["preset"]).engine_config
        spec = next(s for s in expand(ec, man["flags"]) if s.graph_id == gid)
        outs = []
        for compiled in (True, False):
            model, state = rank_model_and_state(None, ec, ctx)
            ins = list(spec_inputs(spec, ec, model.config.vocab_size))
            g = torch.Generator().manual_seed(0)
            ins[0][:, 0] = torch.randint(1, model.config.vocab_size, (spec.batch,), generator=g)  # token ids
            ins[2][:] = 1  # num_new: one real token a row
            ins[3][:, 0] = torch.arange(1, spec.batch + 1)  # block tables
            ins[4][:] = torch.arange(1, spec.batch + 1)  # slots
            fn = (get_backend("cpu").load(entry, Path(art), model, state, ec, spec) if compiled
                  else eager_callable(model, state, ec, spec))
            with torch.no_grad():
                outs.append([o.clone() for o in fn(*ins)])
        (c, e) = outs
        print(f"rank {rank}: tokens compiled {c[0].tolist()} eager {e[0].tolist()}; "
              f"logprob {c[1].tolist()} (max |d| {(c[1] - e[1]).abs().max().item():.2e}); top ids equal "
              f"{torch.equal(c[2], e[2])}, top logprobs max |d| {(c[3] - e[3]).abs().max().item():.2e}",
              flush=True)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def main() -> None:
    art, gid = sys.argv[1], sys.argv[2]
    par = json.loads((Path(art) / "manifest.json").read_text())["engine_config"]["parallel"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(par["tp_size"], port, art, gid, par["ep_size"]), nprocs=par["tp_size"])


if __name__ == "__main__":
    main()
