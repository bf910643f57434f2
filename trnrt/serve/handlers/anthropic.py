"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages body is parsed into the chat route's request (protocol/anthropic.py), rendered with
the chat template and run through the same GLM reasoning and tool-call parsers; the answer is
Anthropic's Message or its event stream (output/anthropic.py). Every error on these routes —
validation, body, model, admission, a system abort, an engine failure — is Anthropic's envelope
`{"type": "error", "error": {"type", "message"}}`; the `anthropic-version` and `anthropic-beta`
headers are accepted and not checked.
"""

from __future__ import annotations

import logging
import uuid

from trnrt.serve.handlers.base import Admission, begin, respond, submit
from trnrt.serve.http.errors import AnthropicError, APIError
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.anthropic import MessagesRenderer
from trnrt.serve.output.assembler import TokenCounter
from trnrt.serve.output.reasoning import ReasoningParser
from trnrt.serve.output.tool_calls import ToolCallParser
from trnrt.serve.protocol.tool_choice import forced_call_grammar
from trnrt.serve.protocol.anthropic import (engine_field_to_anthropic, messages_to_engine_request,
                                            parse_count_tokens, parse_messages)
from trnrt.serve.protocol.chat_template import apply_template_defaults, render_chat

log = logging.getLogger("trnrt.serve")

MESSAGES_PATH = "/v1/messages"  # the auth middleware's Anthropic prefix (this route and those under it)


def _anthropic_errors(method):
    """Run a responder so that every error it raises leaves in Anthropic's envelope."""
    def wrapped(self, req, resp, *args, **kw):
        resp.set_header("request-id", "req_" + uuid.uuid4().hex[:24])
        try:
            return method(self, req, resp, *args, **kw)
        except APIError as e:
            raise AnthropicError.of(e)
        except Exception as e:  # a bug: logged with its traceback, answered without one
            log.exception("unhandled error on %s %s", req.method, req.path)
            raise AnthropicError(500, f"Internal server error: {type(e).__name__}")
    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


def _render(st: ServeState, ti, mreq):
    apply_template_defaults(mreq, st.settings.default_chat_template_kwargs)
    return render_chat(ti.tokenizer, mreq, max_tokens=st.context_len, add_generation_prompt=mreq.add_generation_prompt,
                       trust_request_template=st.settings.trust_request_chat_template)


class _AnthropicRoute:
    """Other methods get 405 in Anthropic's envelope."""

    def __init__(self, state: ServeState):
        self.state = state

    @_anthropic_errors
    def on_get(self, req, resp, **kw) -> None:
        raise APIError(405, f"Method GET is not allowed on {req.path}; use POST")

    on_put = on_delete = on_patch = on_get


class Messages(_AnthropicRoute):
    @_anthropic_errors
    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st) as adm:
            mreq, ti = begin(st, req, parse_messages)
            prompt = _render(st, ti, mreq)
            s = st.settings
            use_tools = bool(mreq.tools) and mreq.tool_choice != "none" and s.tool_call_parser is not None
            use_reasoning = s.reasoning_parser is not None and ti.has_think and mreq.enable_thinking
            # The markers are special tokens: the engine keeps them for the parsers, the renderer
            # strips special-token text afterwards.
            if use_tools or use_reasoning:
                mreq.params.skip_special_tokens = False
            # tool_choice any / tool: the GLM tool-call grammar (its own reasoning prefix)
            mreq.params.grammar = forced_call_grammar(mreq, reasoning=prompt.forced_reasoning,
                                                      tool_parser=s.tool_call_parser)
            greq = messages_to_engine_request(mreq, prompt.ids, st.context_len, st.engine.model_info.vocab_size)
            reasoning = (ReasoningParser(forced=prompt.forced_reasoning,
                                         tool_start="<tool_call>" if use_tools else None) if use_reasoning else None)
            tools = ToolCallParser(mreq.tools, s.tool_call_parser) if use_tools else None
            counter = TokenCounter(len(prompt.ids), ti)
            renderer = MessagesRenderer(st.model_name, ti, mreq, reasoning, tools, counter)
            sub = submit(st, [greq], engine_field_to_anthropic, admission=adm, req=req)
            respond(req, resp, sub, renderer, mreq.stream)


class CountTokens(_AnthropicRoute):
    """`{"input_tokens": N}`: the length of the prompt /v1/messages would submit for the same body."""

    @_anthropic_errors
    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st):  # tokenization work counts against the HTTP layer's admission
            mreq, ti = begin(st, req, parse_count_tokens)
            prompt = _render(st, ti, mreq)
        resp.media = {"input_tokens": len(prompt.ids)}


class NotFound(_AnthropicRoute):
    """Any other path under /v1/messages (batches, ...): 404 in Anthropic's envelope."""

    @_anthropic_errors
    def on_post(self, req, resp, **kw) -> None:
        raise APIError(404, f"{req.path} is not served by this server (it serves POST /v1/messages and "
                            "POST /v1/messages/count_tokens)")

    on_get = on_put = on_delete = on_patch = on_post


def routes(state: ServeState) -> dict:
    """The Anthropic routes, for app.py's route table."""
    return {
        MESSAGES_PATH: Messages(state),
        MESSAGES_PATH + "/count_tokens": CountTokens(state),
        MESSAGES_PATH + "/{rest:path}": NotFound(state),
    }
