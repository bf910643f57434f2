"""The benchmark loop: arrivals (all at once, or Poisson at `request_rate`) and a bounded pool of
client threads (never more than `max_concurrency` requests in flight).

The unit of work is a conversation: its turns are sent one after another by one thread (turn k
carries the earlier turns and their answers), different conversations run concurrently. A
single-turn data set is one request per conversation. Conversation i arrives at
`arrival_times(...)[i]` after the start; if every thread is busy then, it waits for one (as SGLang's
bench_serving waits on its semaphore), and its requests' timings start when they are sent.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from trnrt.benchmark.client import RequestResult, Target, build_body, send
from trnrt.benchmark.datasets import Conversation, Turn


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Offsets (s) of n arrivals: all 0 for an infinite rate, else a Poisson process (exponential
    gaps of mean 1 / rate; the first arrival at 0)."""
    if n <= 0:
        return []
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(request_rate)
        out.append(t)
    return out


def turn_payload(kind: str, history: list[tuple[Turn, str]], turn: Turn) -> dict:
    """`messages` (chat) or `prompt` (text routes) for `turn` after the answered turns in `history`."""
    system = turn.system if turn.system is not None else (history[0][0].system if history else None)
    if kind == "chat":
        if turn.ids is not None:
            raise ValueError("token-id prompts cannot be sent to /v1/chat/completions")
        messages = [{"role": "system", "content": system}] if system else []
        for t, answer in history:
            messages += [{"role": "user", "content": t.text}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": turn.text})
        return {"messages": messages}
    if turn.ids is not None:
        return {"prompt": list(turn.ids)}
    parts = [system] if system else []
    for t, answer in history:
        parts += [t.text, answer]
    parts.append(turn.text)
    return {"prompt": "\n\n".join(parts)}


@dataclass
class RunOutput:
    results: list[RequestResult]  # every turn of every conversation, in data set order
    duration: float  # s, from the first arrival until the last request ended
    peak_in_flight: int = 0
    interrupted: bool = False


def run_one(target: Target, kind: str, turn: Turn, history: list[tuple[Turn, str]], *, ignore_eos: bool,
            temperature: float, extra_body: dict | None = None) -> RequestResult:
    body = build_body(kind, target, **turn_payload(kind, history, turn), max_tokens=turn.output_len,
                      ignore_eos=ignore_eos, temperature=temperature, extra=extra_body)
    return send(target, kind, body, input_len=turn.input_len, output_len=turn.output_len)


def run_benchmark(target: Target, kind: str, conversations: list[Conversation], *,
                  max_concurrency: int | None = None, request_rate: float = math.inf, seed: int = 1,
                  ignore_eos: bool = True, temperature: float = 0.0, extra_body: dict | None = None,
                  on_result: Callable[[RequestResult], None] | None = None,
                  stop: threading.Event | None = None) -> RunOutput:
    """Run every conversation; `on_result` is called (from a client thread) after each request.
    Setting `stop` makes the loop send nothing more; what is in flight finishes."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    for conv in conversations:  # a bad payload is a usage error before anything is sent
        for turn in conv.turns:
            turn_payload(kind, [], turn)
    stop = stop or threading.Event()
    n = len(conversations)
    workers = min(n, max_concurrency or n)
    arrivals = arrival_times(n, request_rate, seed)
    per_conv: list[list[RequestResult]] = [[] for _ in range(n)]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    lock = threading.Lock()
    state = {"in_flight": 0, "peak": 0, "end": 0.0}

    def work() -> None:
        while True:
            i = todo.get()
            if i is None:
                return
            history: list[tuple[Turn, str]] = []
            for turn in conversations[i].turns:
                if stop.is_set():
                    break
                with lock:
                    state["in_flight"] += 1
                    state["peak"] = max(state["peak"], state["in_flight"])
                try:
                    res = run_one(target, kind, turn, history, ignore_eos=ignore_eos, temperature=temperature,
                                  extra_body=extra_body)
                except Exception as e:  # noqa: BLE001 - a client bug must not hang the loop
                    res = RequestResult(error=f"{type(e).__name__}: {e}", input_len=turn.input_len,
                                        output_len=turn.output_len, start_time=time.perf_counter())
                with lock:
                    state["in_flight"] -= 1
                    state["end"] = max(state["end"], time.perf_counter())
                per_conv[i].append(res)
                if on_result is not None:
                    on_result(res)
                if not res.success:
                    break  # a conversation stops at its first failed turn
                history.append((turn, res.generated_text))

    threads = [threading.Thread(target=work, name=f"bench-client-{k}", daemon=True) for k in range(workers)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    interrupted = False
    try:
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0 and stop.wait(delay):
                break
            if stop.is_set():
                break
            todo.put(i)
    except KeyboardInterrupt:
        stop.set()
        interrupted = True
    for _ in threads:
        todo.put(None)
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        interrupted = True
    end = state["end"] or time.perf_counter()
    results = [r for rs in per_conv for r in rs]
    return RunOutput(results=results, duration=max(end - t0, 1e-9), peak_in_flight=state["peak"],
                     interrupted=interrupted or stop.is_set())
