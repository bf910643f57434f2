"""GLM reasoning parser (`--reasoning-parser glm45`): splits `<think>…</think>` off the output.

Pure Python; works on detokenized text (the engine is asked for skip_special_tokens=False, so the
markers appear verbatim). The same incremental state machine serves streaming and non-streaming
requests, so the concatenated streamed deltas always equal the non-streamed fields.

Rules (GLM-4.5 .. GLM-5.x, as SGLang's and vLLM's glm45 parsers):
- When the prompt already ends with `<think>` ("forced" reasoning), everything before `</think>` is
  reasoning; otherwise reasoning starts only if the output itself begins with `<think>`.
- A `<tool_call>` inside reasoning ends the reasoning; the call then becomes ordinary output text
  (for the tool-call parser to find).
- With thinking disabled (enable_thinking false) the parser is not used at all: all text is content.
"""

from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    That suffix must be held back while streaming: the next delta may complete the marker.
    """
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Incremental `<think>` splitter. `feed(text)` -> (reasoning_delta, content_delta).

    Args:
        forced: the prompt ends with the think-start marker, so the output starts inside reasoning.
        think_start, think_end, tool_start: the marker strings, read from the tokenizer by the caller.
    """

    def __init__(self, forced: bool = True, think_start: str = "<think>", think_end: str = "</think>",
                 tool_start: str | None = "<tool_call>"):
        self.think_start = think_start
        self.think_end = think_end
        self.tool_start = tool_start
        # "start": undecided (may still open with <think>); "reasoning"; "content".
        self._state = "reasoning" if forced else "start"
        self._at_reasoning_start = True  # a redundant leading <think> is dropped
        self._strip_content_lead = False  # whitespace right after </think> is not content
        self._buf = ""
        self.saw_reasoning = forced

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("reasoning",)

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a delta; return (reasoning text, content text) that can be released now."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.think_start):
                    self._buf = stripped[len(self.think_start):]
                    self._state = "reasoning"
                    self.saw_reasoning = True
                    self._at_reasoning_start = False
                    continue
                if not stripped or self.think_start.startswith(stripped):
                    break  # could still become <think>: wait for more
                self._state = "content"
                continue
            if self._state == "reasoning":
                if self._at_reasoning_start:
                    if self.think_start.startswith(self._buf) and len(self._buf) < len(self.think_start):
                        break
                    if self._buf.startswith(self.think_start):
                        self._buf = self._buf[len(self.think_start):]
                    self._at_reasoning_start = False
                    continue
                markers = (self.think_end,) + ((self.tool_start,) if self.tool_start else ())
                hits = [(self._buf.find(m), m) for m in markers if m in self._buf]
                if hits:
                    idx, marker = min(hits)
                    reasoning.append(self._buf[:idx])
                    if marker == self.think_end:
                        self._buf = self._buf[idx + len(marker):]
                        self._strip_content_lead = True
                    else:  # <tool_call> ends reasoning and stays in the text
                        self._buf = self._buf[idx:]
                    self._state = "content"
                    continue
                keep = partial_suffix_len(self._buf, markers)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            # content
            if self._strip_content_lead:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._strip_content_lead = False
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of output: release anything held back (a partial marker is plain text after all)."""
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf, ""
        if self._state == "content" and self._strip_content_lead:
            buf = buf.lstrip()
        return "", buf

    @classmethod
    def split(cls, text: str, forced: bool = True, **markers) -> tuple[str | None, str]:
        """Non-streaming: (reasoning or None when there was none, content)."""
        p = cls(forced=forced, **markers)
        r1, c1 = p.feed(text)
        r2, c2 = p.flush()
        reasoning = r1 + r2
        return (reasoning if (p.saw_reasoning and reasoning) else None), c1 + c2
