"""EngineWatch: a server whose engine died exits non-zero instead of answering 503 forever.

With tensor parallelism a dead rank ends the engine process (trnrt.engine.core.tp_launch's
watchdog); this thread sees the engine client's `alive` turn False, logs one error line, stops
admission (new requests and /health get 503 at once, as during a drain), and then ends the
server through the graceful shutdown (a SIGINT to the main thread), so that a supervisor
(sglang-router, Kubernetes) restarts it. `exit_code` is then RANK_DIED_EXIT_CODE; if the graceful
path has not ended the process within `hard_exit_s`, it exits with that code at once.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import threading
import time

from trnrt.serve.http.state import get_state

log = logging.getLogger("trnrt.serve")

EXIT_CODE = 3  # = trnrt.engine.core.tp_config.RANK_DIED_EXIT_CODE (the serve layer imports no engine module)


class EngineWatch:
    def __init__(self, engine, app, poll_s: float = 0.2, hard_exit_s: float = 6.0):
        self.engine = engine
        self.state = get_state(app)
        self.poll_s = poll_s
        self.hard_exit_s = hard_exit_s
        self.exit_code = 0
        self._thread = threading.Thread(target=self._watch, name="trnrt-engine-watch", daemon=True)

    def start(self) -> "EngineWatch":
        self._thread.start()
        return self

    def _alive(self) -> bool:
        alive = getattr(self.engine, "alive", True)
        return bool(alive() if callable(alive) else alive)

    def _watch(self) -> None:
        while self._alive():
            if self.state.shutting_down.is_set():
                return  # an ordinary shutdown: the engine stops because we asked
            time.sleep(self.poll_s)
        if self.state.shutting_down.is_set():
            return
        self.exit_code = EXIT_CODE
        log.critical("the engine exited (a tensor-parallel rank died; its log line is above): answering 503 and "
                     "exiting with code %d", EXIT_CODE)
        self.state.shutting_down.set()
        timer = threading.Timer(self.hard_exit_s, self._hard_exit)
        timer.daemon = True
        timer.start()
        time.sleep(0.5)  # let the requests in flight get their error answers
        _thread.interrupt_main(signal.SIGINT)

    def _hard_exit(self) -> None:
        log.critical("the server did not stop within %.0f s of the engine's death; exiting now", self.hard_exit_s)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_CODE)
