"""What takes a tensor-parallel group down when a rank process ends, without a model: rank 0's
RankWatchdog over its worker processes (a SIGKILLed one, one that failed alone), and a worker's
own watch on the process that started it. The servers' tests end a rank by SIGKILL
(tests/serve_tp/test_serve_tp_kill.py) and by a lone failure (test_serve_tp_nodes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trnrt.engine.core.tp_failure import LONE_FAILURE_EXIT_CODE
from trnrt.engine.core.tp_launch import RankWatchdog


def _watch(procs: dict) -> list[str]:
    """A started watchdog over `procs` whose fatal() records its message instead of exiting."""
    messages = []
    dog = RankWatchdog(procs, poll_s=0.02)
    dog.fatal = lambda m: (messages.append(m), setattr(dog, "closing", True))
    dog.start()
    return messages


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_sigkilled_rank_is_fatal_naming_it():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        messages = _watch({1: p})
        time.sleep(0.1)
        assert not messages
        os.kill(p.pid, signal.SIGKILL)
        assert _wait(lambda: messages)
        assert messages == [f"tensor-parallel rank 1 (pid {p.pid}) exited with code -9"]
    finally:
        p.kill()
        p.wait()


def test_a_rank_that_failed_alone_is_named_so():
    p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({LONE_FAILURE_EXIT_CODE})"])
    messages = _watch({1: p})
    assert _wait(lambda: messages)
    assert messages[0].startswith(f"tensor-parallel rank 1 (pid {p.pid}) exited with code {LONE_FAILURE_EXIT_CODE} "
                                  "(a call failed on that rank alone"), messages


def test_a_worker_exits_when_the_process_that_started_it_is_killed():
    """tp_worker's parent watch (what ends node 1's rank when node 1's launcher is SIGKILLed)."""
    # argv[1]: the launcher's pid, passed as tp_launch passes --parent-pid
    worker = ("import sys, time; from trnrt.engine.core.tp_worker import _watch_parent; "
              "_watch_parent(int(sys.argv[1]), 1); print('watching', flush=True); time.sleep(60)")
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time; "
         f"p = subprocess.Popen([sys.executable, '-c', {worker!r}, str(os.getpid())]); print(p.pid, flush=True); "
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    pid = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "watching" and _alive(pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert _wait(lambda: not _alive(pid)), "the worker outlived the process that started it"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
