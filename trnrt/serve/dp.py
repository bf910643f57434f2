"""`trnrt serve --dp N`: N engine processes behind sglang-router, supervised. Pure Python (stdlib).

The supervisor starts N `trnrt serve` subprocesses (the same options minus --dp, --host and
--port, each on 127.0.0.1:<free port>), waits for each one's /health, then starts sglang-router
(`python -m sglang_router.launch_router`) on --host/--port in front of them with the settings of
`router_command` (docs/DEPLOY.md says why each one). It then watches the processes:

- an engine that dies is restarted on the same port after an exponential backoff (1 s, doubling up
  to 30 s; back to 1 s once an engine has stayed up for a minute), with a log line each time; the
  router's health checks take it out of rotation meanwhile and put it back once /health answers;
- SIGTERM or SIGINT: every engine is sent SIGTERM (each drains: new requests 503, which the router
  retries elsewhere; in-flight ones finish within --drain-timeout), then the router is stopped;
  exit 0. A second signal makes the engines abort at once;
- the router dying ends the deployment: the engines are drained and the exit status is 1.

The children run in their own session (a terminal's Ctrl-C reaches only the supervisor, which
forwards it once) and, on Linux, get SIGTERM if the supervisor itself dies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger("trnrt.serve.dp")

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
INSTALL_HINT = ("--dp > 1 runs sglang-router in front of the engines, and it is not installed; "
                "install it with: pip install -e '.[router]' in the trnrt checkout (or: pip install sglang-router==0.3.2)")
# The header the router's manual policy reads (sgl-model-gateway policies/manual.rs).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
DEFAULT_PROMETHEUS_PORT = 29000  # the router's own default

# Router settings chosen for trnrt (docs/DEPLOY.md, "Router settings").
HEALTH_CHECK_INTERVAL_S = 1
HEALTH_CHECK_TIMEOUT_S = 2
HEALTH_FAILURE_THRESHOLD = 2
HEALTH_SUCCESS_THRESHOLD = 1
RETRY_MAX_ATTEMPTS = 10  # the router's --retry-max-retries counts every attempt, the first included
RETRY_INITIAL_BACKOFF_MS = 100
RETRY_MAX_BACKOFF_MS = 1000
RETRY_BACKOFF_MULTIPLIER = 1.5
CACHE_THRESHOLD = 0.3  # the router's default

RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap
STABLE_AFTER_S = 60.0  # an engine up this long resets its backoff
POLL_S = 0.1


def router_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


def balance_thresholds(max_running_requests: int) -> tuple[int, float]:
    """(--balance-abs-threshold, --balance-rel-threshold) for engines that each run
    `max_running_requests` at once. The router counts its own in-flight requests per engine;
    cache-aware routing yields to shortest-queue routing once one engine holds more than half a
    batch more than another (and 1.5x as many), i.e. before it has to queue while another engine
    has free batch slots."""
    return max(1, max_running_requests // 2), 1.5


def router_log_level(level: str) -> str:
    """The router logs two lines per request at info: it gets `warn` unless trnrt's level is debug."""
    return {"debug": "debug", "info": "warn", "warning": "warn"}.get(level.lower(), "error")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@dataclass
class DPConfig:
    dp: int
    engine_args: list[str]  # `trnrt serve` options for each engine (no --dp/--host/--port)
    host: str = "127.0.0.1"
    port: int = 30000
    router_policy: str = "cache_aware"
    max_running_requests: int = 64
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    api_key: str | None = None
    admin_api_key: str | None = None
    prometheus_port: int | None = None  # None: 29000, or a free port when that one is taken
    python: str = field(default_factory=lambda: sys.executable)


def router_command(cfg: DPConfig, worker_urls: list[str], prometheus_port: int) -> list[str]:
    """The sglang-router 0.3.2 command line (without the API key: it goes through the
    environment, see `_router_bootstrap`)."""
    abs_t, rel_t = balance_thresholds(cfg.max_running_requests)
    return [
        "--worker-urls", *worker_urls,
        "--host", cfg.host, "--port", str(cfg.port),
        "--policy", cfg.router_policy,
        "--cache-threshold", str(CACHE_THRESHOLD),
        "--balance-abs-threshold", str(abs_t), "--balance-rel-threshold", str(rel_t),
        # health: a dead engine leaves the rotation within ~interval x failures, a restarted one
        # rejoins at its first good answer
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
        "--health-check-timeout-secs", str(HEALTH_CHECK_TIMEOUT_S),
        "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
        "--health-success-threshold", str(HEALTH_SUCCESS_THRESHOLD),
        "--health-check-endpoint", "/health",
        # retries (408, 429, 500, 502, 503, 504 and connection errors): their backoff outlasts
        # the health checks' detection of a dead engine, so a request is not lost meanwhile
        "--retry-max-retries", str(RETRY_MAX_ATTEMPTS),
        "--retry-initial-backoff-ms", str(RETRY_INITIAL_BACKOFF_MS),
        "--retry-max-backoff-ms", str(RETRY_MAX_BACKOFF_MS),
        "--retry-backoff-multiplier", str(RETRY_BACKOFF_MULTIPLIER),
        # the breaker counts every non-2xx answer as a failure (client 400s included): off, so a
        # burst of bad requests cannot shut a healthy engine out; health checks do its job
        "--disable-circuit-breaker",
        "--worker-startup-check-interval", "1",
        "--shutdown-grace-period-secs", str(int(cfg.drain_timeout_s) + 5),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        "--log-level", router_log_level(cfg.log_level),
    ]


# Runs the router with its API key read from the environment (not visible in the process list).
_router_bootstrap = (
    "import os, sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[1:])\n"
    "args.api_key = os.environ.pop('TRNRT_ROUTER_API_KEY', None) or args.api_key\n"
    "launch_router(args)\n"
)


def _preexec() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _http_ok(url: str, timeout: float = 1.0, headers: dict | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Engine:
    def __init__(self, index: int, port: int):
        self.index = index
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.backoff_s = RESTART_BACKOFF_S[0]
        self.restart_at: float | None = None
        self.serving = False


class Supervisor:
    def __init__(self, cfg: DPConfig):
        self.cfg = cfg
        self.engines = [Engine(i, free_port()) for i in range(cfg.dp)]
        self.router: subprocess.Popen | None = None
        self.signals = 0
        self.stopping = False

    # -- processes ---------------------------------------------------------------------------
    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("TRNRT_API_KEY", "TRNRT_ADMIN_API_KEY")}
        env["PYTHONUNBUFFERED"] = "1"
        if self.cfg.api_key:
            env["TRNRT_API_KEY"] = self.cfg.api_key
        if self.cfg.admin_api_key:
            env["TRNRT_ADMIN_API_KEY"] = self.cfg.admin_api_key
        return env

    def _spawn_engine(self, e: Engine) -> None:
        cmd = [self.cfg.python, "-m", "trnrt", "serve", *self.cfg.engine_args, "--host", "127.0.0.1",
               "--port", str(e.port)]
        e.proc = subprocess.Popen(cmd, env=self._env(), preexec_fn=_preexec)
        e.started_at = time.monotonic()
        e.serving = False
        e.restart_at = None

    def _spawn_router(self, prometheus_port: int) -> None:
        args = router_command(self.cfg, [e.url for e in self.engines], prometheus_port)
        env = self._env()
        env.pop("TRNRT_API_KEY", None)
        env.pop("TRNRT_ADMIN_API_KEY", None)
        if self.cfg.api_key:
            env["TRNRT_ROUTER_API_KEY"] = self.cfg.api_key
            cmd = [self.cfg.python, "-c", _router_bootstrap, *args]
        else:
            cmd = [self.cfg.python, "-m", "sglang_router.launch_router", *args]
        log.info("starting sglang-router: %s", " ".join(["sglang_router.launch_router", *args]))
        self.router = subprocess.Popen(cmd, env=env, preexec_fn=_preexec)

    def _prometheus_port(self) -> int:
        if self.cfg.prometheus_port is not None:
            return self.cfg.prometheus_port
        if port_is_free("127.0.0.1", DEFAULT_PROMETHEUS_PORT):
            return DEFAULT_PROMETHEUS_PORT
        return free_port()

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals > 1:  # the engines' second signal aborts what is in flight
            log.warning("second signal: aborting the engines' in-flight requests")
            for e in self.engines:
                self._signal(e.proc, signal.SIGTERM)

    @staticmethod
    def _signal(proc: subprocess.Popen | None, sig: int) -> None:
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            self._kill_all()
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> int:
        cfg = self.cfg
        log.info("trnrt serve --dp %d: starting %d engines on %s", cfg.dp, cfg.dp,
                 ", ".join(e.url for e in self.engines))
        for e in self.engines:
            self._spawn_engine(e)
        code = self._wait_engines_ready()
        if code is not None:
            return code
        prom = self._prometheus_port()
        self._spawn_router(prom)
        code = self._wait_router_ready()
        if code is not None:
            return code
        log.info("trnrt serve: ready at http://%s:%d (sglang-router, policy %s, %d engines; router metrics at "
                 "http://127.0.0.1:%d/metrics)", cfg.host, cfg.port, cfg.router_policy, cfg.dp, prom)
        return self._watch()

    def _wait_engines_ready(self) -> int | None:
        pending = set(range(len(self.engines)))
        while pending:
            if self.signals:
                return self._shutdown(0)
            for i in sorted(pending):
                e = self.engines[i]
                rc = e.proc.poll()
                if rc is not None:
                    log.error("engine %d (%s) exited with code %s while starting; stopping", i, e.url, rc)
                    self._shutdown(rc)
                    return rc if rc > 0 else 1
                if _http_ok(e.url + "/health", timeout=0.5):
                    e.serving = True
                    log.info("engine %d ready at %s", i, e.url)
                    pending.discard(i)
            time.sleep(POLL_S)
        return None

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def _healthy_workers(self) -> int:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{self.cfg.port}/workers",
                                                               headers=self._auth()), timeout=1.0) as r:
                doc = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return -1
        workers = doc.get("workers", []) if isinstance(doc, dict) else []
        return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))

    def _wait_router_ready(self) -> int | None:
        while True:
            if self.signals:
                return self._shutdown(0)
            rc = self.router.poll()
            if rc is not None:
                log.error("sglang-router exited with code %s while starting; stopping the engines", rc)
                self._shutdown(1)
                return 1
            if self._healthy_workers() >= len(self.engines):
                return None
            self._check_engines()
            time.sleep(POLL_S * 2)

    def _check_engines(self) -> None:
        now = time.monotonic()
        for e in self.engines:
            if e.restart_at is not None:
                if now >= e.restart_at:
                    e.restarts += 1
                    log.warning("engine %d: restarting on %s (restart %d)", e.index, e.url, e.restarts)
                    self._spawn_engine(e)
                continue
            rc = e.proc.poll()
            if rc is None:
                if not e.serving and _http_ok(e.url + "/health", timeout=0.2):
                    e.serving = True
                    log.info("engine %d serving again at %s", e.index, e.url)
                if e.serving and now - e.started_at > STABLE_AFTER_S:
                    e.backoff_s = RESTART_BACKOFF_S[0]
                continue
            delay = e.backoff_s
            e.backoff_s = min(RESTART_BACKOFF_S[1], e.backoff_s * 2)
            e.restart_at = now + delay
            e.serving = False
            log.warning("engine %d (%s) exited with code %s; restarting it in %.0f s", e.index, e.url, rc, delay)

    def _watch(self) -> int:
        while True:
            if self.signals:
                return self._shutdown(0)
            rc = self.router.poll()
            if rc is not None:
                log.error("sglang-router exited with code %s; draining the engines and exiting", rc)
                self._shutdown(1)
                return 1
            self._check_engines()
            time.sleep(POLL_S)

    def _shutdown(self, code: int) -> int:
        """Drain the engines (SIGTERM each, wait), then stop the router."""
        if self.stopping:
            return code
        self.stopping = True
        live = [e for e in self.engines if e.proc is not None and e.proc.poll() is None]
        log.info("shutting down: draining %d engine(s) for up to %.0f s, then stopping the router", len(live),
                 self.cfg.drain_timeout_s)
        for e in live:
            self._signal(e.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout_s + 15.0
        for e in live:
            self._wait(e.proc, deadline)
        self._signal(self.router, signal.SIGTERM)
        self._wait(self.router, time.monotonic() + 10.0)
        return code

    @staticmethod
    def _wait(proc: subprocess.Popen | None, deadline: float) -> None:
        if proc is None:
            return
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _kill_all(self) -> None:
        for p in [e.proc for e in self.engines] + [self.router]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def engine_args_from_context(ctx, drop: tuple[str, ...]) -> list[str]:
    """The options given on the command line of a click command, as `--flag value` strings,
    leaving out the parameters named in `drop` (and those that came from the environment or a
    default: the engines inherit the environment)."""
    out: list[str] = []
    for p in ctx.command.params:
        if p.name in drop or not getattr(p, "opts", None) or p.name not in ctx.params:
            continue
        if getattr(ctx.get_parameter_source(p.name), "name", None) != "COMMANDLINE":
            continue
        value = ctx.params[p.name]
        if getattr(p, "is_flag", False) and not getattr(p, "count", False):
            if value:
                out.append(p.opts[0])
            elif p.secondary_opts:
                out.append(p.secondary_opts[0])
            continue
        if value is None:
            continue
        for v in (value if getattr(p, "multiple", False) else [value]):
            out.extend([p.opts[0], str(v)])
    return out


def run(cfg: DPConfig) -> int:
    """Run the deployment until a signal; returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(cfg).run()
