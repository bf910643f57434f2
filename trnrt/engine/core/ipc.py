"""What travels between the HTTP process and the engine-core process (trnrt.engine.core.core_proc /
trnrt.engine.core.mp_client). Pure Python.

Messages are tuples sent with multiprocessing `Connection.send` (pickle). Requests, outputs, loads
and answers are the engine's own plain dataclasses; an exception is sent as its class and fields
(`pack_exception`) so that the caller re-raises the same type with the same attributes, e.g. an
`InvalidRequestError` keeps the `field` its 400 names.

HTTP process -> engine core:
  ("submit", call_id, [GenerateRequest])       answered by ("reply", call_id, ok, None | packed error)
  ("abort", request_id)                        no answer
  ("call", call_id, method, args, kwargs)      an EngineClient method, answered by "reply"
  ("finish_records",)                          start forwarding the stats collector's finish records
  ("exit",)                                    shut the engine down at once and exit

engine core -> HTTP process:
  ("ready", info dict) | ("failed", packed error)   once, at start
  ("out", [(request_id, RequestOutput)], EngineLoad | None)   one per engine-loop turn with outputs
  ("reply", call_id, ok, value | packed error)
  ("record", dict)                             a finished request's stats record
"""

from __future__ import annotations

import builtins
import importlib
import pickle

# Methods of the engine a "call" message may name (everything else is refused).
CALLABLE_METHODS = frozenset({
    "abort_requests", "flush_cache", "load", "server_info", "stats", "shutdown",
})


def pack_exception(e: BaseException) -> tuple:
    """(module, qualname, args, attributes, text) of `e`, with only what pickles."""
    cls = type(e)
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:
            continue
        attrs[k] = v
    try:
        pickle.dumps(e.args)
        args = e.args
    except Exception:
        args = (str(e),)
    return (cls.__module__, cls.__qualname__, args, attrs, f"{cls.__name__}: {e}")


def unpack_exception(packed: tuple) -> BaseException:
    """The exception `pack_exception` described, rebuilt as its own class when that class can be
    imported and built from its args; a RuntimeError carrying the text otherwise."""
    module, qualname, args, attrs, text = packed
    try:
        obj = builtins if module == "builtins" else importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise TypeError(qualname)
        e = obj.__new__(obj)
        BaseException.__init__(e, *args)
        e.__dict__.update(attrs)
        return e
    except Exception:
        return RuntimeError(text)
