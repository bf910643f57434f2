"""Query strings and bodies of the admin and info routes (SGLang 0.5.23's), read into plain values.

Every wrong value is a 400 naming the parameter, in the OpenAI envelope the other routes use.
Unknown query parameters are ignored (SGLang's FastAPI routes ignore them too); unknown body fields
of /abort_request are ignored with a warning, as on every other route. Pure Python.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from trnrt.serve.http.errors import bad_request, safe

log = logging.getLogger("trnrt.serve")

# /v1/loads `include=` tokens (SGLang's LoadSnapshot.VALID_SECTIONS, plus trnrt's `cache`: the
# prefix_cache section).
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "cache", "all")
LOAD_FORMATS = ("json", "prometheus")


def query_value(params: dict, name: str) -> str | None:
    """One query parameter's value (None when absent); given more than once is a 400."""
    v = params.get(name)
    if isinstance(v, list):
        raise bad_request(f"{name} must be given at most once", name)
    return v


def parse_flush_timeout(params: dict) -> float:
    """`/flush_cache?timeout=T`: seconds (a finite number >= 0) to wait for the engine to become
    idle; 0 (the default) refuses at once when it is busy."""
    raw = query_value(params, "timeout")
    if raw is None or raw == "":
        return 0.0
    try:
        t = float(raw)
    except ValueError:
        raise bad_request(f"timeout must be a number of seconds >= 0, got {safe(raw)!r}", "timeout")
    if not math.isfinite(t) or t < 0:
        raise bad_request(f"timeout must be a finite number of seconds >= 0, got {safe(raw)!r}", "timeout")
    return t


@dataclass(frozen=True)
class LoadsQuery:
    """`/v1/loads` parameters. include: the sections asked for (None: all, SGLang's default);
    dp_rank: one rank only (None: all); fmt: "json" or "prometheus"."""

    include: frozenset | None
    dp_rank: int | None
    fmt: str


def parse_loads_query(params: dict) -> LoadsQuery:
    """`?include=core,memory,...` (repeatable; an unknown section is a 400 naming include),
    `?dp_rank=N` (an integer), `?format=json|prometheus`."""
    inc = params.get("include")
    parts: list[str] = []
    for chunk in (inc if isinstance(inc, list) else [inc] if inc else []):
        parts.extend(s.strip() for s in chunk.split(","))
    include = None
    if parts:
        unknown = [p for p in parts if p not in LOAD_SECTIONS]
        if unknown:
            raise bad_request(f"include has unknown sections {', '.join(safe(repr(u)) for u in unknown[:8])}; "
                              f"valid: {', '.join(LOAD_SECTIONS)}", "include")
        include = frozenset(parts)

    raw = query_value(params, "dp_rank")
    dp_rank = None
    if raw is not None:
        try:
            dp_rank = int(raw.strip())
        except ValueError:
            raise bad_request(f"dp_rank must be an integer, got {safe(raw)!r}", "dp_rank")

    fmt = query_value(params, "format") or "json"
    if fmt not in LOAD_FORMATS:
        raise bad_request(f"format must be one of {', '.join(LOAD_FORMATS)}, got {safe(fmt)!r}", "format")
    return LoadsQuery(include, dp_rank, fmt)


@dataclass(frozen=True)
class AbortRequest:
    """`/abort_request` body (SGLang's AbortReq): `rid`, a request id or a prefix of ids; or
    `abort_all`. An empty rid without abort_all aborts nothing."""

    rid: str = ""
    abort_all: bool = False


_ABORT_FIELDS = ("rid", "abort_all")


def parse_abort(body: dict) -> AbortRequest:
    """The /abort_request JSON object; a wrong type is a 400 naming the field."""
    rid = body.get("rid")
    if rid is None:
        rid = ""
    if not isinstance(rid, str):
        raise bad_request(f"rid must be a string (a request id or a prefix of ids), got {type(rid).__name__}", "rid")
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("rid is not valid Unicode (it holds a lone surrogate)", "rid")
    abort_all = body.get("abort_all")
    if abort_all is None:
        abort_all = False
    if not isinstance(abort_all, bool):
        raise bad_request(f"abort_all must be a boolean, got {abort_all!r}", "abort_all")
    unknown = [k for k in body if k not in _ABORT_FIELDS]
    if unknown:
        log.warning("/abort_request: ignoring unknown request fields: %s",
                    ", ".join(safe(repr(k)) for k in unknown[:16]))
    return AbortRequest(rid, abort_all)
