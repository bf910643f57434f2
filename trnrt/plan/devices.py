"""Devices a plan is sized for: memory per rank and ranks per instance (assumptions stated here
and in docs/DEPLOY.md).

h200 / h100: one GPU per rank, 8 per node, the marketed HBM in decimal GB (141 GB, 80 GB).
trn2: a trn2.48xlarge, 16 Trainium2 chips x 96 GiB HBM; with LNC=2 (two physical NeuronCores per
logical core, 4 logical cores a chip) an instance runs 64 ranks of 96 / 4 = 24 GiB each.
cpu: this machine's MemAvailable (/proc/meminfo; 8 GiB where it cannot be read), shared by all
ranks (gloo processes on one host): a rank gets MemAvailable / tp.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One kind of rank: its memory and how many ranks one instance (node) has."""

    name: str
    bytes_per_rank: int
    ranks_per_instance: int
    note: str
    shared: bool = False  # one memory for all ranks (the CPU host): a rank gets bytes_per_rank / tp

    def rank_bytes(self, tp: int) -> int:
        """Memory of one rank at tp ranks."""
        return self.bytes_per_rank // tp if self.shared else self.bytes_per_rank


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def device(name: str) -> Device:
    """The Device of a name (h200 | h100 | trn2 | cpu); ValueError for any other."""
    if name == "h200":
        return Device("h200", 141 * GB, 8, "NVIDIA H200, 141 GB HBM3e")
    if name == "h100":
        return Device("h100", 80 * GB, 8, "NVIDIA H100 SXM, 80 GB HBM3")
    if name == "trn2":
        return Device("trn2", 24 * GiB, 64, "trn2.48xlarge, LNC=2: 16 chips x 96 GiB / 4 logical cores")
    if name == "cpu":
        return Device("cpu", _mem_available(), 1, "this host's MemAvailable, shared by the ranks", shared=True)
    raise ValueError(f"unknown device {name!r} (one of {', '.join(DEVICES)})")


DEVICES = ("h200", "h100", "trn2", "cpu")


def sglang_mem_fraction_static(tp: int) -> float:
    """SGLang's default --mem-fraction-static by TP size (its server-args heuristic before it sized
    the reserve from the chunked-prefill size: 0.88 at TP 1 down to 0.79 at TP >= 16)."""
    if tp >= 16:
        return 0.79
    if tp >= 8:
        return 0.81
    if tp >= 4:
        return 0.85
    if tp >= 2:
        return 0.87
    return 0.88
