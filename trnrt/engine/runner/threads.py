"""torch threading for the engine thread: a sane default per backend, device and model size.

Why this exists: torch's default is one intra-op thread per core, and on the tiny model on a
2-core box that default made a batch-8 eager decode step ~3x slower and a compiled one ~10x (two
OpenMP threads spin against each other and against the rest of the process for ops far too small
to split). See docs/PERFORMANCE.md, "Engine threads".

What torch's settings mean across Python threads (measured on torch 2.13, OpenMP backend; the
tests pin it):

- `torch.set_num_threads(n)` sets the *calling* thread's OpenMP / MKL thread count, and a global
  value that a thread adopts the first time it runs torch work. So a call on the main thread
  before the engine thread starts reaches the engine thread; a call on the main thread after the
  engine thread has run a step does not, and a call on the engine thread does not change the main
  thread (but does change what threads started later adopt). Hence the engine sets its own count,
  at the top of its thread: `apply_torch_threads` / `configure_engine_threads`.
- Inter-op threads (`torch.set_num_interop_threads`) serve `torch.jit.fork` / `at::launch` only;
  no step uses them (the pool is never started), the setting is process-wide and may be made only
  once, before any inter-op work. This module leaves it alone and reports it.

The rule (`default_torch_threads`):

- device other than "cpu" (cuda, neuron): 1. The host side of a step is input packing and
  bookkeeping on small tensors; more OpenMP threads there only spin against the server's other
  threads. (Not measured on a GPU host.)
- cpu, model below LARGE_MODEL_PARAMS parameters: 1. On the tiny model (1.0M parameters) every
  op is far below what pays for a fork/join.
- cpu, larger model: the physical cores available to the process (affinity mask, SMT siblings
  counted once, capped by a cgroup CPU quota). A real-size model's decode GEMMs are large enough
  to split (not measured here: no idle core on the 2-core box); hyper-threads share the FPUs
  that those GEMMs saturate.

Precedence: an explicit request (a `--threads` option) > $TRNRT_TORCH_THREADS > the default.
torch is imported inside functions only.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "TRNRT_TORCH_THREADS"

# Below this many parameters the engine uses one intra-op thread on the CPU. Measured on the
# shared 2-core box (docs/PERFORMANCE.md, "Engine threads"): the tiny model (1.0M parameters)
# loses 1.2-2.5x at two threads, and a lone batch-8 fp32 matmul [8, h] x [h, 4h] did not gain
# from a second thread at any h up to 4096 (67M parameters in that one matrix) while other jobs
# held the cores. The gain on a many-core host with a real-size model could not be measured here;
# 1e8 keeps every small and test model at 1 and puts every real-size one (GLM-5.3-Flash: ~313B)
# on all physical cores, torch's own default for a process that owns the machine.
LARGE_MODEL_PARAMS = 100_000_000


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs allowed by a cgroup CPU quota (v2 cpu.max or v1 cfs quota), rounded up; None: no quota."""
    v2 = _read(root / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    q, p = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if q and p and q.lstrip("-").isdigit() and p.isdigit() and int(q) > 0 and int(p) > 0:
        return max(1, math.ceil(int(q) / int(p)))
    return None


def physical_cores(cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu"),
                   cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Physical cores the process may run on: the CPUs of its affinity mask with SMT siblings
    counted once (by package and core id), capped by a cgroup CPU quota; at least 1."""
    if cpus is None:
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        pkg, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        cores.add((pkg, core) if pkg is not None and core is not None else ("cpu", str(c)))
    n = max(1, len(cores))
    limit = _cgroup_cpu_limit(cgroup_root)
    return min(n, limit) if limit is not None else n


def count_params(model) -> int | None:
    """Parameters of an nn.Module (None for anything else, e.g. no model)."""
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    try:
        return sum(p.numel() for p in params())
    except Exception:
        return None


def default_torch_threads(backend: str, device: str, model_params: int | None = None) -> int:
    """The engine's intra-op thread count when nothing is requested (see the module doc).

    backend ("eager", "cpu", "cuda", "compiled", ...) does not change the rule today: compiled CPU
    graphs pin Inductor's own kernels to the preset's `cpp.threads`, and their extern calls (MKL
    GEMMs, topk) run at the calling thread's count, like the eager path's ops. It is a parameter so
    that a backend with other needs can get its own rule without changing callers.
    """
    del backend
    if str(device).split(":")[0] != "cpu":
        return 1
    if model_params is None or model_params < LARGE_MODEL_PARAMS:
        return 1
    return physical_cores()


def _check(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def resolve_torch_threads(backend: str, device: str, requested: int | None = None,
                          model_params: int | None = None) -> tuple[int, str]:
    """(thread count, where it came from: "requested", ENV_VAR or "default").

    Raises ValueError for a bad request or a bad $TRNRT_TORCH_THREADS (call it on the main thread
    to fail before the engine thread starts). An empty or "auto" variable means the default.
    """
    if requested is not None:
        return _check(requested, "threads"), "requested"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env.lower() != "auto":
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"${ENV_VAR} must be an integer >= 1 or 'auto', got {env!r}") from None
        return _check(n, f"${ENV_VAR}"), ENV_VAR
    return default_torch_threads(backend, device, model_params), "default"


def apply_torch_threads(n: int | None, why: str = "") -> int | None:
    """torch.set_num_threads(n) for the calling thread (None: nothing, and torch is not imported,
    e.g. the scripted runner); logs one info line; returns n."""
    if n is None:
        return None
    import torch

    torch.set_num_threads(_check(n, "threads"))
    log.info("torch threads on %s: %d intra-op%s (%d inter-op, unchanged)", _thread_name(), torch.get_num_threads(),
             f" ({why})" if why else "", torch.get_num_interop_threads())
    return n


def configure_engine_threads(backend: str, device: str, requested: int | None = None, *,
                             model_params: int | None = None) -> int:
    """Resolve the count (requested > $TRNRT_TORCH_THREADS > default) and set it for the calling
    thread, the engine thread; logs one info line; returns the count set."""
    n, source = resolve_torch_threads(backend, device, requested, model_params)
    size = f", {model_params / 1e6:.1f}M parameters" if model_params is not None else ""
    apply_torch_threads(n, f"{source}: {backend} on {device}{size}")
    return n


def _thread_name() -> str:
    import threading

    return threading.current_thread().name
