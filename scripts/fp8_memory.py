"""Resident weight bytes of an FP8 glm5_next checkpoint against its bf16 original (docs/PERFORMANCE.md).

Builds a randomised glm5_next checkpoint of the tiny model's structure at larger dims (>= 200 MB
in bf16; the default below is ~430 MB), writes it in bf16 and in the FP8 release layout
(fp8/checkpoint.convert_dir), loads each with trnrt in bfloat16 and reports the bytes its
parameters and buffers hold, by dtype (fp8/load.weight_bytes), and the loading process's RSS growth
(resident set after the load minus before it, Linux). Not a test: about a minute and ~3 GB of RAM on a laptop.

    PYTHONPATH=. python scripts/fp8_memory.py [--out DIR] [--hidden 1024] [--experts 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import gc, json, sys, torch
from trnrt.models.glm5_next.loading import load_model
from trnrt.models.glm5_next.fp8.load import weight_bytes
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
m = load_model(sys.argv[1], dtype=torch.bfloat16)
gc.collect()
print(json.dumps({"bytes": weight_bytes(m), "rss_growth": rss() - before}))
"""


def build(out: Path, hidden: int, experts: int) -> tuple[Path, Path]:
    import shutil

    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.tiny.build import build_hf_model

    bf16, fp8 = out / "bf16", out / "fp8"
    over = dict(hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                n_routed_experts=experts, q_lora_rank=hidden // 4, kv_lora_rank=hidden // 2 + 64)
    model = build_hf_model(0, text_overrides=over, dtype="bfloat16")
    model.save_pretrained(bf16)
    del model
    shutil.rmtree(fp8, ignore_errors=True)
    shutil.copytree(bf16, fp8)
    convert_dir(fp8)
    return bf16, fp8


def measure(d: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="trnrt-fp8-mem-"))
    if (out / "fp8" / "config.json").exists():  # --out of an earlier run: measure again
        bf16, fp8 = out / "bf16", out / "fp8"
    else:
        bf16, fp8 = build(out, a.hidden, a.experts)
    rows = {}
    for name, d in (("bf16", bf16), ("fp8", fp8)):
        disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        m = measure(d)
        rows[name] = dict(disk=disk, resident=sum(m["bytes"].values()), by_dtype=m["bytes"],
                          rss_growth=m["rss_growth"])
    for name, r in rows.items():
        print(f"{name:5s} checkpoint {r['disk'] / 1e6:8.1f} MB  resident weights {r['resident'] / 1e6:8.1f} MB  "
              f"RSS growth after load {r['rss_growth'] / 1e6:8.1f} MB  by dtype "
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(r["by_dtype"].items())))
    print(f"fp8 / bf16 resident weight bytes: {rows['fp8']['resident'] / rows['bf16']['resident']:.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
