"""Peak RSS of each rank while it reads its shard of a multi-shard checkpoint (docs/PERFORMANCE.md).

Builds a randomised glm5_next checkpoint of the tiny model's structure at larger dims, in bf16
(the default is ~470 MB), written as 8 safetensors shards with `model.safetensors.index.json`;
then, in a fresh process per rank and layout, reads the rank's shard with
`sharded_load.read_rank_state_dict` (slices only) and, for comparison, with the full read cut
afterwards (`rank_model.read_full_then_shard`). Reported per rank: the shard's bytes (its
"share"), the peak RSS growth over the process's RSS after imports (VmHWM, reset
through /proc/self/clear_refs; Linux), and their
ratio; the acceptance of issue #31 is peak <= 1.3 x share. Not a test: a minute or two.

With --fp8 the checkpoint is first converted to the FP8 release layout (fp8/checkpoint.convert_dir,
float8_e4m3fn weights + fp32 weight_scale_inv per --block block; 16 x 16 by default, since the
tiny structure's 16-wide heads would put part of a 128-block on each TP rank) and the readers are
the FP8 rank's: `fp8.rank_read.read_fp8_rank_state_dict` (slices) against the whole read split
and cut (`fp8.rank_load.read_fp8_parts` + `fp8.shard.shard_fp8_tensors`).

    PYTHONPATH=. python scripts/bench_loader_rss.py [--out DIR] [--hidden 1024] [--experts 32] [--fp8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, torch
def status(field):  # bytes, from /proc/self/status (ru_maxrss survives exec: the parent's peak)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
from trnrt.models.glm5_next.config import Glm5NextConfig
from trnrt.models.glm5_next.rank_model import read_full_then_shard
from trnrt.models.glm5_next.sharded_load import read_rank_state_dict
from trnrt.parallel.context import ParallelContext
import safetensors.torch  # imported before the baseline: both readers need it
d, tp, rank, ep, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ctx = ParallelContext.for_rank(tp, rank, ep)
if how.startswith("fp8"):
    from trnrt.models.glm5_next.fp8 import qconfig
    from trnrt.models.glm5_next.fp8.load import _configs
    from trnrt.models.glm5_next.fp8.rank_load import read_fp8_parts
    from trnrt.models.glm5_next.fp8.rank_read import read_fp8_rank_state_dict
    from trnrt.models.glm5_next.fp8.shard import shard_fp8_tensors
    cfg, qc = _configs(d)[0], qconfig.read(d)
    def read(d, cfg, ctx, mtp):
        if how == "fp8-sliced":
            return read_fp8_rank_state_dict(d, cfg, qc, ctx, mtp)
        return shard_fp8_tensors(read_fp8_parts(d, cfg, mtp, None)[0], cfg, ctx, qc.block)
else:
    cfg = Glm5NextConfig.from_pretrained(d)
    read = read_rank_state_dict if how == "sliced" else read_full_then_shard
# torch's meta-tensor ops load their registrations (~150 MB of RSS, once per process) on first
# use: the FP8 plan runs on meta tensors, and so does every rank model's skeleton, so a rank
# pays it anyway. Warmed before the baseline: what is left is what the reads cost.
torch.cat([torch.empty(2, 2, device="meta")[:, :1]] * 2, 1).contiguous()
torch.stack([torch.empty(2, device="meta")] * 2)
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
sd = read(d, cfg, ctx, False)
peak = status("VmHWM")
share = sum(t.numel() * t.element_size() for t in sd.values())
dtypes = sorted({str(t.dtype) for t in sd.values()})
print(json.dumps({"share": share, "peak_growth": peak - base, "baseline": base, "dtypes": dtypes}))
"""


def build(out: Path, hidden: int, experts: int, shards: int, fp8_block: tuple[int, int] | None = None) -> Path:
    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.glm5_next.fp8.qconfig import QuantConfig
    from trnrt.models.glm5_next.reshard import write_shards
    from trnrt.models.tiny.build import build_hf_model

    over = dict(hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                n_routed_experts=experts, q_lora_rank=hidden // 4, kv_lora_rank=hidden // 2 + 64)
    model = build_hf_model(0, text_overrides=over, dtype="bfloat16")
    model.save_pretrained(out)
    del model
    if fp8_block is not None:
        write_shards(out, 1)  # convert_dir takes one model.safetensors
        (out / "model.safetensors.index.json").unlink()
        (out / "model-00001-of-00001.safetensors").rename(out / "model.safetensors")
        convert_dir(out, QuantConfig(block=fp8_block))
    write_shards(out, shards)
    return out


def measure(d: Path, tp: int, rank: int, ep: int, how: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(d), str(tp), str(rank), str(ep), how],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--fp8", action="store_true", help="measure the FP8 rank readers on an FP8 checkpoint")
    ap.add_argument("--block", type=int, default=16, help="--fp8: the scale block (square)")
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="trnrt-loader-rss-"))
    if not (out / "model.safetensors.index.json").exists():
        build(out, a.hidden, a.experts, a.shards, (a.block, a.block) if a.fp8 else None)
    disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    kind = f"FP8, {a.block}x{a.block} blocks" if a.fp8 else "bf16"
    print(f"checkpoint {disk / 1e6:.1f} MB in {len(list(out.glob('*.safetensors')))} shards ({kind}, with its vision tower)")
    print(f"{'layout':>10} {'rank':>4} {'reader':>7} {'share MB':>9} {'peak MB':>8} {'peak/share':>10}  dtypes")
    rows = []
    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 4)):
        for rank in sorted({0, tp - 1}):
            for how in ("sliced", "full") if rank == 0 else ("sliced",):
                m = measure(out, tp, rank, ep, "fp8-" + how if a.fp8 else how)
                ratio = m["peak_growth"] / m["share"]
                rows.append(dict(tp=tp, ep=ep, rank=rank, reader=how, **m, ratio=ratio))
                print(f"{f'tp{tp} ep{ep}':>10} {rank:>4} {how:>7} {m['share'] / 1e6:9.1f} "
                      f"{m['peak_growth'] / 1e6:8.1f} {ratio:10.2f}  {','.join(m['dtypes'])}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
