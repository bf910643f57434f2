"""SGLang's native generation route: POST (and PUT) /generate."""

from __future__ import annotations

import time

from trnrt.serve.handlers.base import Admission, begin, require_prompt_logprobs, respond, submit
from trnrt.serve.http.errors import APIError, SGLangObjectError
from trnrt.serve.http.state import ServeState
from trnrt.serve.output.sglang import GenerateRenderer
from trnrt.serve.protocol.sglang import engine_field_to_sglang, parse_generate, to_engine_requests


class Generate:
    """`/generate`: text or input_ids, single or batch, streamed (cumulative) or not."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        t0 = time.monotonic()
        try:
            with Admission(st) as adm:
                greq, ti = begin(st, req, parse_generate)
                if any(it.input_logprobs for it in greq.items):  # logprob_start_len >= 0 with return_logprob
                    require_prompt_logprobs(st, "logprob_start_len")
                st.check_priority([it.priority for it in greq.items])
                reqs = to_engine_requests(greq, ti.tokenizer, st.context_len, st.engine.model_info.vocab_size)
                sub = submit(st, reqs, lambda f: engine_field_to_sglang(f, greq), admission=adm, req=req)
        except SGLangObjectError:
            raise
        except APIError as e:
            if e.status >= 500:  # shutting down, at capacity: SGLang's HTTPException envelope
                raise SGLangObjectError(e.status, e.message, headers=e.headers)
            raise
        renderer = GenerateRenderer(ti, greq, reqs, t0, incremental=st.settings.incremental_streaming_output,
                                    cache_details=st.settings.enable_hierarchical_cache)
        respond(req, resp, sub, renderer, greq.stream)

    on_put = on_post
