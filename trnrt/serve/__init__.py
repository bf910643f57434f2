"""`trnrt serve`: SGLang's and OpenAI's HTTP APIs over an EngineClient (Falcon on waitress).

Layout (docs/ARCHITECTURE.md "Serve layer"):
    app.py        the route table (`create_app`)
    handlers/     one module per route family: admit -> parse -> render -> submit -> drain -> close
    protocol/     request bodies -> dataclasses -> engine requests; validation happens here, once
    output/       the shared output assembler and each API's renderer
    http/         state, auth, body reading, SSE framing, error envelopes
    server.py     waitress with graceful shutdown
Depends on trnrt.engine's client/request/outputs contract only (never torch or trnrt.models).
The names below are imported lazily, so `import trnrt.serve` stays cheap.
"""

from __future__ import annotations

_EXPORTS = {
    "create_app": "trnrt.serve.app",
    "get_state": "trnrt.serve.http.state",
    "ServeSettings": "trnrt.serve.http.state",
    "ServeState": "trnrt.serve.http.state",
    "hf_tokenizer_factory": "trnrt.serve.http.state",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trnrt.serve' has no attribute {name!r}")
