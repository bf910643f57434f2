"""OpenAI routes: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions.

Request flow on the waitress worker thread: read + validate the body (schemas.py) -> render the
chat template and tokenize with this thread's tokenizer -> check the context length -> admit
(capacity) -> engine.submit -> either iterate outputs into one JSON body, or hand Falcon a
generator of SSE events. Everything that can fail because of the input fails before the first
byte of a stream, so it gets a proper 4xx; failures after that become an SSE error event.
Every path ends in a `finally` that aborts the request (a no-op when it finished) and releases
its admission slot, so a client that leaves frees its pages and slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Iterator

import falcon

from trnrt.engine.outputs import RequestOutput, TokenLogprob
from trnrt.engine.request import GenerateRequest, InvalidRequestError
from trnrt.serve import sse
from trnrt.serve.app import ServeState, TokenizerInfo, read_json
from trnrt.serve.errors import OpenAIError, bad_request, error_body
from trnrt.serve.reasoning import ReasoningParser
from trnrt.serve.schemas import (ChatRequest, CommonRequest, CompletionRequest, engine_field_to_openai,
                                 parse_chat, parse_completion)
from trnrt.serve.tool_calls import ToolCallParser

log = logging.getLogger("trnrt.serve")


def add_routes(app: falcon.App, state: ServeState) -> None:
    app.add_route("/v1/models", Models(state))
    app.add_route("/v1/models/{model_id:path}", Model(state))
    app.add_route("/v1/completions", Completions(state))
    app.add_route("/v1/chat/completions", ChatCompletions(state))


# --- models -------------------------------------------------------------------------------------
def _model_card(state: ServeState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "trnrt",
            "root": state.engine.model_info.model_path, "max_model_len": state.context_len}


class Models:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        resp.media = {"object": "list", "data": [_model_card(self.state)]}


class Model:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp, model_id: str) -> None:
        self.state.check_model(model_id)
        resp.media = _model_card(self.state)


# --- shared helpers -----------------------------------------------------------------------------
def _context_check(state: ServeState, creq: CommonRequest, n_prompt: int, param: str) -> None:
    """Set max_new_tokens from the prompt length; SGLang's messages for prompts that do not fit."""
    ctx = state.context_len
    if n_prompt >= ctx:
        raise bad_request(f"The input ({n_prompt} tokens) is longer than the model's context length "
                          f"({ctx} tokens): {param} must tokenize to fewer than {ctx} tokens.", param)
    if creq.max_tokens is None:
        creq.params.max_new_tokens = ctx - n_prompt
    elif n_prompt + creq.max_tokens > ctx:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
            f"a total of {n_prompt + creq.max_tokens} tokens: {n_prompt} tokens from the input messages and "
            f"{creq.max_tokens} tokens for the completion ({creq.max_tokens_param}). Please reduce the number of "
            f"tokens in the input messages or the completion to fit within the limit.", creq.max_tokens_param)
    else:
        creq.params.max_new_tokens = creq.max_tokens


def _validate_params(state: ServeState, params) -> None:
    try:
        params.validate(state.engine.model_info.vocab_size)
    except InvalidRequestError as e:
        raise bad_request(str(e), engine_field_to_openai(e.field))


def _submit(state: ServeState, greq: GenerateRequest, prompt_param: str):
    try:
        return state.engine.submit(greq)
    except InvalidRequestError as e:
        raise bad_request(str(e), engine_field_to_openai(e.field, prompt_param))
    except Exception as e:  # engine stopped or broken: not the client's fault, not a 500 either
        log.warning("engine refused request %s: %s", greq.request_id, e)
        raise OpenAIError(503, f"The engine cannot accept requests: {e}", type_="service_unavailable")


def _client_gone(req):
    probe = req.env.get("waitress.client_disconnected")
    return probe if probe is not None else (lambda: False)


def _abort_error(out: RequestOutput, state: ServeState) -> OpenAIError:
    if out.error:
        return OpenAIError(500, f"The request failed in the engine: {out.error}", type_="internal_error")
    msg = (out.finish_reason.message if out.finish_reason else None) or "aborted"
    return OpenAIError(503, f"The request was aborted by the server: {msg}", type_="service_unavailable")


def _usage(prompt: int, completion: int, reasoning: int | None, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": cached} if cached else None}
    if reasoning is not None:
        u["reasoning_tokens"] = reasoning
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u


def _respond(req, resp, run, stream: bool) -> None:
    """Hand a chat/completion run to the response: an SSE body (closed by the server when done or
    when the client goes away) or the collected JSON (the run is closed either way)."""
    if stream:
        _sse_headers(resp)
        resp.stream = sse.StreamBody(run.sse(_client_gone(req)), run.close)
    else:
        try:
            resp.media = run.collect(_client_gone(req))
        finally:
            run.close()


def _sse_headers(resp) -> None:
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


def _stream_error_event(err: OpenAIError) -> bytes:
    return sse.event(err.to_dict())


# --- chat ---------------------------------------------------------------------------------------
class ChatOutput:
    """Turns raw output text (markers kept) into reasoning / content / tool-call deltas.

    One object per request; the same feed()/finish() path serves streamed and non-streamed
    responses, so both agree.
    """

    def __init__(self, ti: TokenizerInfo, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 strip_special: bool, stream_reasoning: bool = True):
        self.ti = ti
        self.reasoning = reasoning
        self.tools = tools
        self.strip_special = strip_special
        self.stream_reasoning = stream_reasoning
        self._held_reasoning = ""
        self.raw_content = ""  # post-reasoning text before tool parsing (the fallback content)

    def _clean(self, text: str) -> str:
        return self.ti.strip_special(text) if self.strip_special else text

    def _delta(self, r: str, c: str, tool_deltas: list[dict], final: bool) -> dict:
        d: dict = {}
        if self.reasoning is not None and not self.stream_reasoning:
            self._held_reasoning += r
            r = ""
            if final or not self.reasoning.in_reasoning:
                r, self._held_reasoning = self._held_reasoning, ""
        r, c = self._clean(r), self._clean(c)
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


def _chat_logprobs(ti: TokenizerInfo, lps: list[TokenLogprob], n_top: int) -> list[dict]:
    out = []
    for lp in lps:
        tok = ti.piece(lp.token_id)
        out.append({"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": lp.logprob,
                    "top_logprobs": [{"token": (t := ti.piece(tid)), "bytes": list(t.encode("utf-8")), "logprob": v}
                                     for tid, v in lp.top[:n_top]]})
    return out


def _begin(st: ServeState, req, parse):
    """The common start of a POST: admission, body parsing, model check, this thread's tokenizer."""
    st.check_accepting()
    creq = parse(read_json(req, st.settings.max_request_bytes))
    st.check_model(creq.model)
    return creq, st.tokinfo()


def _finish_reason(o: RequestOutput) -> tuple[str, object]:
    """OpenAI finish_reason and SGLang's matched_stop for a finished output."""
    fr = o.finish_reason
    if fr is not None and fr.type == "length":
        return "length", None
    return "stop", (fr.matched if fr is not None else None)


class ChatCompletions:
    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        creq, ti = _begin(st, req, parse_chat)
        # Server defaults (--default-chat-template-kwargs) apply under the request's kwargs, and
        # the effective enable_thinking decides whether the reasoning parser runs.
        creq.template_kwargs = {**st.settings.default_chat_template_kwargs, **creq.template_kwargs}
        thinking = creq.template_kwargs.get("enable_thinking", creq.template_kwargs.get("thinking", True))
        creq.enable_thinking = thinking is not False
        prompt_text, prompt_ids = self._render(ti, creq)
        _context_check(st, creq, len(prompt_ids), "messages")

        use_tools = bool(creq.tools) and creq.tool_choice != "none" and st.settings.tool_call_parser is not None
        use_reasoning = (st.settings.reasoning_parser is not None and ti.has_think and creq.enable_thinking
                         and creq.separate_reasoning)
        # The markers are special tokens: the engine must keep them for the parsers; the
        # server strips special tokens afterwards if the client asked for that.
        if use_tools or use_reasoning:
            creq.params.skip_special_tokens = False
        _validate_params(st, creq.params)

        forced = prompt_text.rstrip().endswith("<think>")
        reasoning = ReasoningParser(forced=forced, tool_start="<tool_call>" if use_tools else None) \
            if use_reasoning else None
        tools = ToolCallParser(creq.tools, st.settings.tool_call_parser) if use_tools else None
        out = ChatOutput(ti, reasoning, tools, strip_special=creq.user_skip_special_tokens,
                         stream_reasoning=creq.stream_reasoning)

        greq = GenerateRequest(prompt_ids, creq.params, stream=creq.stream)
        st.acquire()
        try:
            stream = _submit(st, greq, "messages")
        except BaseException:
            st.release()
            raise
        run = _ChatRun(st, ti, creq, greq, stream, out, len(prompt_ids), use_reasoning, forced)
        _respond(req, resp, run, creq.stream)

    def _render(self, ti: TokenizerInfo, creq: ChatRequest) -> tuple[str, list[int]]:
        kwargs = dict(creq.template_kwargs)
        kwargs.setdefault("enable_thinking", creq.enable_thinking)
        # tool_choice "none": the tools are left out of the prompt too (vLLM's
        # --exclude-tools-when-tool-choice-none), so the model is not invited to call them.
        tools = creq.tools if creq.tool_choice != "none" else None
        try:
            text = ti.tokenizer.apply_chat_template(creq.messages, tools=tools, add_generation_prompt=True,
                                                    tokenize=False, **kwargs)
        except Exception as e:  # jinja2 TemplateError (raise_exception), TypeError from odd kwargs, ...
            raise bad_request(f"messages could not be rendered by the chat template: {e}", "messages")
        if not isinstance(text, str):
            raise bad_request("the chat template did not render a string", "messages")
        ids = ti.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("messages rendered to an empty prompt", "messages")
        return text, ids


class _ChatRun:
    """One chat request in flight: the engine stream plus response assembly."""

    def __init__(self, st: ServeState, ti: TokenizerInfo, creq: ChatRequest, greq: GenerateRequest, stream,
                 out: ChatOutput, n_prompt: int, use_reasoning: bool, forced: bool):
        self.st, self.ti, self.creq, self.greq, self.stream, self.out = st, ti, creq, greq, stream, out
        self.n_prompt = n_prompt
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.finished = False
        self.closed = False
        self.num_output = 0
        self.num_cached = 0
        # Reasoning tokens are counted by token id: everything before </think> (or a <tool_call>).
        self.count_reasoning = use_reasoning
        self.in_reasoning = use_reasoning and forced
        self.reasoning_tokens = 0
        self._end_ids = {ti.marker_ids.get("</think>"), ti.marker_ids.get("<tool_call>")} - {None}
        self._start_id = ti.marker_ids.get("<think>")
        self._seen_any = False

    def _count(self, o: RequestOutput) -> None:
        if o.num_output_tokens:
            self.num_output = o.num_output_tokens
        else:
            self.num_output += len(o.new_token_ids)
        if o.num_prompt_tokens:
            self.n_prompt = o.num_prompt_tokens
        self.num_cached = o.num_cached_tokens or self.num_cached
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

    def _finish_reason(self, o: RequestOutput) -> tuple[str, object]:
        reason, matched = _finish_reason(o)
        if reason == "stop" and self.out.tools is not None and self.out.tools.has_complete_calls:
            return "tool_calls", None
        return reason, matched

    def _usage(self) -> dict:
        return _usage(self.n_prompt, self.num_output, self.reasoning_tokens if self.count_reasoning else 0,
                      self.num_cached)

    def _outputs(self, client_gone) -> Iterator[RequestOutput]:
        for _, o in sse.drain_streams([self.stream], client_gone, self.st.settings.poll_interval_s):
            if o.finished:
                self.finished = True
            yield o

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.st.engine.abort(self.greq.request_id)
        self.st.release()

    # non-streaming
    def collect(self, client_gone) -> dict:
        reasoning, content, lps = [], [], []
        last = None
        try:
            for o in self._outputs(client_gone):
                self._count(o)
                d = self.out.feed(o.new_text)
                reasoning.append(d.get("reasoning_content", ""))
                content.append(d.get("content", ""))
                if o.new_logprobs:
                    lps.extend(o.new_logprobs)
                last = o
        except sse.ClientGone:
            raise bad_request("client closed the request")
        if last.finish_reason is not None and last.finish_reason.type == "abort":
            raise _abort_error(last, self.st)
        d = self.out.finish()
        reasoning.append(d.get("reasoning_content", ""))
        content.append(d.get("content", ""))
        finish, matched = self._finish_reason(last)
        message: dict = {"role": "assistant", "content": "".join(content), "reasoning_content": None}
        if self.out.reasoning is not None and "".join(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if self.out.tools is not None:
            calls = [c for c in self.out.tools.calls if c.complete]
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                message["content"] = message["content"].strip()
            elif self.out.tools.calls or "<tool_call>" in self.out.raw_content:
                # A marker but no complete call: the raw text is the answer.
                message["content"] = self.out._clean(self.out.raw_content)
        logprobs = None
        if self.creq.want_logprobs:
            logprobs = {"content": _chat_logprobs(self.ti, lps, self.creq.params.logprobs or 0)}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.st.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                             "matched_stop": matched}],
                "usage": self._usage(), "metadata": {"weight_version": "default"}}

    # streaming
    def _chunk(self, delta: dict, logprobs=None, finish=None, matched=None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}
        return sse.event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.st.model_name, "choices": [choice]})

    def sse(self, client_gone) -> Iterator[bytes]:
        want_lp = self.creq.want_logprobs
        n_top = self.creq.params.logprobs or 0
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            pending_lps: list[TokenLogprob] = []
            last = None
            for o in self._outputs(client_gone):
                self._count(o)
                last = o
                if o.finished and o.finish_reason is not None and o.finish_reason.type == "abort":
                    break
                d = self.out.feed(o.new_text)
                if want_lp and o.new_logprobs:
                    pending_lps.extend(o.new_logprobs)
                if d:
                    lp = {"content": _chat_logprobs(self.ti, pending_lps, n_top)} if want_lp else None
                    pending_lps = []
                    yield self._chunk(d, lp)
            if last.finish_reason is not None and last.finish_reason.type == "abort":
                yield _stream_error_event(_abort_error(last, self.st))
                yield sse.DONE
                return
            d = self.out.finish()
            lp = {"content": _chat_logprobs(self.ti, pending_lps, n_top)} if (want_lp and pending_lps) else None
            if d:
                yield self._chunk(d, lp)
                lp = None
            finish, matched = self._finish_reason(last)
            yield self._chunk({}, lp, finish, matched)
            if self.creq.include_usage:
                yield sse.event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.st.model_name, "choices": [], "usage": self._usage()})
            yield sse.DONE
        except sse.ClientGone:
            return
        except Exception as e:  # after the headers the status cannot change: report in-band
            log.exception("chat stream %s failed", self.greq.request_id)
            yield sse.event(error_body(500, f"Internal server error: {type(e).__name__}"))
            yield sse.DONE
        finally:
            self.close()


# --- completions --------------------------------------------------------------------------------
def _completion_logprobs(ti: TokenizerInfo, lps: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = ti.piece(lp.token_id)
        offsets.append(offset)
        offset += len(tok)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({ti.piece(t): v for t, v in lp.top})
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, offset


class Completions:
    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        creq, ti = _begin(st, req, parse_completion)
        vocab = st.engine.model_info.vocab_size
        prompt_ids: list[list[int]] = []
        echo_texts: list[str] = []
        for i, p in enumerate(creq.prompts):
            if isinstance(p, str):
                ids = ti.tokenizer.encode(p, add_special_tokens=False)
                if not ids:
                    raise bad_request("prompt tokenized to no tokens", "prompt")
                echo_texts.append(p)
            else:
                bad = next((t for t in p if not (0 <= t < vocab)), None)
                if bad is not None:
                    raise bad_request(f"prompt contains an out-of-vocabulary token id {bad} (vocab size {vocab})",
                                      "prompt")
                ids = p
                echo_texts.append(ti.tokenizer.decode(ids, skip_special_tokens=False) if creq.echo else "")
            prompt_ids.append(ids)
        max_tokens = creq.max_tokens
        for ids in prompt_ids:
            creq.max_tokens = max_tokens
            _context_check(st, creq, len(ids), "prompt")
        _validate_params(st, creq.params)

        reqs = [GenerateRequest(ids, creq.params.clone(), stream=creq.stream) for ids in prompt_ids]
        st.acquire()
        streams = []
        try:
            for g in reqs:
                streams.append(_submit(st, g, "prompt"))
        except BaseException:
            for g in reqs[: len(streams)]:
                st.engine.abort(g.request_id)
            st.release()
            raise
        run = _CompletionRun(st, ti, creq, reqs, streams, prompt_ids, echo_texts)
        _respond(req, resp, run, creq.stream)


class _CompletionRun:
    def __init__(self, st: ServeState, ti: TokenizerInfo, creq: CompletionRequest, reqs, streams, prompt_ids,
                 echo_texts):
        self.st, self.ti, self.creq, self.reqs, self.streams = st, ti, creq, reqs, streams
        self.prompt_ids = prompt_ids
        self.echo_texts = echo_texts
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        n = len(streams)
        self.done = [False] * n
        self.num_output = [0] * n
        self.num_prompt = [len(p) for p in prompt_ids]
        self.num_cached = [0] * n
        self.closed = False

    def _count(self, i: int, o: RequestOutput) -> None:
        self.num_output[i] = o.num_output_tokens or (self.num_output[i] + len(o.new_token_ids))
        if o.num_prompt_tokens:
            self.num_prompt[i] = o.num_prompt_tokens
        self.num_cached[i] = o.num_cached_tokens or self.num_cached[i]
        if o.finished:
            self.done[i] = True

    def _usage(self) -> dict:
        return _usage(sum(self.num_prompt), sum(self.num_output), 0, sum(self.num_cached))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g, d in zip(self.reqs, self.done):
            if not d:
                self.st.engine.abort(g.request_id)
        self.st.release()

    def collect(self, client_gone) -> dict:
        n = len(self.streams)
        texts = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[RequestOutput | None] = [None] * n
        try:
            for i, o in sse.drain_streams(self.streams, client_gone, self.st.settings.poll_interval_s):
                self._count(i, o)
                texts[i] += o.new_text
                if o.new_logprobs:
                    lps[i].extend(o.new_logprobs)
                last[i] = o
        except sse.ClientGone:
            raise bad_request("client closed the request")
        choices = []
        for i in range(n):
            o = last[i]
            if o.finish_reason is not None and o.finish_reason.type == "abort":
                raise _abort_error(o, self.st)
            finish, matched = _finish_reason(o)
            logprobs = None
            if self.creq.logprobs is not None:
                logprobs, _ = _completion_logprobs(self.ti, lps[i], 0)
            choices.append({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": finish,
                            "matched_stop": matched})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.st.model_name,
                "choices": choices, "usage": self._usage(), "metadata": {"weight_version": "default"}}

    def _chunk(self, i: int, text: str, logprobs=None, finish=None, matched=None) -> bytes:
        return sse.event({"id": self.id, "object": "text_completion", "created": self.created,
                          "model": self.st.model_name,
                          "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                       "matched_stop": matched}]})

    def sse(self, client_gone) -> Iterator[bytes]:
        n = len(self.streams)
        pending_echo = [self.echo_texts[i] if self.creq.echo else "" for i in range(n)]
        offsets = [0] * n
        try:
            for i, o in sse.drain_streams(self.streams, client_gone, self.st.settings.poll_interval_s):
                self._count(i, o)
                if o.finished and o.finish_reason is not None and o.finish_reason.type == "abort":
                    yield _stream_error_event(_abort_error(o, self.st))
                    yield sse.DONE
                    return
                lp = None
                if self.creq.logprobs is not None:
                    lp, offsets[i] = _completion_logprobs(self.ti, o.new_logprobs or [], offsets[i])
                text = pending_echo[i] + o.new_text
                pending_echo[i] = ""
                finish, matched = _finish_reason(o) if o.finished else (None, None)
                if text or o.finished or (lp and lp["tokens"]):
                    yield self._chunk(i, text, lp, finish, matched)
            if self.creq.include_usage:
                yield sse.event({"id": self.id, "object": "text_completion", "created": self.created,
                                 "model": self.st.model_name, "choices": [], "usage": self._usage()})
            yield sse.DONE
        except sse.ClientGone:
            return
        except Exception as e:
            log.exception("completion stream %s failed", self.id)
            yield sse.event(error_body(500, f"Internal server error: {type(e).__name__}"))
            yield sse.DONE
        finally:
            self.close()
