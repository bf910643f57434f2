"""Fused CPU kernels for the eager step (C++ `torch.library` ops in the `trnrt` namespace).

The eager decode step of a small batch is dispatch-bound: every aten call costs a few
microseconds whatever its size, and the mHC coefficients (a truncated Sinkhorn of 39
normalisations per sub-layer) were more than half of the ~2,500 calls of a tiny-model step.
`cpu_ops.cpp` does `HyperConnection.collapse` and `hc_expand` in one call each, with the same
arithmetic in the same order (only reduction order may differ: a few ulp).

Built on first use with `torch.utils.cpp_extension` (g++ and ninja, the same tools AOTInductor
needs) into `<cache>/kernels/<source hash>/`, then reused by every later process; `TRNRT_KERNELS=0`
turns them off. When they are off or cannot be built, the model runs its plain PyTorch path,
which is also what torch.export traces: compiled graphs never contain these ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str


def enabled_by_env() -> bool:
    return os.environ.get("TRNRT_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _build_dir(digest: str) -> Path:
    from trnrt.models.cache_dir import cache_dir

    return cache_dir() / "kernels" / digest


def load() -> bool:
    """Build (once per machine) and load the kernels; False, with `error()` saying why, if not."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if not enabled_by_env():
            _state.update(ok=False, error="disabled by TRNRT_KERNELS=0")
            return False
        try:
            from torch.utils import cpp_extension

            src = SOURCE.read_bytes()
            key = hashlib.sha256(src + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
            bdir = _build_dir(key)
            bdir.mkdir(parents=True, exist_ok=True)
            # ninja may come from the venv's ninja wheel: make sure this interpreter's bin is on PATH.
            bindir = str(Path(sys.executable).parent)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            name = f"trnrt_cpu_ops_{key}"
            # The first start on a machine compiles for ~15 s with nothing else to show: say so, once.
            # Later starts find the library and load it in milliseconds, silently.
            building = not (bdir / f"{name}.so").exists()
            if building:
                log.info("building trnrt's CPU kernels (once, ~15 s) in %s ...", bdir)
            t0 = time.monotonic()
            cpp_extension.load(
                name=name, sources=[str(SOURCE)], build_directory=str(bdir),
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp-simd"], is_python_module=False, verbose=False,
            )
            if building:
                log.info("built trnrt's CPU kernels in %.1f s", time.monotonic() - t0)
            _state.update(ok=True, error="")
        except Exception as e:  # no compiler, no ninja, build error: the PyTorch path still works
            msg = f"{type(e).__name__}: {e}".strip()
            _state.update(ok=False, error=msg if len(msg) <= 1500 else msg[:300] + " ... " + msg[-1200:])
            log.warning("trnrt fused CPU kernels unavailable, eager steps use plain PyTorch: %s", _state["error"])
        return bool(_state["ok"])


def error() -> str:
    return str(_state.get("error", ""))


def available() -> bool:
    """Whether the kernels are loaded (does not build them)."""
    return bool(_state.get("ok"))
