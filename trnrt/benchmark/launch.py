"""Start `trnrt serve` for a benchmark run (no --url given), and stop it afterwards.

The server runs in a child process (`python -m trnrt serve --port 0 ...`, the same interpreter):
its log line `ready at http://HOST:PORT` gives the URL, then GET /health must answer 200. At the
end it gets SIGINT (its graceful drain; nothing is in flight by then) and, after a grace period,
SIGKILL. Its output goes to `log_path` (or is kept in memory, last lines only, for error messages).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

from trnrt.benchmark.client import ServerError, Target, wait_ready

_READY = re.compile(r"ready at (https?://[^\s]+)")


class ServeProcess:
    def __init__(self, model: str | None, serve_args: list[str], *, log_path: str | None = None,
                 ready_timeout_s: float = 600.0):
        args = list(serve_args)
        cmd = [sys.executable, "-m", "trnrt", "serve"]
        if model is not None:
            cmd += ["--model", model]
        if not any(a == "--port" or a.startswith("--port=") for a in args):
            cmd += ["--port", "0"]
        self.cmd = cmd + args
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self._url: str | None = None
        self._seen = threading.Event()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, name="bench-serve-log", daemon=True)
        self._reader.start()
        self.ready_timeout_s = ready_timeout_s

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            if self._url is None:
                m = _READY.search(line)
                if m:
                    self._url = m.group(1).replace("://0.0.0.0:", "://127.0.0.1:")
                    self._seen.set()
        self._seen.set()  # EOF: the process ended

    def wait_ready(self) -> str:
        """The server's base URL once it answers GET /health; ServerError if it exits or times out."""
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._seen.wait(0.5):
            if time.monotonic() > deadline:
                raise ServerError(f"trnrt serve did not log 'ready at' within {self.ready_timeout_s:g} s"
                                  + self._tail_text())
        if self._url is None:
            self.proc.wait(5)
            raise ServerError(f"trnrt serve exited (status {self.proc.returncode}) before it was ready"
                              + self._tail_text())
        wait_ready(Target(self._url), max(deadline - time.monotonic(), 5.0), alive=lambda: self.proc.poll() is None)
        return self._url

    def _tail_text(self) -> str:
        return ("; its last lines:\n  " + "\n  ".join(self.tail)) if self.tail else ""

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
