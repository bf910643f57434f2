"""Shared fixtures of the compile tests: one tiny checkpoint and AOTInductor compiles shared per session.

Which graphs are compiled is set by TRNRT_TEST_COMPILE (compile_groups.py): by default (CI)
`buckets` = every bucket of `default` and `batch8`; `every` = all 16 graphs, `subset` = three of
batch8's. The compiles run as two `trnrt compile` processes in parallel
(one session fixture, `compiled`), once per test session: the first pytest-xdist worker to need
them compiles under a file lock, the other waits and reuses the artifacts. Tests must not change
the shared artifacts (copy them first).

The compiles run with the fingerprint cache on (trnrt.compile.fingerprint_cache), so a later
`trnrt verify graph-equiv` in the same environment (CI) reads their graph hashes instead of
exporting every graph again; tests/conftest.py keeps it off for every other test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # scenario helper

from compile_groups import BATCH8, DEFAULT_A, DEFAULT_B, SUBSET  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from trnrt.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("compile_tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import torch

    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir, torch.float32)


def _job(tiny_dir: Path, out: Path, steps: list[tuple[str, list[str]]]) -> subprocess.Popen:
    """One process running `trnrt compile` for each (preset, graph ids) in turn, into `out`."""
    cmds = []
    for preset, only in steps:
        args = [sys.executable, "-m", "trnrt", "compile", "--preset", preset, "--model", str(tiny_dir),
                "--out", str(out), "--backend", "cpu"]
        for gid in only:
            args += ["--only", gid]
        cmds.append(args)
    script = "import subprocess, sys\nfor c in %r:\n    subprocess.run(c, check=True)\n" % (cmds,)
    # store the graph fingerprints for a later graph-equiv (see above)
    env = {**os.environ, "TRNRT_GRAPH_CACHE": "1"}
    with open(out.parent / f"{out.name}.log", "w") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT)


def _session_dir(tmp_path_factory, worker_id: str) -> Path:
    """A directory every pytest-xdist worker of this session shares (pytest-of-USER/pytest-N);
    the session's own base directory when xdist is off."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def compiled(tiny_dir, tmp_path_factory, worker_id) -> dict[str, Path]:
    """{"default_a", "default_b", "batch8"}: artifact directories (absent keys: not compiled).

    Compiled once per test session, whichever xdist worker asks first: the others wait on a file
    lock and reuse its artifacts. (pytest-xdist's `--dist loadgroup` cannot keep the compile tests
    on one worker under pytest 9.2: it tags `item._nodeid`, which pytest 9.2 no longer reads; so
    the group spread over both workers and each compiled every graph, at the same time, into the
    same Inductor cache directory — double the CPU, and once an empty metadata file in a package.)
    """
    from filelock import FileLock

    root = _session_dir(tmp_path_factory, worker_id) / "trnrt-compiled"
    dirs = {"batch8": root / "a" / "batch8" / "cpu"}
    if not SUBSET:
        dirs.update(default_a=root / "a" / "default" / "cpu", default_b=root / "b" / "default" / "cpu")
    with FileLock(str(root) + ".lock"):
        if (root / "FAILED").exists():
            pytest.fail("the compile jobs failed (in another worker):\n" + (root / "FAILED").read_text())
        if (root / "DONE").exists():
            return dirs
        root.mkdir(parents=True, exist_ok=True)
        jobs = {"a": [("batch8", BATCH8)]} if SUBSET else \
            {"a": [("default", DEFAULT_A), ("batch8", BATCH8)], "b": [("default", DEFAULT_B)]}
        procs = {k: _job(tiny_dir, root / k, steps) for k, steps in jobs.items()}
        failed = [f"compile job {k} failed:\n" + (root / f"{k}.log").read_text()[-4000:]
                  for k, p in procs.items() if p.wait() != 0]
        if failed:
            (root / "FAILED").write_text("\n".join(failed))
            pytest.fail("\n".join(failed))
        (root / "DONE").write_text("")
    return dirs


@pytest.fixture(scope="session")
def compiled_batch8(compiled) -> Path:
    return compiled["batch8"]


@pytest.fixture(scope="session")
def compiled_default_a(compiled) -> Path:
    if "default_a" not in compiled:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return compiled["default_a"]


@pytest.fixture(scope="session")
def compiled_default_b(compiled) -> Path:
    if "default_b" not in compiled:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return compiled["default_b"]
