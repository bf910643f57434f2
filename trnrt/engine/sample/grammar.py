"""Structured outputs with xgrammar 0.2.8: grammar compiles (caller's thread) and per-request matchers (engine thread).

- `GrammarCompilerService` (one per engine, shared by threads): the xgrammar TokenizerInfo, built
  once from the engine's tokenizer with every EOS id of the generation config as a stop token,
  and a GrammarCompiler whose cache is bounded in bytes. `Engine.submit` compiles a request's
  GrammarSpec on the *caller's* thread (an HTTP worker, or the `LLM` caller), so a slow schema
  (seconds at a 155k vocabulary) never stalls the engine thread; a bad grammar is an
  InvalidRequestError naming the client's field, with xgrammar's message minus its C++ prefix.
- `GrammarState` (one per request, used by the engine thread only): the GrammarMatcher, the
  request's next-token mask ([1, ceil(V/32)] int32, xgrammar's packed layout), and the
  `</think>` gate (a request that reasons is free until it emits `</think>`).

GLM's added tokens are ordinary tokens to xgrammar (they would be allowed inside JSON strings);
the compiler's vocabulary blanks every special added token except the stop ids, so a constrained
output never holds `<|user|>`, `<tool_call>`, `</think>`, ... (reference: structured_outputs.md §1).
Tool-call grammars (kind "tool_call": tool_choice "required" / a named tool,
trnrt.engine.sample.tool_call_grammar) compile against a second vocabulary that keeps the tool-call and
think tags as ordinary tokens, so the grammar can demand those special ids (`TokenFormat`); its
free regions exclude the tags' texts instead.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

from trnrt.engine.sample.grammar_spec import GrammarSpec
from trnrt.engine.request import InvalidRequestError
from trnrt.engine.sample.tool_call_grammar import GRAMMAR_TOKENS

log = logging.getLogger(__name__)

XGRAMMAR_MISSING = ("structured outputs need xgrammar, which is not installed: pip install 'trnrt[grammar]' "
                    "(xgrammar==0.2.8)")
# JSON whitespace between tokens is allowed but bounded (per gap), so a model cannot loop in it.
MAX_JSON_WHITESPACE = 16
DEFAULT_CACHE_MB = 256


class GrammarUnavailableError(RuntimeError):
    """xgrammar is not installed (the engine was asked for structured outputs)."""


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarUnavailableError(XGRAMMAR_MISSING) from e
    return xgrammar


_CPP_PREFIX = re.compile(r"^\[\d{1,2}:\d{2}:\d{2}\]\s+\S+?:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed:\s*\(.*?\) is false:\s*", re.S)


def clean_error(e: BaseException) -> str:
    """xgrammar's message without its `[HH:MM:SS] /project/cpp/<file>.cc:<line>: ` prefix and a
    `Check failed: (...) is false:` head; first line only, bounded."""
    msg = str(e).strip()
    msg = _CPP_PREFIX.sub("", msg)
    msg = _CHECK_FAILED.sub("", msg)
    msg = msg.splitlines()[0].strip() if msg else type(e).__name__
    return msg[:500]


class GrammarCompilerService:
    """Compiles GrammarSpecs for one tokenizer (thread-safe; one per engine).

    tokenizer: the engine's HF tokenizer. vocab_size: the model's (the mask width follows it;
    ids past the tokenizer's are never allowed). stop_token_ids: every EOS id (generation config).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, cache_mb: int = DEFAULT_CACHE_MB,
                 max_threads: int = 2):
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.tokenizer_info = self._tokenizer_info(tokenizer)
        tool_mb = max(1, int(cache_mb) // 4)  # the tool-call grammars' share (below)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=max(1, int(cache_mb) - tool_mb) << 20)
        # tool_choice grammars: the tags they name stay ordinary tokens. xgrammar's own cache is
        # off for them: 0.2.8 shares a cached `any_text` sub-rule between grammars whose texts end
        # on different tokens (after a tool grammar's `<arg_value>` text, another grammar's
        # reasoning then ends on `</arg_value>` instead of `</think>`); whole grammars are cached
        # here instead, by their exact text (a quarter of the cache budget).
        self.tool_tokenizer_info = self._tokenizer_info(tokenizer, keep=GRAMMAR_TOKENS)
        self.tool_compiler = xgr.GrammarCompiler(self.tool_tokenizer_info, max_threads=max_threads,
                                                 cache_enabled=False)
        self._tool_cache: OrderedDict[str, tuple] = OrderedDict()  # text -> (CompiledGrammar, bytes)
        self._tool_cache_bytes = 0
        self._tool_cache_limit = tool_mb << 20
        self._lock = threading.Lock()
        self.num_compiles = 0

    def _tokenizer_info(self, tokenizer, keep=()):
        """from_huggingface's vocabulary, with GLM's special added tokens (all but the stop ids
        and the texts in `keep`) blanked so that no grammar allows them."""
        xgr = self.xgr
        base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        special = set()
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(tok, "special", False) and int(tid) not in self.stop_token_ids and tok.content not in keep:
                special.add(int(tid))
        if not special:
            return base
        vocab = tokenizer.get_vocab()
        encoded = [""] * self.vocab_size
        for tok, tid in vocab.items():
            if 0 <= tid < self.vocab_size and tid not in special:
                encoded[tid] = tok
        return xgr.TokenizerInfo(encoded, vocab_type=base.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=base.add_prefix_space)

    def compile(self, spec: GrammarSpec):
        """The CompiledGrammar of `spec` (xgrammar caches by the exact text). Raises
        InvalidRequestError(field=spec.param) with xgrammar's cleaned message."""
        c = self.compiler
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
                kw = dict(any_whitespace=spec.any_whitespace, strict_mode=True)
                if spec.any_whitespace:
                    kw["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
                else:
                    kw["separators"] = (",", ":")
                out = c.compile_json_schema(schema, **kw)
            elif spec.kind == "regex":
                out = c.compile_regex(spec.value)
            elif spec.kind == "ebnf":
                out = c.compile_grammar(spec.value)
            elif spec.kind == "choice":
                out = c.compile_grammar(choice_grammar(json.loads(spec.value)))
            elif spec.kind == "tool_call":
                out = self._compile_tool_call(spec.value)
            else:  # structural_tag
                out = c.compile_structural_tag(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{spec.param}: {clean_error(e)}", field=spec.param) from None
        except Exception as e:  # xgrammar's own error types (e.g. InvalidStructuralTagError)
            raise InvalidRequestError(f"{spec.param}: {clean_error(e)}", field=spec.param) from None
        with self._lock:
            self.num_compiles += 1
        return out

    def _compile_tool_call(self, text: str):
        """A tool-call structural tag, through the exact-text LRU cache (see __init__)."""
        with self._lock:
            hit = self._tool_cache.get(text)
            if hit is not None:
                self._tool_cache.move_to_end(text)
                return hit[0]
        out = self.tool_compiler.compile_structural_tag(text)
        size = int(getattr(out, "memory_size_bytes", 0) or 0) + len(text)
        with self._lock:
            if text not in self._tool_cache and size <= self._tool_cache_limit:
                self._tool_cache[text] = (out, size)
                self._tool_cache_bytes += size
                while self._tool_cache_bytes > self._tool_cache_limit:
                    _, (_, old_size) = self._tool_cache.popitem(last=False)
                    self._tool_cache_bytes -= old_size
        return out

    def new_state(self, spec: GrammarSpec) -> "GrammarState":
        """A fresh matcher for one request (compile included). When the grammar applies from the
        first token, its first mask is filled here: a grammar that allows no token at all is
        refused now, as a 400, rather than ended by the engine."""
        state = GrammarState(self.xgr, self.xgr.GrammarMatcher(self.compile(spec)), self.vocab_size,
                             after_token=spec.after_token)
        if state.active:
            state.next_mask()
            if state.dead:
                raise InvalidRequestError(f"{spec.param}: the grammar allows no output", field=spec.param)
        return state


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string literals are EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher and next-token mask (engine thread only, after submit).

    The mask is filled once per position (`next_mask`), right after the previous token was
    accepted, and reused by a step that runs the request again at that position (a preempted
    request re-prefills and samples the same position: the matcher keeps its state through
    preemption, since it lives with the request, not with the slot).
    """

    def __init__(self, xgr, matcher, vocab_size: int, after_token: int | None = None):
        self.matcher = matcher
        self.after_token = after_token
        self.active = after_token is None
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32, all bits set
        self.fresh = False  # mask holds the current position's allowed tokens
        self.dead = False  # no token can continue (all-zero mask) or the grammar ended
        self.num_accepted = 0

    def next_mask(self):
        """The packed mask row [ceil(V/32)] int32 of the next token, or None while the grammar does
        not apply yet (before `</think>`). Sets `dead` when no token is allowed."""
        if not self.active:
            return None
        if not self.fresh:
            if self.matcher.is_terminated():
                self.dead = True
            else:
                self.matcher.fill_next_token_bitmask(self.mask, 0)
                self.dead = not bool(self.mask.any())
            self.fresh = True
        return self.mask[0]

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False when the grammar rejects it (it was sampled without
        the mask): the request must end. Before `</think>`, only watches for it."""
        self.fresh = False
        if not self.active:
            if token_id == self.after_token:
                self.active = True
            return True
        ok = bool(self.matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok
