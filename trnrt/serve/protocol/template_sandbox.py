"""A client's own chat template (`--trust-request-chat-template`), rendered with bounded time and memory.

HF's `apply_chat_template` renders with jinja2's `ImmutableSandboxedEnvironment`, which stops escapes
(no attribute that starts with `_`, no mutation of lists and dicts) but bounds neither time nor
memory: `{{ 'a' * 100000000 }}` in a 132-byte request once drove the server past 11.7 GB, and two
nested `range(100000)` loops run for hours. Jinja has no timeout and a Python thread cannot be
interrupted, so here every way a template can spend time or memory passes through a check that can
stop it (`_Budget`, one per render, found through a thread-local):

- **steps**: every `{% for %}` iterates through a guard (the parsed template is rewritten before it
  is compiled, `_GuardedCodeGenerator`), and every call (macros, `loop()`, methods, globals),
  attribute, subscript, filter and operator counts a step; each step checks the deadline.
- **operators**: `*`, `**`, `+` and `%` are intercepted (`intercepted_binops`, which also keeps them
  out of compile-time constant folding) and refused *before* they run when the result would pass a
  size limit, so `'a' * 100000000` fails in microseconds without allocating. `~` is rewritten into
  a guarded join.
- **growth**: filters and `str`/`bytes` methods that can grow text (`center`, `indent`, `format`,
  `replace`, `join`, `ljust`, `split`, ...) are estimated from their arguments before they run;
  anything converted to text (`{{ x }}`, `~`, `%`, `|string`, `|tojson`, ...) is measured first, so
  a list holding the same string 100000 times is not printed. Every value a filter, call, operator
  or subscript creates is measured after it runs and counted against the allocation budget.
- **output**: the rendered text and every buffer (macro bodies, `{% set %}` blocks, `caller()`)
  count toward the output limit and the allocation budget.

What it cannot stop: one C-level operation inside the limits (sorting 100000 items, one 2 MiB
`replace`) runs to its end before the next check; the size limits keep each such step far below
the time limit. A value is counted as created when nothing but the guard holds it (its reference
count, calibrated at import), so reading the same large message twice costs nothing.

The flag still means "I trust my clients" (vLLM's name for it): this bounds what a mistaken or
hostile template costs; it does not make arbitrary templates safe to run for everyone.
"""

from __future__ import annotations

import functools
import json
import re
import string
import sys
import threading
import time
import types
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["Limits", "TemplateLimitError", "render_client_template", "template_variables"]


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


# --- filters -----------------------------------------------------------------------------------
# Each check sees (budget, value, args, kwargs) before the filter runs and returns the value to pass
# on (the same one, or a bounded iterable); it raises TemplateLimitError to refuse.
def _arg(args, kwargs, i: int, name: str, default):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _width(b: _Budget, w, what: str) -> int:
    if isinstance(w, int) and not isinstance(w, bool):
        b.text(w, what)
        return max(w, 0)
    return 0


def _f_center(b, value, args, kwargs):
    b.text(max(_text_size(b, value, "center"), _width(b, _arg(args, kwargs, 0, "width", 80), "center")), "center")
    return value


def _f_indent(b, value, args, kwargs):
    w = _arg(args, kwargs, 0, "width", 4)
    prefix = len(w) if isinstance(w, str) else _width(b, w, "indent")
    s = value if isinstance(value, str) else None
    n = _text_size(b, value, "indent")
    lines = (s.count("\n") + 1) if s is not None else n // 2 + 1
    b.text(n + lines * prefix, "indent")
    return value


def _f_wordwrap(b, value, args, kwargs):
    width = _arg(args, kwargs, 0, "width", 79)
    wrap = _arg(args, kwargs, 2, "wrapstring", None)
    n = _text_size(b, value, "wordwrap")
    per = max(width, 1) if isinstance(width, int) and not isinstance(width, bool) else 1
    b.text(n + (n // per + 1) * (len(wrap) if isinstance(wrap, str) else 1), "wordwrap")
    return value


def _f_replace(b, value, args, kwargs):
    old, new = _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", "")
    count = _arg(args, kwargs, 2, "count", None)
    s = value if isinstance(value, str) else None
    n = _text_size(b, value, "replace")
    if isinstance(old, str) and isinstance(new, str):
        hits = (s.count(old) if old else len(s) + 1) if s is not None else n + 1
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            hits = min(hits, count)
        b.text(n + hits * max(len(new) - len(old), 0), "replace")
    return value


def _f_format(b, value, args, kwargs):
    if not isinstance(value, str):
        b.text(_text_size(b, value, "format"), "format")
        value = str(value)
    _check_percent(b, value, kwargs or tuple(args), "format")
    return value


def _f_join(b, value, args, kwargs):
    sep = _arg(args, kwargs, 0, "d", "")
    items = list(_bounded(b, value, "join"))  # materialised (bounded) to measure
    b.text(sum(_text_size(b, x, "join") for x in items) + len(str(sep)) * max(len(items) - 1, 0)
           if isinstance(sep, str) else 0, "join")
    return items


def _f_batch(b, value, args, kwargs):
    n = _arg(args, kwargs, 0, "linecount", 1)
    if isinstance(n, int):
        b.items(n, "batch")
    return _bounded(b, value, "batch")


def _f_slice(b, value, args, kwargs):
    n = _arg(args, kwargs, 0, "slices", 1)
    if isinstance(n, int):
        b.items(n, "slice")
    return _bounded(b, value, "slice")


def _f_sum(b, value, args, kwargs):
    start = _arg(args, kwargs, 1, "start", 0)
    if not isinstance(start, (int, float)):
        # Summing lists is quadratic in C, past any deadline check: numbers only.
        raise TemplateLimitError("sum adds numbers only in client templates")
    return _bounded(b, value, "sum")


def _f_tojson(b, value, args, kwargs):
    n = _json_size(b, value, _arg(args, kwargs, 1, "indent", None))
    if _arg(args, kwargs, 0, "ensure_ascii", False):
        b.text(n * 6, "tojson")  # \uXXXX for every non-ASCII character
    return value


def _f_pprint(b, value, args, kwargs):
    _json_size(b, value, 1)
    return value


def _growth(factor: int, what: str):
    """A text filter whose result is at most `factor` times its input."""
    def check(b, value, args, kwargs):
        b.text(_text_size(b, value, what) * factor, what)
        return value
    return check


def _iterating(what: str):
    def check(b, value, args, kwargs):
        return _bounded(b, value, what)
    return check


_FILTER_CHECKS = {
    "center": _f_center, "indent": _f_indent, "wordwrap": _f_wordwrap, "replace": _f_replace,
    "format": _f_format, "join": _f_join, "batch": _f_batch, "slice": _f_slice, "sum": _f_sum,
    "tojson": _f_tojson, "pprint": _f_pprint,
    # text in, text out: the most one character can become (escapes: &amp; is 5, &#34; 5; case
    # mapping: at most 3 characters; percent-encoding: 4 UTF-8 bytes of 3 characters each)
    "escape": _growth(6, "escape"), "e": _growth(6, "e"), "forceescape": _growth(6, "forceescape"),
    "urlencode": _growth(12, "urlencode"), "urlize": _growth(12, "urlize"), "xmlattr": _growth(6, "xmlattr"),
    "upper": _growth(3, "upper"), "lower": _growth(3, "lower"), "title": _growth(3, "title"),
    "capitalize": _growth(3, "capitalize"), "string": _growth(1, "string"), "trim": _growth(1, "trim"),
    "striptags": _growth(1, "striptags"), "truncate": _growth(1, "truncate"), "wordcount": _growth(1, "wordcount"),
}
# Filters that keep what they iterate (a list, a sorted copy, groups): bounded in items. The lazy
# ones (map, select, ...) keep nothing; whatever consumes them is bounded.
for _name in ("list", "unique", "sort", "dictsort", "groupby", "reverse", "items"):
    _FILTER_CHECKS.setdefault(_name, _iterating(_name))


def _guard_filter(name: str, func):
    check = _FILTER_CHECKS.get(name)
    # pass_context / pass_environment / pass_eval_context filters get that object first.
    offset = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)  # keeps jinja_pass_arg, so jinja calls the wrapper as it called func
    def guarded(*args, **kwargs):
        b = _budget()
        b.step()
        if check is not None and len(args) > offset:
            value = check(b, args[offset], args[offset + 1:], kwargs)
            args = args[:offset] + (value,) + args[offset + 1:]
        rv = func(*args, **kwargs)
        refs = sys.getrefcount(rv)  # a statement of its own: as an argument, rv would be counted twice
        return b.made(rv, refs)

    return guarded


# --- str and bytes methods -----------------------------------------------------------------------
def _check_method(b: _Budget, target, args, kwargs):
    """Estimate a str/bytes method's result from its arguments; returns the args to call with."""
    s, name = target.__self__, target.__name__
    if name in ("ljust", "rjust", "center", "zfill"):
        _width(b, _arg(args, kwargs, 0, "width", 0), name)
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        if isinstance(tab, int):
            b.text(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tab, 0), name)
    elif name == "replace":
        old, new = _arg(args, kwargs, 0, "old", None), _arg(args, kwargs, 1, "new", None)
        count = _arg(args, kwargs, 2, "count", -1)
        if isinstance(old, type(s)) and isinstance(new, type(s)):
            hits = s.count(old) if old else len(s) + 1
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            b.text(len(s) + hits * max(len(new) - len(old), 0), name)
    elif name == "join" and args:
        items = list(_bounded(b, args[0], "join"))
        b.text(sum(len(x) if isinstance(x, (str, bytes)) else 0 for x in items) + len(s) * max(len(items) - 1, 0),
               name)
        args = (items,) + tuple(args[1:])
    elif name in ("split", "rsplit", "splitlines"):
        if name == "splitlines":
            pieces = s.count("\n" if isinstance(s, str) else b"\n") + s.count("\r" if isinstance(s, str) else b"\r")
        else:
            sep = _arg(args, kwargs, 0, "sep", None)
            limit = _arg(args, kwargs, 1, "maxsplit", -1)
            if isinstance(sep, type(s)) and sep:
                pieces = s.count(sep)
            else:
                ws = (" ", "\n", "\t", "\r") if isinstance(s, str) else (b" ", b"\n", b"\t", b"\r")
                pieces = sum(s.count(c) for c in ws)
            if isinstance(limit, int) and limit >= 0:
                pieces = min(pieces, limit)
        b.items(pieces + 1, name)
    elif name in ("format", "format_map") and isinstance(s, str):
        if name == "format_map":
            mapping = args[0] if args else {}
            _check_format_method(b, s, (), mapping if isinstance(mapping, dict) else {}, name)
        else:
            _check_format_method(b, s, args, kwargs, name)
    return args


# --- globals (HF's, from transformers' chat template environment) -------------------------------
def _raise_exception(message):
    b = _budget()
    text = message if isinstance(message, str) else "(a non-text message)"
    b.text(len(text), "raise_exception")
    raise TemplateError(text[:1000])


def _strftime_now(fmt):
    b = _budget()
    if not isinstance(fmt, str):
        raise TemplateError("strftime_now takes a format string")
    b.text(len(fmt) * 16, "strftime_now")  # %c is 2 characters for about 24
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: no HTML escaping, and its options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """HF's `dict` global: calling it, and `fromkeys`, but no class to climb from."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """HF's `namespace`: no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's signature trick, so namespace(self=...) works)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                                f"got {name!r}")


class _Generation(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (it marks assistant tokens for training masks);
    for a prompt it only renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_LOOP_FILTER, _CONCAT_FILTER = "trnrt:loop", "trnrt:concat"  # not names a template can spell


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every loop's iterable and every `~` routed through a guard and
    every output buffer counted."""

    def visit_Template(self, node, frame=None):
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
        for cat in node.find_all(nodes.Concat):
            cat.nodes = [nodes.Filter(nodes.List(list(cat.nodes), lineno=cat.lineno), _CONCAT_FILTER, [], [],
                                      None, None, lineno=cat.lineno)]
        super().visit_Template(node, frame)

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.trnrt_buffer()")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """HF's chat-template environment (trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`,
    raise_exception, strftime_now, its tojson, dict and namespace) with the guards described above."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols],
                         finalize=self._finalize)
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_TemplateNamespace)
        self.globals.pop("lipsum", None)  # lipsum(n=10**6) makes text no check sees coming
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP_FILTER] = _loop_guard
        self.filters[_CONCAT_FILTER] = _concat_guard

    @staticmethod
    def trnrt_buffer() -> _Buffer:
        return _Buffer()

    @staticmethod
    def _finalize(value):
        # Every `{{ value }}` is converted to text after this: measure what the text would be.
        if not isinstance(value, str):
            b = _budget()
            b.text(_text_size(b, value, "an output value"), "an output value")
        return value

    def call_binop(self, context, operator, left, right):
        b = _budget()
        b.step()
        seq = (str, bytes, list, tuple)
        if operator == "*":
            if isinstance(left, seq) and isinstance(right, int):
                self._sized(b, left, len(left) * max(right, 0), "*")
            elif isinstance(right, seq) and isinstance(left, int):
                self._sized(b, right, len(right) * max(left, 0), "*")
            elif isinstance(left, int) and isinstance(right, int):
                b.int_bits(left.bit_length() + right.bit_length(), "*")
        elif operator == "+":
            if isinstance(left, seq) and isinstance(right, seq):
                self._sized(b, left, len(left) + len(right), "+")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                b.int_bits(left.bit_length() * right, "**")
        elif operator == "%" and isinstance(left, (str, bytes)):
            _check_percent(b, left, right, "%")
        rv = self.binop_table[operator](left, right)
        b.made(rv, _FRESH_REFS)  # an operator's result is always new
        return rv

    @staticmethod
    def _sized(b: _Budget, like, n: int, what: str) -> None:
        if isinstance(like, (str, bytes)):
            b.text(n, what)
        else:
            b.items(n, what)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        b = _budget()
        b.step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (_Steps(args[0], b),) + args[1:]
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if isinstance(target, types.BuiltinMethodType) and isinstance(getattr(target, "__self__", None), (str, bytes)):
            args = _check_method(b, target, args, kwargs)
        rv = SandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        refs = sys.getrefcount(rv)
        return b.made(rv, refs)

    def getattr(self, obj, attribute):
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        b = _budget()
        b.step()
        rv = super().getitem(obj, argument)
        if isinstance(argument, slice):  # a slice is a new value
            refs = sys.getrefcount(rv)
            return b.made(rv, refs)
        return rv


_ENV_LOCK = threading.Lock()
_ENV: GuardedEnvironment | None = None


def _environment() -> GuardedEnvironment:
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = GuardedEnvironment()
        return _ENV


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    # Clients send the same template with every request: compile it once. Compiled templates are
    # safe to render from several threads; each render has its own budget.
    return _environment().from_string(source)


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """HF's `_alias_reasoning_fields`: a message's reasoning also as `thinking` (gpt-oss templates
    read that name) and as `reasoning_content`."""
    out = []
    for m in messages:
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else m)
    return out


def template_variables(tokenizer, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict) -> dict:
    """The variables HF's `apply_chat_template` renders with: the tokenizer's special tokens
    (bos_token, eos_token, ...), overridden by the template kwargs, then messages, tools, documents
    and add_generation_prompt."""
    special = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
    return {**special, **kwargs, "messages": _alias_reasoning(messages), "tools": tools, "documents": None,
            "add_generation_prompt": add_generation_prompt}


def render_client_template(source: str, variables: dict, limits: Limits = Limits()) -> str:
    """Render `source` with `variables` within `limits`.

    Raises TemplateLimitError when a limit is passed, and jinja2's TemplateError (syntax errors,
    raise_exception), SecurityError or an ordinary Python error (TypeError, ...) for everything
    else a template can get wrong; the caller answers 400 either way.
    """
    if len(source) > limits.max_template_chars:
        raise TemplateLimitError(f"the template is {len(source)} characters long (limit {limits.max_template_chars})")
    b = _Budget(limits)
    prev = getattr(_local, "budget", None)
    _local.budget = b
    try:
        template = _compiled(source)
        b.step()
        out: list[str] = []
        for chunk in template.generate(**variables):
            refs = sys.getrefcount(chunk)
            b.emit(chunk, refs)
            b.output_chars += len(chunk)
            if b.output_chars > limits.max_output_chars:
                raise TemplateLimitError(f"the rendered prompt passed {limits.max_output_chars} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        _local.budget = prev
