"""The template sandbox's budget (the policy half of template_sandbox.py): the limits of one
render (`Limits`), the per-render `_Budget` found through a thread-local, and the checks that size
text, JSON, `%`/`format` results and iterations before they exist; `_Buffer`, the output buffer
that counts what a template emits. See template_sandbox.py's docstring for what is bounded and why.
"""

from __future__ import annotations

import re
import string
import sys
import threading
import time
import types
from dataclasses import dataclass

from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace


@dataclass(frozen=True)
class Limits:
    """What one render of a client template may use.

    max_template_chars: the template's source (compiling is one step: it must stay short).
    max_output_chars: the rendered text (the server passes the most text that can still fit the
        context: context length x the tokenizer's longest token, capped here).
    max_value_chars: one string or bytes value the template creates.
    max_items: one list, tuple, dict or set it creates, and what one filter iterates (jinja's own
        `range` limit).
    max_int_bits: one integer it creates.
    max_alloc_bytes: all values it creates during the render, and its buffered output, summed.
    timeout_s: wall time of the whole render, compiling included.
    """

    max_template_chars: int = 256 * 1024
    max_output_chars: int = 2 << 20
    max_value_chars: int = 2 << 20
    max_items: int = 100_000
    max_int_bits: int = 1 << 16
    max_alloc_bytes: int = 64 << 20
    timeout_s: float = 1.5


class TemplateLimitError(SecurityError):
    """The template passed one of its `Limits` (the message says which)."""


def _probe_refs() -> int:
    rv = object()
    refs = sys.getrefcount(rv)
    return refs


# `refs = sys.getrefcount(v)` for a value held by one local only (2 on CPython: the local and the
# argument). Every guard takes the count in exactly that form, so a value it just received with no
# more references than that was created by the operation it guards; one that anything else holds
# (a message, a tool, a constant) existed before and costs nothing new.
_FRESH_REFS = _probe_refs()

_local = threading.local()


class _Budget:
    """The limits of one render and what it has used so far."""

    __slots__ = ("limits", "deadline", "allocated", "output_chars")

    def __init__(self, limits: Limits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.allocated = 0
        self.output_chars = 0

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran past its time limit ({self.limits.timeout_s:g} s)")

    def charge(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.allocated > self.limits.max_alloc_bytes:
            raise TemplateLimitError(f"the template created more than {self.limits.max_alloc_bytes >> 20} MiB "
                                     "of values")

    def text(self, n: int, what: str) -> None:
        if n > self.limits.max_value_chars:
            raise TemplateLimitError(f"{what} would make a text of {n} characters (limit "
                                     f"{self.limits.max_value_chars})")

    def items(self, n: int, what: str) -> None:
        if n > self.limits.max_items:
            raise TemplateLimitError(f"{what} would make {n} items (limit {self.limits.max_items})")

    def int_bits(self, bits: int, what: str) -> None:
        if bits > self.limits.max_int_bits:
            raise TemplateLimitError(f"{what} would make an integer of {bits} bits (limit "
                                     f"{self.limits.max_int_bits})")

    def made(self, value, refs: int):
        """`value` came out of a guarded operation (`refs`: its reference count, taken by the caller
        while one local holds it): check its size, and charge it when it is new."""
        if refs > _FRESH_REFS:
            return value  # something else holds it too: it existed before (a message, a tool, ...)
        if isinstance(value, (str, bytes, bytearray)):
            self.text(len(value), "a value")
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            self.items(len(value), "a value")
        elif isinstance(value, int) and not isinstance(value, bool):
            self.int_bits(value.bit_length(), "a value")
        self.charge(sys.getsizeof(value))
        return value

    def emit(self, item, refs: int) -> None:
        """One piece of output (top level or a buffer)."""
        self.step()
        self.charge(sys.getsizeof(item) if refs <= _FRESH_REFS else 8)


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    if b is None:
        # Only while a guarded render runs (constant folding at compile time then leaves the call
        # for the render, where it is checked).
        raise TemplateLimitError("a guarded operation ran outside a render")
    return b


# --- sizes of text before it exists ----------------------------------------------------------------
_NS_ATTRS = "_Namespace__attrs"


def _text_size(b: _Budget, value, what: str) -> int:
    """About len(str(value)), from a walk that stops once it passes the value limit (a list holding
    one large string many times would print enormously while costing nothing to hold)."""
    if isinstance(value, str):
        return len(value)
    limit = b.limits.max_value_chars
    total, stack, seen = 0, [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() * 0.302 + 2
        elif isinstance(v, float):
            total += 24
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset, types.MappingProxyType)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, (type({}.keys()), type({}.values()), type({}.items()))):
            total += 16 + 4 * len(v)
            stack.extend(list(v))
        elif isinstance(v, Namespace):
            try:
                attrs = object.__getattribute__(v, _NS_ATTRS)
            except AttributeError:
                attrs = {}
            total += 14
            stack.append(attrs)
        else:
            total += 100  # repr of an object (a macro, an undefined, a loop): short
        if total > limit or seen > limit:
            b.text(int(total), what)
            raise TemplateLimitError(f"{what} is too large to convert to text")
    return int(total)


def _json_size(b: _Budget, value, indent) -> int:
    """About len(json.dumps(value, indent=indent)): the compact size plus, per element, one line of
    `depth * indent` characters."""
    if indent is None:
        width = 0
    elif isinstance(indent, str):
        width = len(indent)
    elif isinstance(indent, int) and not isinstance(indent, bool):
        width = max(indent, 0)
    else:
        width = 1
    if width > 64:
        raise TemplateLimitError(f"tojson indent {width} is too wide (limit 64)")
    limit = b.limits.max_value_chars
    total, stack, seen = 0, [(value, 0)], 0
    while stack:
        v, depth = stack.pop()
        seen += 1
        total += depth * width + 1 if width else 0
        if isinstance(v, str):
            total += len(v) * 2 + 2  # escapes can double a string (\n, \", \\); \uXXXX is rare
        elif isinstance(v, dict):
            total += 4
            for k, x in v.items():
                total += _text_size(b, k, "tojson") + 4
                stack.append((x, depth + 1))
        elif isinstance(v, (list, tuple)):
            total += 2
            stack.extend((x, depth + 1) for x in v)
        else:
            total += _text_size(b, v, "tojson")
        if total > limit or seen > limit:
            b.text(int(total), "tojson")
            raise TemplateLimitError("tojson would make too large a text")
    return int(total)


# %-formatting: one conversion spec (key, flags, width, precision, length, type).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsab%]")
_DIGITS = re.compile(r"\d+")


def _check_percent(b: _Budget, fmt, args, what: str) -> None:
    """`fmt % args`: no width or precision past the value limit, and the arguments' text fits."""
    fmt_s = fmt.decode("latin-1") if isinstance(fmt, (bytes, bytearray)) else str(fmt)
    star = False
    for m in _PERCENT_SPEC.finditer(fmt_s):
        for g in m.groups():
            if g == "*":
                star = True
            elif g is not None:
                b.text(int(g), what)
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    if star:
        for v in values:
            if isinstance(v, int):
                b.text(abs(v), what)
    b.text(len(fmt_s) + sum(_text_size(b, v, what) for v in values), what)


def _check_format_method(b: _Budget, fmt: str, args, kwargs, what: str) -> None:
    """`fmt.format(*args, **kwargs)`: widths and precisions in the specs, nested ones included."""
    nested = False
    try:
        for _, field, spec, _ in string.Formatter().parse(fmt):
            if spec:
                nested = nested or "{" in spec
                for d in _DIGITS.findall(spec):
                    b.text(int(d), what)
    except ValueError:
        return  # a malformed format string fails in format() itself
    values = list(args) + list(kwargs.values())
    if nested:
        for v in values:
            if isinstance(v, int):
                b.text(abs(v), what)
    b.text(len(fmt) + sum(_text_size(b, v, what) for v in values), what)


def _bounded(b: _Budget, value, what: str):
    """`value` as something a filter may iterate: strings and sized containers within max_items,
    other iterables counted (and stepped) as they are drawn."""
    if isinstance(value, (str, bytes, bytearray)) or hasattr(value, "__len__"):
        try:
            n = len(value)
        except TypeError:
            n = 0
        b.items(n, what)
        return value
    if hasattr(value, "__iter__"):
        return _Counted(value, b, what)
    return value


class _Counted:
    """An iterator that stops a filter drawing more than max_items items (a generator from `map`,
    `select`, `batch`, ...)."""

    __slots__ = ("_it", "_b", "_what", "_n")

    def __init__(self, iterable, b: _Budget, what: str):
        self._it, self._b, self._what, self._n = iter(iterable), b, what, 0

    def __iter__(self):
        return self

    def __next__(self):
        self._b.step()
        self._n += 1
        if self._n > self._b.limits.max_items:
            self._b.items(self._n, self._what)
        return next(self._it)


class _Steps:
    """What a `{% for %}` iterates: the loop's iterable, one step per item; `len()` passes through
    so `loop.length` and `loop.revindex` work as before."""

    __slots__ = ("_src", "_it", "_b")

    def __init__(self, iterable, b: _Budget):
        self._src, self._it, self._b = iterable, iter(iterable), b

    def __iter__(self):
        return self

    def __next__(self):
        self._b.step()
        return next(self._it)

    def __len__(self) -> int:
        return len(self._src)  # TypeError for generators, which LoopContext handles


def _loop_guard(iterable):
    b = _budget()
    b.step()
    return _Steps(iterable, b)


def _concat_guard(parts):
    """`a ~ b ~ ...` (jinja's str_join), with the result measured before it is built."""
    b = _budget()
    b.step()
    b.text(sum(_text_size(b, p, "~") for p in parts), "~")
    rv = "".join(map(str, parts))
    b.charge(sys.getsizeof(rv))
    return rv


class _Buffer(list):
    """The output buffer of a macro, `{% set %}` block, filter or call block: every piece counts."""

    __slots__ = ()

    def append(self, item) -> None:
        refs = sys.getrefcount(item)
        _budget().emit(item, refs)
        list.append(self, item)

    def extend(self, items) -> None:
        b = _budget()
        items = tuple(items)
        for item in items:
            refs = sys.getrefcount(item) - 1  # the tuple holds one reference
            b.emit(item, refs)
        list.extend(self, items)
