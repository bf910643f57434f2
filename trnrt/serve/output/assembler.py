"""The shared output assembler: what every API renders from the engine's `RequestOutput`s.

- `ChatOutput`: raw output text (markers kept) -> reasoning / content / tool-call deltas;
- `TokenCounter`: prompt, completion, cached and reasoning token counts of one request;
- `finish_of`: the finish reason and matched stop of a finished output, and whether it is an
  error the API must report as one (engine error, system abort) rather than a finish;
- `usage`: the OpenAI/SGLang `usage` object.
Each API's renderer (output/openai.py, output/sglang.py) shapes these into its own JSON or SSE.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from trnrt.engine.output.outputs import RequestOutput
from trnrt.serve.http.errors import APIError, system_abort
from trnrt.serve.output.reasoning import ReasoningParser
from trnrt.serve.output.tool_calls import ToolCallParser


class ChatOutput:
    """Turns raw output text (markers kept) into reasoning / content / tool-call deltas.

    One object per request; the same feed()/finish() path serves streamed and non-streamed
    responses, so both agree.
    """

    def __init__(self, ti, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 strip_special: bool, stream_reasoning: bool = True):
        self.ti = ti
        self.reasoning = reasoning
        self.tools = tools
        self.strip_special = strip_special
        self.stream_reasoning = stream_reasoning
        self._held_reasoning = ""
        self.raw_content = ""  # post-reasoning text before tool parsing (the fallback content)

    def clean(self, text: str) -> str:
        return self.ti.strip_special(text) if self.strip_special else text

    def _delta(self, r: str, c: str, tool_deltas: list[dict], final: bool) -> dict:
        d: dict = {}
        if self.reasoning is not None and not self.stream_reasoning:
            self._held_reasoning += r
            r = ""
            if final or not self.reasoning.in_reasoning:
                r, self._held_reasoning = self._held_reasoning, ""
        r, c = self.clean(r), self.clean(c)
        if r:
            d["reasoning_content"] = r
        if c:
            d["content"] = c
        if tool_deltas:
            d["tool_calls"] = tool_deltas
        return d

    def feed(self, text: str) -> dict:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        self.raw_content += c
        tds: list[dict] = []
        if self.tools is not None:
            ev = self.tools.feed(c)
            c, tds = ev.content, ev.tool_deltas
        return self._delta(r, c, tds, final=False)

    def finish(self) -> dict:
        r, c = self.reasoning.flush() if self.reasoning else ("", "")
        self.raw_content += c
        tds: list[dict] = []
        if self.tools is not None:
            ev1 = self.tools.feed(c)
            ev2 = self.tools.finish()
            c = ev1.content + ev2.content
            tds = ev1.tool_deltas + ev2.tool_deltas
        return self._delta(r, c, tds, final=True)


class TokenCounter:
    """Token counts of one request from its outputs; reasoning tokens by token id (everything
    before `</think>` or a `<tool_call>`), when `count_reasoning`."""

    def __init__(self, n_prompt: int, ti=None, count_reasoning: bool = False, forced: bool = False):
        self.n_prompt = n_prompt
        self.num_output = 0
        self.num_cached = 0  # prompt tokens served from the prefix cache (both tiers)
        self.num_cached_host = 0  # of those, tokens brought back from the host tier
        self.count_reasoning = count_reasoning
        self.in_reasoning = count_reasoning and forced
        self.reasoning_tokens = 0
        markers = ti.marker_ids if ti is not None else {}
        self._end_ids = {markers.get("</think>"), markers.get("<tool_call>")} - {None}
        self._start_id = markers.get("<think>")
        self._seen_any = False

    def add(self, o: RequestOutput) -> None:
        if o.num_output_tokens:
            self.num_output = o.num_output_tokens
        else:
            self.num_output += len(o.new_token_ids)
        if o.num_prompt_tokens:
            self.n_prompt = o.num_prompt_tokens
        self.num_cached = o.num_cached_tokens or self.num_cached
        self.num_cached_host = getattr(o, "num_cached_tokens_host", 0) or self.num_cached_host
        if not self.count_reasoning:
            return
        for t in o.new_token_ids:
            if not self._seen_any and t == self._start_id:
                self.in_reasoning = True  # the output opened its own <think>
            self._seen_any = True
            if self.in_reasoning:
                if t in self._end_ids:
                    self.in_reasoning = False
                else:
                    self.reasoning_tokens += 1

    @property
    def reasoning(self) -> int | None:
        return self.reasoning_tokens if self.count_reasoning else 0


@dataclass(frozen=True)
class Finish:
    """How a request ended, API-neutral. `reason`: "stop" | "length" | "abort"."""

    reason: str
    matched: object = None
    message: str | None = None
    length: int | None = None


def finish_of(o: RequestOutput) -> Finish:
    """The finish of a finished output, or raise the APIError it stands for.

    An engine error is a 500 and a system abort (one with a status code: the server shutting
    down, a full queue) that status, in SGLang's `{"object": "error", ...}` envelope with the
    engine's message (`system_error`); a client or admin abort (`/abort_request`) is a normal
    finish with reason "abort" and the output so far, as SGLang answers it.
    """
    fr = o.finish_reason
    if fr is None:
        return Finish("stop")
    if fr.type == "abort":
        if o.error:
            raise APIError(500, f"The request failed in the engine: {o.error}", type_="internal_error")
        err = system_error(o)
        if err is not None:
            raise err
        return Finish("abort", message=fr.message or "Aborted")
    if fr.type == "length":
        return Finish("length", length=o.num_output_tokens)
    return Finish("stop", matched=fr.matched)


def system_error(o: RequestOutput | None) -> APIError | None:
    """The HTTP error of a system abort (an abort finish carrying a status code: queue full, a
    waiting request displaced by a higher priority one, shutdown), SGLang's envelope and message;
    None for anything else."""
    fr = o.finish_reason if o is not None else None
    if fr is None or fr.type != "abort" or o.error:
        return None
    status = getattr(fr, "status_code", None)
    if not status:
        return None
    return system_abort(status, fr.message or "aborted")


def usage(prompt: int, completion: int, reasoning: int | None, cached: int = 0) -> dict:
    """OpenAI's usage object with SGLang's extras (reasoning_tokens, prompt_tokens_details)."""
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": cached} if cached else None}
    if reasoning is not None:
        u["reasoning_tokens"] = reasoning
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u
