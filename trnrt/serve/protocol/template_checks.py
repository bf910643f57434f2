"""The template sandbox's checks on filters and `str`/`bytes` methods: each estimates the size of
its result from its arguments before it runs and refuses (TemplateLimitError) past the budget.
Used by the guarded environment in template_sandbox.py.
"""

from __future__ import annotations

import functools
import string
import sys

from trnrt.serve.protocol.template_budget import (TemplateLimitError, _bounded, _Budget, _budget, _check_format_method,
                                                  _check_percent, _json_size, _text_size)


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
