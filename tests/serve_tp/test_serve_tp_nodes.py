"""Two "nodes" on one host (issue #31): `trnrt serve --tp-size 2 --ep-size 2 --nnodes 2` as two
processes meeting at a `--dist-init-addr` rendezvous, node 0 serving HTTP with rank 0 and node 1
running rank 1 and no HTTP. Against it, README.md's "Using the server" examples as written there
(the curl commands and the Python client snippets, read from the README's code blocks with the
port substituted, the `trnrt serve` flags they need given to both nodes); then the layout and the
ranks' agreement; then rank 1 raising alone (a fault injected on node 1 only: trnrt.engine.core.tp_fault)
ends node 0's server as a dead rank does (exit code 3 within 10 s, a log line naming the other node's
rank), node 1 exits 3 with a line naming the rank and the error, and no rank is left behind. (A
SIGKILLed rank on rank 0's node: test_serve_tp_kill.py; the watchdog's and the worker's own side
of a SIGKILL: tests/engine/core/test_tp_launch.py.)

One test function on purpose: under `pytest -n 2` (CI) tests of one module may run on both
workers, each starting its own module fixture; one function pays for exactly one deployment."""

from __future__ import annotations


import contextlib
import http.client
import io
import json
import os
import re
import shlex
import signal
import threading
import time
import urllib.parse
from pathlib import Path

from tp_support import LONE_FAULT_SEED, NodeProcess, ServeProcess, pid_alive, stop

from trnrt.engine.core.tp_failure import DEFAULT_FAILURE_WAIT_S as FAILURE_WAIT_S

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:30000"  # where the README's examples expect `trnrt serve`
REQUIRED_PATHS = {"/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/get_load", "/abort_request"}
CURL_FLAGS = {"-s", "--silent", "-S", "--show-error"}


# -- README.md's examples -----------------------------------------------------------------------

def readme_section(title: str = "Using the server") -> list[tuple[str, str]]:
    """(language, text) of every fenced code block under README.md's `## title`."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)]


def shell_commands(block: str) -> list[list[str]]:
    """A bash block's commands as argv lists: a newline outside quotes ends a command
    (a quoted JSON body may span lines), a backslash-newline continues it."""
    cmds, cur, quote, i = [], [], None, 0
    while i < len(block):
        c = block[i]
        if quote is None and c == "\\" and block[i + 1:i + 2] == "\n":
            i += 2
            continue
        if quote is None and c == "\n":
            cmds.append("".join(cur))
            cur = []
        else:
            if quote is None and c in "'\"":
                quote = c
            elif c == quote:
                quote = None
            cur.append(c)
        i += 1
    cmds.append("".join(cur))
    assert quote is None, f"unbalanced quote in a README bash block:\n{block}"
    argvs = [shlex.split(c, comments=True) for c in cmds]
    return [a[:-1] if a[-1] == "&" else a for a in argvs if a]


def readme_examples() -> tuple[list[str], list[list[str]], list[str]]:
    """(the flags of the section's `trnrt serve` commands but --port, its curl commands, its Python blocks)."""
    flags, curls, pys = [], [], []
    for lang, block in readme_section():
        if lang == "python":
            pys.append(block)
        elif lang in ("bash", "sh", "shell", ""):
            for argv in shell_commands(block):
                if argv[0] == "curl":
                    curls.append(argv)
                elif argv[0].endswith("trnrt") and argv[1:2] == ["serve"]:
                    rest = iter(argv[2:])
                    for a in rest:
                        if a == "--port":
                            next(rest)
                        elif a not in flags:
                            flags.append(a)
    return flags, curls, pys


def curl_request(argv: list[str]) -> tuple[str, str, dict, str | None]:
    """(method, path, headers, body) of a README curl command; an option this does not know fails."""
    method, headers, data, url = None, {}, None, None
    args = iter(argv[1:])
    for a in args:
        if a in CURL_FLAGS:
            continue
        if a in ("-H", "--header"):
            k, _, v = next(args).partition(":")
            headers[k.strip()] = v.strip()
        elif a in ("-d", "--data", "--data-raw"):
            data = next(args)
        elif a in ("-X", "--request"):
            method = next(args)
        elif a.startswith("http://"):
            url = a
        else:
            raise AssertionError(f"the README's curl option {a!r} is not translated by this test: {shlex.join(argv)}")
    assert url and url.startswith(README_URL + "/"), shlex.join(argv)
    if data is not None:
        json.loads(data)  # the README's body is JSON
    u = urllib.parse.urlsplit(url)
    return method or ("POST" if data is not None else "GET"), u.path + (f"?{u.query}" if u.query else ""), headers, data


def check_answer(path: str, request: dict | None, body) -> None:
    """A sane answer of `path` to the README's `request` (None: an empty body)."""
    if path == "/abort_request":  # SGLang's answer: an empty 200
        return
    assert isinstance(body, (dict, list)), body
    if isinstance(body, dict):
        assert "error" not in body, body
    if path == "/v1/chat/completions":
        (choice,) = body["choices"]
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length"), body
        assert 0 < body["usage"]["completion_tokens"] <= request["max_tokens"], body
    elif path == "/v1/completions":
        assert len(body["choices"]) == request.get("n", 1), body
        assert all(isinstance(c["text"], str) for c in body["choices"]), body
        if request.get("echo"):
            assert body["choices"][0]["text"].startswith(request["prompt"]), body
            assert len(body["choices"][0]["logprobs"]["token_logprobs"]) >= body["usage"]["prompt_tokens"], body
    elif path == "/generate":
        assert isinstance(body["text"], str) and body["meta_info"]["id"] == request["rid"], body
        assert 0 < body["meta_info"]["completion_tokens"] <= request["sampling_params"]["max_new_tokens"], body
    elif path == "/tokenize":
        assert body["tokens"] and all(isinstance(t, int) for t in body["tokens"]), body


def run_curl_examples(url: str, curls: list[list[str]]) -> list[str]:
    """Each README curl command against `url` (http.client: the machine needs no curl); the failures."""
    port = int(url.rsplit(":", 1)[1])
    failures = []
    for argv in curls:
        method, path, headers, data = curl_request(argv)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request(method, path, body=data.encode() if data is not None else None, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            body = json.loads(raw) if raw else None
            assert r.status == 200, (r.status, raw[:500])
            check_answer(path.split("?")[0], json.loads(data) if data else None, body)
        except (AssertionError, ValueError, KeyError, TypeError) as e:
            failures.append(f"{shlex.join(argv)}\n  -> {r.status} {raw[:800]!r}\n  {type(e).__name__}: {e}")
    return failures


def run_python_examples(url: str, blocks: list[str]) -> list[str]:
    """The README's Python blocks in order, in one namespace (a later block uses an earlier
    block's `client`), the README's URL replaced by `url`; each must finish and print something."""
    failures, ns = [], {"__name__": "readme"}
    for block in blocks:
        code = block.replace(README_URL, url)
        out = io.StringIO()
        result: list = []

        def run():
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(code, "README.md", "exec"), ns)
                result.append(None)
            except BaseException as e:  # noqa: BLE001 - reported below
                result.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(180)
        if not result:
            failures.append(f"did not finish within 180 s:\n{block}")
        elif result[0] is not None:
            failures.append(f"raised {type(result[0]).__name__}: {result[0]}\n{block}")
        elif not out.getvalue().strip():
            failures.append(f"printed nothing:\n{block}")
    return failures


# -- the two-node deployment --------------------------------------------------------------------

def start_two_nodes(flags: list[str]) -> tuple[ServeProcess, NodeProcess]:
    """Node 1 (its rank waits at the rendezvous), then node 0 (returns once it serves)."""
    from trnrt.engine.core.tp_launch import free_addr

    common = ["--tp-size", "2", "--ep-size", "2", "--nnodes", "2", "--dist-init-addr", free_addr(), *flags]
    node1 = NodeProcess(*common, "--node-rank", "1", env={"TRNRT_TP_TEST_FAULT": f"{LONE_FAULT_SEED}:1"})
    try:
        node0 = ServeProcess(*common, "--node-rank", "0", env={"TRNRT_TP_CHECK_EVERY": "1"})
    except AssertionError as e:
        node1.kill()
        raise AssertionError(f"{e}\n-- node 1 --\n{node1.output()}") from None
    return node0, node1


def test_two_nodes_answer_the_readme_then_a_lone_failure_ends_both():
    flags, curls, pys = readme_examples()
    found = {curl_request(c)[1].split("?")[0] for c in curls}
    assert REQUIRED_PATHS <= found, f"README.md's examples lost {REQUIRED_PATHS - found}"
    assert any("chat.completions.create" in b for b in pys), "README.md has no openai client example"

    node0, node1 = start_two_nodes(flags)
    srv = node0.server()
    try:
        # 1. the README's examples, every one (a failure is reported with the others)
        failures = run_curl_examples(node0.url, curls) + run_python_examples(node0.url, pys)
        assert not failures, "README examples failed against tp 2 / ep 2 on two nodes:\n\n" + "\n\n".join(failures)

        # 2. the layout: rank 1 is node 1's process, node 0 started no worker; the ranks agree
        status, info, _ = srv.raw("GET", "/server_info")
        assert status == 200 and (info["tp_size"], info["ep_size"]) == (2, 2), info
        (engine,) = srv.stats()["engines"]
        par = engine["parallel"]
        assert (par["tp_size"], par["ep_size"], par["nnodes"]) == (2, 2, 2), par
        assert node0.rank_pids() == {}, node0.output()[-3000:]
        node1_ranks = node1.rank_pids()
        assert list(node1_ranks) == [1], node1.output()
        r0, r1 = par["ranks"]
        assert (r0["rank"], r1["rank"], r1["pid"]) == (0, 1, node1_ranks[1]), par
        assert par["agreement"]["checks"] >= 10 and par["agreement"]["mismatches"] == 0, par
        assert r1["steps"] == r0["steps"] == par["steps"] and r1["digest"] == r0["digest"], par

        # 3. rank 1 (node 1) raises alone (the injected fault for LONE_FAULT_SEED: as an OOM of its
        # shard would) while a request streams: it exits within the failure wait, and node 0's
        # server ends as for a dead rank, naming the other node's rank; node 1's log names the error
        worker = node1_ranks[1]
        ended = threading.Event()

        def stream():
            with contextlib.suppress(Exception):
                srv.sse_events("/v1/completions", {"prompt": "Once", "max_tokens": 900, "stream": True,
                                                   "ignore_eos": True}, timeout=30)
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(1.0)
        t0 = time.monotonic()

        def faulty():
            with contextlib.suppress(Exception):
                srv.raw("POST", "/v1/completions", {"prompt": "Fault", "max_tokens": 4, "temperature": 1.0,
                                                    "seed": LONE_FAULT_SEED}, timeout=30)

        threading.Thread(target=faulty, daemon=True).start()
        statuses = []
        while node0.proc.poll() is None and time.monotonic() - t0 < 15:
            with contextlib.suppress(OSError):
                statuses.append((time.monotonic() - t0, srv.raw("POST", "/v1/completions",
                                                                {"prompt": "hi", "max_tokens": 2}, timeout=2)[0]))
            time.sleep(0.05)
        code = node0.wait(15)
        elapsed = time.monotonic() - t0
        log = node0.output()
        assert code == 3, log[-3000:]
        assert elapsed < 10, elapsed
        assert ended.wait(5), "the streaming request did not end"
        late = [s for t, s in statuses if t > FAILURE_WAIT_S + 1.0]
        assert all(s == 503 for s in late), statuses
        assert "a tensor-parallel rank on another node is gone (node 1: rank 1)" in log, log[-4000:]
        assert node1.wait(10) == 3, node1.output()[-3000:]
        lone = (f"tensor-parallel rank 1: 'execute' raised InjectedFault: injected test fault on rank 1 "
                f"(seed {LONE_FAULT_SEED})")
        assert lone in node1.output() and "the failure is this rank's alone" in node1.output(), node1.output()[-3000:]
        deadline = time.monotonic() + 5
        while pid_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(worker), "node 1's rank outlived its node"
    finally:
        try:
            stop(node0)
        finally:  # node 1 never outlives the test, even when node 0 did not stop
            node1.kill()
        if pid_alive(node1.rank_pids().get(1, -1)):
            os.kill(node1.rank_pids()[1], signal.SIGKILL)
