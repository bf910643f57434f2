"""IncrementalDetokenizer: token ids -> text deltas, with stop strings. Pure Python.

The tokenizer is any object with `decode(ids, skip_special_tokens=...)` (a `tokenizers.Tokenizer`
or a transformers fast tokenizer); it is passed in, never imported here.

Text is decoded over a short window of ids (vLLM's prefix/read offsets): `prefix_offset..read_offset`
is text already emitted, kept as left context so that decoders which depend on neighbours (leading
spaces, byte fallback) give the same text as a full decode; `read_offset..` is new. Two things hold
text back:
- a window whose text ends in U+FFFD: a multi-byte UTF-8 character is split across tokens and its
  remaining bytes are still to come;
- the longest tail of the text that is a prefix of some stop string: it might become a stop string
  with the next token, and a stop string is trimmed from the output (never streamed, then retracted);
- with stop regexes (SGLang's `stop_regex`, RE2 objects from trnrt.engine.output.stop), the last
  `min(L - 1, REGEX_HOLD_CHARS)` characters, L being the longest match the pattern can make
  (unbounded: REGEX_HOLD_CHARS, 64).

Stop regexes. After each token, every pattern is searched in the text not yet emitted (the search
starts at the first unemitted character; the character before it is passed as context, so `\b`
and `^` mean what they mean in the whole text) up to the end of the text so far, so `$` matches
the end of the text so far, as in SGLang, which searches the decoded tail each step. The leftmost
match of any stop string or pattern ends the request; the text is cut at the match's start (kept
up to its end with include_stop_str_in_output) and `matched_stop` is the pattern string.
Emitted text is final: a match never starts before the first unemitted character, so a streamed
client never receives text that a later match removes, and streamed and non-streamed requests
get the same text (the same code runs for both).

`min_tokens` (vLLM's min_tokens / SGLang's min_new_tokens): the text of the first min_tokens
tokens is protected. No stop string or regex match may start inside it (a match must start at
or after the end of that text), it is never held back as a possible stop prefix, and it is
released as soon as it is decoded. A stop string straddling the boundary does not stop. A pattern whose matches are at most
REGEX_HOLD_CHARS + 1 characters long is always found where it starts; a longer match is found
only from where the held-back text begins (`a+b` after 100 `a`s stops, keeping the `a`s already
emitted). The text searched per token is therefore bounded (held-back tail + the token's text),
and RE2 searches in linear time: no pattern can make a step slow (`regex_chars_searched` counts
it, for the tests).
"""

from __future__ import annotations

from typing import Any, Iterable

from trnrt.engine.output.stop import REGEX_HOLD_CHARS

# Prompt tokens kept as left context for the first output token (vLLM uses 5 too).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output incrementally and finds its stop strings.

    Args:
        tokenizer: object with `decode(ids, skip_special_tokens=bool) -> str`.
        prompt_token_ids: the prompt; only its last few ids are used, as context.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
        stop: stop strings; the first one (leftmost in the text) to appear ends the request.
        stop_regex: compiled stop patterns (trnrt.engine.output.stop.StopRegex: `.pattern`, `.regex`
            with RE2's `search(text, pos)`, `.max_len`); see the module docstring.
        include_stop_str_in_output: keep the matched stop string / regex match in the text, and
            the text of a matched stop token (vLLM's include_stop_str_in_output; SGLang's
            no_stop_trim).
        deferred: decode nothing until flush(), which returns the whole text in one decode of the
            window (for a request whose text nobody reads before the end: not streamed, no stop
            strings). Two decodes per token in the engine thread (~8 us a row of a batch-8 step)
            become one per request. Not with stop strings or regexes, which need the text as it grows.
        min_tokens: the text of the first this many tokens cannot hold a stop (module docstring).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Iterable[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        stop_regex: Iterable[Any] = (),
        include_stop_str_in_output: bool = False,
        deferred: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.stop_regex = list(stop_regex)
        if deferred and (self.stop or self.stop_regex):
            raise ValueError("a deferred detokenizer cannot watch for stop strings")
        self.deferred = deferred
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # characters held back for the regexes: a future match starting earlier would be longer
        # than the pattern's longest match (capped: bounded hold-back, bounded search)
        self._regex_hold = max((min(r.max_len - 1 if r.max_len is not None else REGEX_HOLD_CHARS,
                                    REGEX_HOLD_CHARS) for r in self.stop_regex), default=0)
        self.regex_chars_searched = 0  # characters handed to the regex searches (bounded per token)
        context = list(prompt_token_ids)[-INITIAL_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Text decoded so far (stable characters only) and how much of it was handed out.
        self._text = ""
        self._num_emitted = 0
        self.matched_stop: str | None = None
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens appended
        self._protected = 0  # characters of the first min_tokens tokens' text (no stop starts there)

    @property
    def is_stopped(self) -> bool:
        """A stop string was found; further tokens are ignored."""
        return self.matched_stop is not None

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return self._text[: self._num_emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Iterable[int], *, exclude_last: bool = False) -> str:
        """Add sampled tokens; return the text that became safe to emit.

        Args:
            new_token_ids: tokens sampled since the previous call.
            exclude_last: the last token is a matched stop token (EOS / stop_token_ids); its text
                is not part of the output (unless include_stop_str_in_output).
        Returns:
            The new text (possibly ""). If a stop string appeared, `matched_stop` is set and the
            text ends just before it (or after it, with include_stop_str_in_output).
        """
        if self.is_stopped:
            return ""
        new_token_ids = list(new_token_ids)
        if exclude_last and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids.pop()
        if self.deferred:
            self._ids.extend(new_token_ids)  # flush() decodes the window once
            return ""
        for t in new_token_ids:
            self._append_token(t)
            self._num_tokens += 1
            if self._num_tokens <= self.min_tokens:
                self._protected = len(self._text)
                continue  # no stop can start in the protected text
            if self._check_stop():
                break
        return self._release()

    def flush(self) -> str:
        """The request finished: return every remaining held-back character.

        Text held as a possible stop-string prefix is real output once no more tokens come; an
        incomplete UTF-8 tail is emitted as the tokenizer decodes it (with U+FFFD).
        """
        if not self.is_stopped and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._check_stop()
        return self._emit_upto(len(self._text))

    # -- internals ---------------------------------------------------------------------------

    def _append_token(self, token_id: int) -> None:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        # NOTE: the window's text must grow and must not end mid-character; otherwise wait for
        # more tokens (the offsets stay, so the next decode covers the held-back ids too).
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _check_stop(self) -> bool:
        """Find the leftmost stop string or regex match in the not-yet-emitted text; trim the text there."""
        if not self.stop and not self.stop_regex:
            return False
        # NOTE: a match starts in the unemitted text: before this step the text from its start
        # was a proper prefix of the stop string, and such a tail is always held back.
        start = max(self._num_emitted, self._protected)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, start)
            if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) > best[1] - best[0])):
                best = (i, i + len(s), s)
        if self.stop_regex:
            # the window: one character of context before the first unemitted one, then the rest
            base = max(0, start - 1)
            window = self._text[base:]
            self.regex_chars_searched += len(window) * len(self.stop_regex)
            for r in self.stop_regex:
                m = r.regex.search(window, start - base)
                if m is not None:
                    i, j = base + m.start(), base + m.end()
                    if best is None or i < best[0] or (i == best[0] and j > best[1]):
                        best = (i, j, r.pattern)
        if best is None:
            return False
        i, j, s = best
        self.matched_stop = s
        self._text = self._text[:j] if self.include_stop_str_in_output else self._text[:i]
        return True

    def _release(self) -> str:
        if self.is_stopped:
            return self._emit_upto(len(self._text))
        # the regex hold-back may exceed the text: never a negative end (a slice from the back)
        # protected text is final: never held back
        end = max(self._protected, len(self._text) - max(self._stop_prefix_len(), self._regex_hold))
        return self._emit_upto(max(self._num_emitted, min(end, len(self._text))))

    def _stop_prefix_len(self) -> int:
        """Length of the longest unemitted tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self._max_stop_len - 1, len(text) - max(self._num_emitted, self._protected)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit_upto(self, end: int) -> str:
        out = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return out
