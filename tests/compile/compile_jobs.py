"""The test session's background compile jobs (the graphs of compile_groups.py).

`start(config)` launches them once per test session, from whichever pytest process asks first
(tests/conftest.py asks as soon as a worker has collected a test that needs the `compiled`
fixture, so the compiles overlap with every other test); `wait(config)` blocks until they have
finished and returns one merged artifact directory per preset (and flag set), as a single
`trnrt compile` of those graphs would have written it.

Each job is one process (compile_job.py) running `trnrt compile` for each of its steps in turn,
into its own --out (one per flag set). It runs in its own process group and kills it when the
pytest process that owns the session (the xdist controller, or pytest itself without xdist) is
gone, so an interrupted or `-x`-stopped session leaves no compiler running.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import compile_groups

JOB_SCRIPT = Path(__file__).with_name("compile_job.py")
WAIT_S = 80 * 60  # CI's whole run is killed at 90 min


def session_root(config) -> Path:
    """A directory every pytest-xdist worker of this session shares (pytest-of-USER/pytest-N: the
    controller's base temp directory, the workers' parent)."""
    base = config._tmp_path_factory.getbasetemp()
    return (base.parent if hasattr(config, "workerinput") else base) / "trnrt-compiled"


def _owner_pid() -> int:
    """The pid that lives as long as the session: the xdist controller (a worker's parent)."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


def flags_dir(flags) -> str:
    from trnrt.compile.catalogue import variant_name

    return variant_name(flags)  # "base" for no flags


def start(config) -> Path:
    """Start the compile jobs unless this session already has; returns the session's root."""
    from filelock import FileLock

    from trnrt.models.tiny import write_tiny_checkpoint

    root = session_root(config)
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / "jobs.json").exists():
            return root
        root.mkdir(parents=True, exist_ok=True)
        ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)  # the tiny_dir fixture's weights
        names = []
        for i, steps in enumerate(compile_groups.jobs()):
            name = chr(ord("a") + i)
            spec = {"model": str(ckpt), "out": str(root / name), "owner": _owner_pid(), "rc": str(root / f"{name}.rc"),
                    "steps": [{"preset": p, "flags": list(f), "dir": flags_dir(f), "only": ids} for p, f, ids in steps]}
            (root / f"{name}.json").write_text(json.dumps(spec, indent=1))
            # store the graph fingerprints for a later graph-equiv (CI)
            env = {**os.environ, "TRNRT_GRAPH_CACHE": "1"}
            with open(root / f"{name}.log", "w") as log:  # the child keeps its own copy of the fd
                p = subprocess.Popen([sys.executable, str(JOB_SCRIPT), str(root / f"{name}.json")], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            (root / f"{name}.pid").write_text(str(p.pid))
            names.append(name)
        (root / "jobs.json").write_text(json.dumps({"jobs": names, "started": time.time()}))
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a finished child of this very process is a zombie until reaped
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _wait_jobs(root: Path) -> list[str]:
    """Blocks until every job has finished; returns a failure message per failed job."""
    names = json.loads((root / "jobs.json").read_text())["jobs"]
    deadline = time.monotonic() + WAIT_S
    failed = []
    for name in names:
        rc_file, pid = root / f"{name}.rc", int((root / f"{name}.pid").read_text())
        while not rc_file.exists() and _alive(pid) and time.monotonic() < deadline:
            time.sleep(1)
        if not rc_file.exists():  # it writes the rc just before it exits
            time.sleep(1)
        rc = rc_file.read_text().strip() if rc_file.exists() else "died" if not _alive(pid) else "timed out"
        if rc != "0":
            log = (root / f"{name}.log").read_text()[-4000:]
            failed.append(f"compile job {name} failed ({rc}):\n{log}")
    return failed


def _merge(root: Path) -> None:
    """One artifact directory per (flag set, preset) under root/merged, from the jobs' outputs:
    every graph's files and manifest entry, in catalogue order; the rest of the manifests must
    agree (same preset, flags, versions, compiler options)."""
    from trnrt.compile.catalogue import expand
    from trnrt.compile.manifest import Manifest
    from trnrt.config.presets import load_preset

    names = json.loads((root / "jobs.json").read_text())["jobs"]
    for flags in compile_groups.FLAG_SETS:
        for preset in compile_groups.PRESETS:
            parts = [root / n / flags_dir(flags) / preset / "cpu" for n in names]
            parts = [p for p in parts if (p / "manifest.json").is_file()]
            if not parts:
                continue
            dst = root / "merged" / flags_dir(flags) / preset / "cpu"
            (dst / "graphs").mkdir(parents=True, exist_ok=True)
            mans = [Manifest.read(p) for p in parts]
            head = mans[0].to_json()
            entries = {}
            for part, man in zip(parts, mans):
                other = man.to_json()
                diff = [k for k in head if k != "graphs" and head[k] != other.get(k)]
                assert not diff, f"{preset}: the compile jobs' manifests differ in {diff}"
                for g in man.graphs:
                    for f in g.files:
                        shutil.copyfile(part / f, dst / f)
                    entries[g.id] = g
            order = [s.graph_id for s in expand(load_preset(preset), flags)]
            merged = mans[0]
            merged.graphs = [entries[i] for i in order if i in entries]
            merged.write(dst)


def wait(config) -> dict[str, Path]:
    """{artifact key (compile_groups.artifact_key): merged artifact directory}, once the jobs are
    done; fails the calling test when a job failed (in any worker)."""
    import pytest
    from filelock import FileLock

    root = start(config)
    with FileLock(str(root) + ".merge.lock"):
        if not (root / "FAILED").exists() and not (root / "DONE").exists():
            failed = _wait_jobs(root)
            if failed:
                (root / "FAILED").write_text("\n".join(failed))
            else:
                _merge(root)
                (root / "DONE").write_text("")
    if (root / "FAILED").exists():
        pytest.fail((root / "FAILED").read_text())
    return {compile_groups.artifact_key(p, f): root / "merged" / flags_dir(f) / p / "cpu"
            for f in compile_groups.FLAG_SETS for p in compile_groups.PRESETS
            if (root / "merged" / flags_dir(f) / p / "cpu" / "manifest.json").is_file()}


def logs(config) -> str:
    """The compile jobs' output (what their `trnrt compile` runs printed)."""
    root = session_root(config)
    names = json.loads((root / "jobs.json").read_text())["jobs"]
    return "\n".join((root / f"{n}.log").read_text() for n in names)
