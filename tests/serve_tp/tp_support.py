"""A real `trnrt serve --tp-size 2` subprocess as serve_support's Server, and what the serve
suite's `any_server` tests read of an engine that lives in other processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from serve_support import Server, tok_dir, tokenizer, tokenizer_factory  # noqa: F401

READY_TIMEOUT_S = 240  # two ranks load the model and torch on a loaded 2-core box
MAX_RUNNING = 8  # the serve suite's 16 concurrent streams still fit (the HTTP layer admits 2 x this)
SERVER_FLAGS = (
    "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",  # MTP: greedy / sampled requests speculate
    "--penalties", "--structured-outputs",  # the variant graphs (such requests run plain steps)
    "--enable-priority-scheduling", "--max-running-requests", str(MAX_RUNNING),  # priority preemption
    "--prompt-logprobs",  # echo + logprobs: the prompt-logprobs prefill graph
)
# trnrt.engine.core.tp_fault: a request with this seed makes its step raise on every rank (a shared
# failure the server survives); one with LONE_FAULT_SEED raises on rank 1 alone (the server ends).
SHARED_FAULT_SEED = 7001
LONE_FAULT_SEED = 7002
TEST_FAULTS = f"{SHARED_FAULT_SEED}:0,1;{LONE_FAULT_SEED}:1"


@dataclass
class _ModelInfo:
    backend: str = "eager"


class RemoteEngine:
    """The part of an in-process engine the reused tests read (`model_info.backend`)."""

    model_info = _ModelInfo()


class RemoteApp:
    """What `get_state(server.app).tokinfo().tokenizer` reads: the served model's tokenizer, here."""

    def __init__(self):
        from types import SimpleNamespace

        from trnrt.models.tiny import default_model_dir
        from trnrt.serve import hf_tokenizer_factory

        tok = hf_tokenizer_factory(str(default_model_dir()))()
        self.serve_state = SimpleNamespace(tokinfo=lambda: SimpleNamespace(tokenizer=tok))


class ServeProcess:
    """`trnrt serve ARGS --port 0` with its output collected (a reader thread keeps the pipe empty)."""

    def __init__(self, *args: str, env: dict | None = None):
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trnrt", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TRNRT_TORCH_THREADS": "1", **(env or {})})
        self.url = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(READY_TIMEOUT_S) or self.url is None:
            self.kill()
            raise AssertionError("trnrt serve --tp-size did not become ready:\n" + self.output())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def server(self) -> Server:
        port = int(self.url.rsplit(":", 1)[1])
        return Server(url=self.url, port=port, engine=RemoteEngine(), app=RemoteApp(), srv=self.proc)

    def rank_pids(self) -> dict[int, int]:
        """Worker ranks' pids from the start-up log ('tensor-parallel rank R started (pid P)')."""
        return {int(r): int(p) for r, p in re.findall(r"tensor-parallel rank (\d+) started \(pid (\d+)\)", self.output())}

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stop(sp: ServeProcess, timeout_s: float = 30.0) -> int:
    """SIGTERM (the graceful shutdown), then the exit status."""
    import signal

    if sp.proc.poll() is None:
        sp.proc.send_signal(signal.SIGTERM)
    try:
        return sp.wait(timeout_s)
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def tp_server():
    """`trnrt serve --tp-size 2` on the embedded model, the agreement checked every step, with
    what test_serve_tp's feature tests need (SERVER_FLAGS)."""
    sp = ServeProcess("--tp-size", "2", "--served-model-name", "trnrt-tiny", "--context-length", "1024",
                      *SERVER_FLAGS, env={"TRNRT_TP_CHECK_EVERY": "1", "TRNRT_TP_TEST_FAULT": TEST_FAULTS})
    try:
        yield sp
    finally:
        stop(sp)


@pytest.fixture(scope="module")
def any_server(tp_server):
    return tp_server.server()


class NodeProcess:
    """`trnrt serve ARGS --nnodes K --node-rank R` (R > 0): a node launcher, no HTTP; its output
    collected as ServeProcess's. Does not wait: node 0's rendezvous completes the start."""

    def __init__(self, *args: str, env: dict | None = None):
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trnrt", "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TRNRT_TORCH_THREADS": "1", **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    output = ServeProcess.output
    rank_pids = ServeProcess.rank_pids
    wait = ServeProcess.wait
    kill = ServeProcess.kill


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
