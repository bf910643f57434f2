"""OpenAI routes: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

from trnrt.serve.handlers.base import Admission, begin, require_prompt_logprobs, respond, submit
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.assembler import ChatOutput, TokenCounter
from trnrt.serve.output.openai import ChatRenderer, CompletionRenderer
from trnrt.serve.output.reasoning import ReasoningParser
from trnrt.serve.output.tool_calls import ToolCallParser
from trnrt.serve.protocol.chat_template import apply_template_defaults, render_chat
from trnrt.serve.protocol.structured import gate_after_think
from trnrt.serve.protocol.tool_choice import forced_call_grammar
from trnrt.serve.protocol.openai import (chat_to_engine_requests, completion_to_engine_requests,
                                         engine_field_to_openai, parse_chat, parse_completion)


def model_card(state: ServeState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "trnrt",
            "root": state.engine.model_info.model_path, "parent": None, "max_model_len": state.context_len}


class Models:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp) -> None:
        resp.media = {"object": "list", "data": [model_card(self.state)]}


class Model:
    def __init__(self, state: ServeState):
        self.state = state

    def on_get(self, req, resp, model_id: str) -> None:
        self.state.check_model(model_id)
        resp.media = model_card(self.state)


def _default_usage(st: ServeState, creq) -> None:
    """--stream-response-default-include-usage (SGLang's flag): every streamed response ends with
    the usage chunk, as if stream_options.include_usage were true."""
    if creq.stream and getattr(st.settings, "stream_response_default_include_usage", False):
        creq.include_usage = True


class ChatCompletions:
    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st) as adm:
            self._start(req, resp, st, adm)

    def _start(self, req, resp, st: ServeState, adm: Admission) -> None:
        creq, ti = begin(st, req, parse_chat)
        if creq.prompt_logprobs is not None:
            require_prompt_logprobs(st, "prompt_logprobs")
        st.check_priority([creq.priority])
        apply_template_defaults(creq, st.settings.default_chat_template_kwargs)
        _default_usage(st, creq)
        prompt = render_chat(ti.tokenizer, creq, max_tokens=st.context_len,
                             add_generation_prompt=creq.add_generation_prompt,
                             trust_request_template=st.settings.trust_request_chat_template)

        use_tools = bool(creq.tools) and creq.tool_choice != "none" and st.settings.tool_call_parser is not None
        use_reasoning = (st.settings.reasoning_parser is not None and ti.has_think and creq.enable_thinking
                         and creq.separate_reasoning)
        # The markers are special tokens: the engine must keep them for the parsers; the
        # server strips special tokens afterwards if the client asked for that.
        if use_tools or use_reasoning:
            creq.params.skip_special_tokens = False
        # a request that reasons is free until </think>; the grammar constrains the answer after it
        creq.params.grammar = gate_after_think(creq.params.grammar, ti.marker_ids.get("</think>"),
                                               ti.has_think and creq.enable_thinking)
        # tool_choice required / named: the GLM tool-call grammar (its own reasoning prefix)
        creq.params.grammar = forced_call_grammar(creq, reasoning=prompt.forced_reasoning,
                                                  tool_parser=st.settings.tool_call_parser)
        greqs = chat_to_engine_requests(creq, prompt.ids, st.context_len, st.engine.model_info.vocab_size)

        def choice():  # each choice parses its own output
            reasoning = (ReasoningParser(forced=prompt.forced_reasoning, tool_start="<tool_call>" if use_tools else None)
                         if use_reasoning else None)
            tools = ToolCallParser(creq.tools, st.settings.tool_call_parser) if use_tools else None
            out = ChatOutput(ti, reasoning, tools, strip_special=creq.user_skip_special_tokens,
                             stream_reasoning=creq.stream_reasoning)
            return out, TokenCounter(len(prompt.ids), ti, count_reasoning=use_reasoning, forced=prompt.forced_reasoning)

        outs, counters = zip(*[choice() for _ in greqs])
        sub = submit(st, greqs, lambda f: engine_field_to_openai(f, "messages"), admission=adm, req=req)
        renderer = ChatRenderer(st.model_name, ti, creq, list(outs), list(counters), prompt_ids=prompt.ids)
        respond(req, resp, sub, renderer, creq.stream)


class Completions:
    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st) as adm:
            creq, ti = begin(st, req, parse_completion)
            if creq.params.prompt_logprobs is not None:
                require_prompt_logprobs(st, creq.prompt_logprobs_param)
            _default_usage(st, creq)
            st.check_priority([creq.priority])
            reqs, echo_texts = completion_to_engine_requests(creq, ti.tokenizer, st.context_len,
                                                             st.engine.model_info.vocab_size)
            sub = submit(st, reqs, lambda f: engine_field_to_openai(f, "prompt", creq.prompt_logprobs_param),
                         admission=adm, req=req)
        renderer = CompletionRenderer(st.model_name, ti, creq, [len(r.prompt_token_ids) for r in reqs], echo_texts,
                                      n=creq.n, prompt_ids=[r.prompt_token_ids for r in reqs])
        respond(req, resp, sub, renderer, creq.stream)
