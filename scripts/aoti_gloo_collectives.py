"""AOTInductor + gloo functional collectives: does a torch.export-ed graph with an all_reduce compile
and run on 2 gloo ranks? (issue #31; the finding behind `trnrt compile --tp-size`, docs/COMPILE.md)

Run: python scripts/aoti_gloo_collectives.py   (2 CPU processes, ~2-4 minutes: one AOTInductor
compile per rank). Each rank prints its eager value, rank 0 the exported graph code, then each
rank the value of its AOTInductor-compiled package. On torch 2.13 CPU the export records
`_c10d_functional.all_reduce(x, 'sum', '0')` + `wait_tensor` (the group NAME is baked in, not
the rank), and both ranks print the all-reduced value (3 * 4 = 12.0 for the ones weight).
"""
import os, sys, tempfile, traceback
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))
    def forward(self, x):
        y = x @ self.w
        return funcol.all_reduce(y, "sum", dist.group.WORLD)

def main(rank, world, port, d):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.full((2, 4), float(rank + 1))
    m = M()
    stage = "eager"
    try:
        print(rank, "eager", m(x)[0, 0].item(), flush=True)
        stage = "export"
        ep = torch.export.export(m, (x,))
        if rank == 0: print(ep.graph_module.code, flush=True)
        stage = "compile"
        pkg = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(d, f"r{rank}.pt2"))
        stage = "load"
        fn = torch._inductor.aoti_load_package(pkg)
        stage = "run"
        print(rank, "aoti", fn(x)[0, 0].item(), flush=True)
    except Exception as e:
        print(rank, "FAILED at", stage, type(e).__name__, str(e)[:1500], flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    d = tempfile.mkdtemp()
    mp.spawn(main, args=(2, 29581, d), nprocs=2)
