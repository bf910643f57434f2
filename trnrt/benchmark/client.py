"""One streamed request per endpoint -> a `RequestResult` (http.client, no third-party client).

Endpoints (`ENDPOINTS`): `chat` (POST /v1/chat/completions), `completions` (POST /v1/completions)
and `generate` (POST /generate, SGLang's native route). All three are streamed (SSE).

What is timed, per request (`time.perf_counter`, on the client):
- `latency`: from just before the request is sent until the stream ends (`[DONE]` or EOF);
- `ttft`: until the first chunk that carries output (OpenAI routes: a non-empty `content`,
  `reasoning_content`, `tool_calls` or `text` delta; /generate: `meta_info.completion_tokens` > 0);
- `itl`: the gaps between later output chunks. On the OpenAI routes each chunk is one gap; on
  /generate a chunk that adds k tokens adds k gaps of (chunk gap / k), as SGLang's bench_serving
  does.

Token counts come from the server: `usage` (requested with `stream_options.include_usage`) on the
OpenAI routes, `meta_info.prompt_tokens` / `completion_tokens` on /generate. A server that sends
no usage leaves `output_tokens` at the number of output chunks and `usage_missing` set.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}
# `--backend` names of SGLang's bench_serving and vLLM's bench serve -> endpoint kind
BACKENDS = {
    "sglang": "generate", "sglang-native": "generate",
    "sglang-oai": "completions", "vllm": "completions", "openai": "completions",
    "sglang-oai-chat": "chat", "vllm-chat": "chat", "openai-chat": "chat",
}
TOKEN_ID_ENDPOINTS = ("completions", "generate")


class ServerError(RuntimeError):
    """A side call (/v1/models, /tokenize, /health) failed."""


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # perf_counter at send
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server
    output_tokens: int = 0
    usage_missing: bool = False
    generated_text: str = ""
    input_len: int = 0  # the data set's nominal length (used when the server reports none)
    output_len: int = 0  # what was asked


class Target:
    """Where the requests go: a base URL (http or https, optional path prefix), an API key, a
    model name and a per-socket-operation timeout."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0):
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s

    def connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s or self.timeout_s)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0):
        """(status, parsed JSON or None) of one non-streamed call."""
        conn = self.connection(timeout_s)
        try:
            conn.request(method, self.prefix + path, body=None if body is None else json.dumps(body).encode(),
                         headers=self.headers())
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        try:
            return r.status, json.loads(data) if data else None
        except ValueError:
            return r.status, None


def wait_ready(target: Target, timeout_s: float, *, alive=lambda: True) -> None:
    """Poll GET /health, then GET /v1/models, until one answers 200 (or raise ServerError)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        for path in ("/health", "/v1/models"):
            try:
                status, _ = target.call("GET", path, timeout_s=5.0)
            except (OSError, http.client.HTTPException) as e:
                last = f"GET {path}: {e}"
                continue
            if status == 200:
                return
            last = f"GET {path}: HTTP {status}"
        if time.monotonic() > deadline or not alive():
            raise ServerError(f"{target.url} not ready within {timeout_s:g} s ({last})")
        time.sleep(0.5)


def served_model(target: Target) -> str | None:
    """`data[0].id` of GET /v1/models, or None when the route does not answer."""
    try:
        status, body = target.call("GET", "/v1/models")
    except (OSError, http.client.HTTPException):
        return None
    try:
        return body["data"][0]["id"] if status == 200 else None
    except (TypeError, KeyError, IndexError):
        return None


def fetch_token_pool(target: Target, text: str) -> list[int]:
    """The server's token ids for `text` (POST /tokenize, SGLang's route): the random-ids pool."""
    try:
        status, body = target.call("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    except (OSError, http.client.HTTPException) as e:
        raise ServerError(f"POST /tokenize: {e}") from None
    ids = body.get("tokens") if status == 200 and isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ServerError(f"POST /tokenize: HTTP {status}, no token ids")
    return ids


def build_body(kind: str, target: Target, *, messages: list[dict] | None = None,
               prompt: str | list[int] | None = None, max_tokens: int, ignore_eos: bool,
               temperature: float, extra: dict | None = None) -> dict:
    if kind == "generate":
        sp = {"max_new_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        body = {("input_ids" if isinstance(prompt, list) else "text"): prompt, "sampling_params": sp,
                "stream": True}
        for k, v in (extra or {}).items():  # sampling keys go into sampling_params
            if k == "sampling_params" and isinstance(v, dict):
                sp.update(v)
            else:
                body[k] = v
        return body
    body = {"model": target.model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if kind == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body.update(extra or {})
    return body


def _delta_text(kind: str, choice: dict) -> str:
    if kind == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    if delta.get("tool_calls"):
        text += json.dumps(delta["tool_calls"])
    return text


def _events(resp):
    """The `data:` payloads of an SSE response, each with its arrival time."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield time.perf_counter(), line[5:].strip()


def send(target: Target, kind: str, body: dict, *, input_len: int = 0, output_len: int = 0) -> RequestResult:
    """Send one streamed request; never raises for a request-level failure (see `error`)."""
    res = RequestResult(input_len=input_len, output_len=output_len)
    path = ENDPOINTS[kind]
    conn = target.connection()
    res.start_time = st = time.perf_counter()
    try:
        conn.request("POST", target.prefix + path, body=json.dumps(body).encode(), headers=target.headers())
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:500].decode('utf-8', 'replace')}"
            res.latency = time.perf_counter() - st
            return res
        last_t = 0.0
        chunks = 0
        text_parts: list[str] = []
        last_tokens = 0
        usage = None
        for t, data in _events(resp):
            if data == b"[DONE]":
                break
            try:
                ev = json.loads(data)
            except ValueError:
                res.error = f"bad SSE data: {data[:200]!r}"
                break
            if not isinstance(ev, dict):
                continue
            if "error" in ev:
                res.error = f"stream error: {json.dumps(ev['error'])[:300]}"
                break
            if kind == "generate":
                meta = ev.get("meta_info") or {}
                if isinstance(meta.get("prompt_tokens"), int):
                    res.prompt_tokens = meta["prompt_tokens"]
                n = meta.get("completion_tokens")
                text = ev.get("text")
                if isinstance(text, str):  # cumulative (SGLang's default) or, if not, a delta
                    prev = res.generated_text
                    res.generated_text = text if text.startswith(prev) else prev + text
                if not isinstance(n, int) or n <= last_tokens:
                    continue
                if last_tokens == 0:
                    res.ttft = t - st
                else:
                    new = n - last_tokens
                    res.itl.extend([(t - last_t) / new] * new)
                last_t, last_tokens = t, n
                continue
            if isinstance(ev.get("usage"), dict):
                usage = ev["usage"]
            for choice in ev.get("choices") or ():
                piece = _delta_text(kind, choice)
                if not piece:
                    continue
                text_parts.append(piece)
                if chunks == 0:
                    res.ttft = t - st
                else:
                    res.itl.append(t - last_t)
                last_t = t
                chunks += 1
        res.latency = time.perf_counter() - st
        if res.error:
            return res
        if kind == "generate":
            res.output_tokens = last_tokens
        else:
            res.generated_text = "".join(text_parts)
            if usage and isinstance(usage.get("completion_tokens"), int):
                res.output_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    res.prompt_tokens = usage["prompt_tokens"]
            else:
                res.output_tokens, res.usage_missing = chunks, True
        if res.output_tokens <= 0:
            res.error = "the stream carried no output"
            return res
        res.success = True
        return res
    except (OSError, http.client.HTTPException, socket.timeout) as e:
        res.latency = time.perf_counter() - st
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        conn.close()
