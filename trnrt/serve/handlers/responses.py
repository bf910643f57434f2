"""OpenAI Responses routes: POST /v1/responses, and with --enable-response-store
GET/DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel.

A Responses request runs as a chat request (protocol/responses.py translates it): the chat
template renders instructions + the stored conversation of `previous_response_id` + the input
items, the GLM reasoning and tool-call parsers split the output, and output/responses.py shapes
it into a Response object or its event stream. Without the store the stateful routes and fields
are refused with SGLang's 400; `store: true` is then ignored (as SGLang does) and echoed false.
"""

from __future__ import annotations

import json
import time

from trnrt.serve.handlers.base import Admission, begin, respond, submit
from trnrt.serve.http.errors import APIError, bad_request, unsupported
from trnrt.serve.http.response_store import ResponseStore
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.assembler import ChatOutput, TokenCounter
from trnrt.serve.output.reasoning import ReasoningParser
from trnrt.serve.output.responses import ResponsesRenderer, new_id, openai_error
from trnrt.serve.output.tool_calls import ToolCallParser
from trnrt.serve.protocol.chat_template import apply_template_defaults, render_chat
from trnrt.serve.protocol.openai import chat_to_engine_request
from trnrt.serve.protocol.structured import gate_after_think
from trnrt.serve.protocol.tool_choice import forced_call_grammar
from trnrt.serve.protocol.responses import STORE_DISABLED_MESSAGE, is_response_id, parse_responses

CANCEL_WAIT_S = 2.0  # how long cancel waits for the aborted request's final object


def make_store(st: ServeState) -> ResponseStore | None:
    s = st.settings
    if not getattr(s, "enable_response_store", False):
        return None
    ttl = s.response_store_ttl_s
    return ResponseStore(int(s.response_store_size_mb * 1024 * 1024), ttl if ttl and ttl > 0 else None)


def routes(st: ServeState) -> dict:
    """The route table entries of this family (one store shared by them)."""
    store = make_store(st)
    return {"/v1/responses": Responses(st, store),
            "/v1/responses/{response_id}": StoredResponse(st, store),
            "/v1/responses/{response_id}/cancel": CancelResponse(st, store)}


def _as_input(e: APIError) -> APIError:
    """The chat path names `messages`; this API's field is `input`."""
    e = openai_error(e)
    if e.param == "messages":
        return APIError(e.status, e.message.replace("messages", "input"), "input", e.type, e.code, e.headers)
    return e


def _is_context_error(e: APIError) -> bool:
    return e.status == 400 and "context length" in e.message


def _assistant_turn(items: list[dict]) -> dict:
    """The output items as one chat assistant message (what a continuation renders)."""
    msg: dict = {"role": "assistant", "content": ""}
    reasoning, text, calls = [], [], []
    for it in items:
        if it["type"] == "reasoning":
            reasoning.extend(p["text"] for p in it.get("content") or [])
        elif it["type"] == "message":
            text.extend(p.get("text", "") for p in it["content"])
        elif it["type"] == "function_call":
            try:
                args = json.loads(it["arguments"]) if it["arguments"].strip() else {}
            except ValueError:
                args = it["arguments"]
            calls.append({"id": it["call_id"], "type": "function",
                          "function": {"name": it["name"], "arguments": args if isinstance(args, dict)
                                       else it["arguments"]}})
    msg["content"] = "".join(text)
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


class _Base:
    def __init__(self, state: ServeState, store: ResponseStore | None):
        self.state, self.store = state, store

    def _entry(self, response_id: str, param: str = "response_id"):
        if self.store is None:
            raise bad_request(STORE_DISABLED_MESSAGE, param)
        if not is_response_id(response_id):
            raise bad_request(f"Invalid '{param}': expected an ID that begins with 'resp_'.", param)
        e = self.store.get(response_id)
        if e is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        return e


class Responses(_Base):
    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st) as adm:
            self._start(req, resp, st, adm)

    def _start(self, req, resp, st: ServeState, adm: Admission) -> None:
        rreq, ti = begin(st, req, parse_responses)
        creq = rreq.chat
        history: list[dict] = []
        if rreq.previous_response_id is not None:
            prev = self._entry(rreq.previous_response_id, "previous_response_id")
            if prev.history is None:
                raise bad_request(f"Response '{rreq.previous_response_id}' is still in progress",
                                  "previous_response_id")
            history = list(prev.history)
        if not history and not rreq.input_messages:
            raise bad_request("input must contain at least one item", "input")
        will_store = self.store is not None and rreq.store is not False
        apply_template_defaults(creq, st.settings.default_chat_template_kwargs)
        use_tools = bool(creq.tools) and creq.tool_choice != "none" and st.settings.tool_call_parser is not None
        use_reasoning = st.settings.reasoning_parser is not None and ti.has_think and creq.enable_thinking
        if use_tools or use_reasoning:
            creq.params.skip_special_tokens = False
        creq.params.grammar = gate_after_think(creq.params.grammar, ti.marker_ids.get("</think>"),
                                               ti.has_think and creq.enable_thinking)
        convo = history + rreq.input_messages
        prompt, greq = self._render(st, ti, rreq, convo)
        # tool_choice required / named: the GLM tool-call grammar (its own reasoning prefix)
        greq.sampling_params.grammar = forced_call_grammar(creq, reasoning=prompt.forced_reasoning,
                                                           tool_parser=st.settings.tool_call_parser)

        response_id = new_id("resp_")
        reasoning = (ReasoningParser(forced=prompt.forced_reasoning, tool_start="<tool_call>" if use_tools else None)
                     if use_reasoning else None)
        tools = ToolCallParser(creq.tools, st.settings.tool_call_parser) if use_tools else None
        out = ChatOutput(ti, reasoning, tools, strip_special=True)
        counter = TokenCounter(len(prompt.ids), ti, count_reasoning=use_reasoning, forced=prompt.forced_reasoning)
        base = {
            "instructions": rreq.instructions, "max_output_tokens": rreq.max_output_tokens,
            "metadata": rreq.metadata, "parallel_tool_calls": rreq.parallel_tool_calls,
            "previous_response_id": rreq.previous_response_id,
            "reasoning": rreq.reasoning_echo or {"effort": None, "summary": None},
            "store": will_store, "temperature": rreq.temperature, "text": rreq.text_echo,
            "tool_choice": rreq.tool_choice_echo, "tools": rreq.tools_echo, "top_logprobs": rreq.top_logprobs,
            "top_p": rreq.top_p, "truncation": rreq.truncation, "user": rreq.user, "background": False,
        }
        on_update = self._store_updater(response_id, convo, greq.request_id) if will_store else None
        renderer = ResponsesRenderer(response_id, st.model_name, ti, base, out, counter,
                                     parallel_tool_calls=rreq.parallel_tool_calls, want_logprobs=rreq.want_logprobs,
                                     n_top=rreq.top_logprobs, forced_reasoning=prompt.forced_reasoning,
                                     on_update=on_update)
        field = {"max_new_tokens": "max_output_tokens", "prompt_token_ids": "input"}
        try:
            sub = submit(st, [greq], lambda f: field.get(f or "", f), admission=adm, req=req)
            respond(req, resp, sub, renderer, creq.stream)
        except APIError as e:
            raise openai_error(e)

    def _store_updater(self, response_id: str, convo: list[dict], engine_rid: str):
        """Writes the response into the store: in progress (with a cancel hook that aborts the
        engine request), then final (with the conversation a continuation resumes from)."""
        store, engine = self.store, self.state.engine

        def on_update(r: dict, final: bool) -> None:
            if final:
                store.put(response_id, r, convo + [_assistant_turn(r["output"])])
            else:
                store.put(response_id, r, None, cancel=lambda: engine.abort(engine_rid))

        return on_update

    def _render(self, st: ServeState, ti, rreq, convo: list[dict]):
        """Prompt and engine request; with truncation 'auto' the oldest items are dropped
        (1, 2, 4, ... of them, the last item always kept) until the prompt fits."""
        creq = rreq.chat
        system = [{"role": "system", "content": rreq.instructions}] if rreq.instructions is not None else []
        drop = 0
        while True:
            creq.messages = system + convo[drop:]
            try:
                prompt = render_chat(ti.tokenizer, creq, max_tokens=st.context_len)
                return prompt, chat_to_engine_request(creq, prompt.ids, st.context_len,
                                                      st.engine.model_info.vocab_size)
            except APIError as e:
                if rreq.truncation != "auto" or not _is_context_error(e) or drop >= len(convo) - 1:
                    raise _as_input(e)
                drop = min(len(convo) - 1, drop + max(1, drop))


class StoredResponse(_Base):
    def on_get(self, req, resp, response_id: str) -> None:
        if req.get_param_as_bool("stream"):
            raise unsupported("stream", "(replaying a stored response as events) is not supported by this server")
        resp.media = self._entry(response_id).response

    def on_delete(self, req, resp, response_id: str) -> None:
        e = self._entry(response_id)
        if e.in_progress:
            raise bad_request(f"Response '{response_id}' is in progress: cancel it first", "response_id")
        self.store.delete(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}


class CancelResponse(_Base):
    def on_post(self, req, resp, response_id: str) -> None:
        e = self._entry(response_id)
        if not e.in_progress:
            raise bad_request(f"Cannot cancel response '{response_id}': its status is "
                              f"{e.response.get('status')!r}; only an in-progress response can be cancelled.",
                              "response_id")
        self.store.request_cancel(response_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            cur = self.store.get(response_id)
            if cur is None or not cur.in_progress:
                break
            time.sleep(0.01)
        cur = self.store.get(response_id)
        if cur is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        r = cur.response
        if cur.in_progress:  # the engine has not answered yet: it will end cancelled
            r = {**r, "status": "cancelled"}
        resp.media = r
