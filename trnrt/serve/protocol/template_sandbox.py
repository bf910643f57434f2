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
import sys
import threading
import types
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
from jinja2.utils import Namespace

from trnrt.serve.protocol.template_budget import (_FRESH_REFS, Limits, TemplateLimitError, _Budget, _Buffer, _budget,
                                                  _check_percent, _concat_guard, _local, _loop_guard, _Steps,
                                                  _text_size)
from trnrt.serve.protocol.template_checks import _check_method, _guard_filter

__all__ = ["Limits", "TemplateLimitError", "render_client_template", "template_variables"]


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
