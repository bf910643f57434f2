"""Tokenizer routes: POST /tokenize, /v1/tokenize, /detokenize, /v1/detokenize.

They run entirely on the waitress request thread with that thread's tokenizer (ServeState.tokinfo):
nothing is submitted to the engine, so they take no admission slot and never wait behind
generation. The body is parsed by trnrt.serve.protocol.tokenize; the messages form renders through
the same `apply_template_defaults` + `render_chat` as /v1/chat/completions, so `count` equals that
request's `usage.prompt_tokens`.
"""

from __future__ import annotations

from trnrt.serve.handlers.base import Admission
from trnrt.serve.http.body import read_json
from trnrt.serve.http.errors import bad_request
from trnrt.serve.http.state import ServeState
from trnrt.serve.protocol.chat_template import apply_template_defaults, encode_text, render_chat
from trnrt.serve.protocol.tokenize import MAX_BODY_BYTES, TokenizeRequest, parse_detokenize, parse_tokenize


def begin(st: ServeState, req, parse):
    """handlers.base.begin with the tokenizer routes' tighter body limit (MAX_BODY_BYTES).

    Every byte of these bodies is tokenizer work on this thread (about 1.3 s and 150 MB per MB of
    text with a byte-level BPE), and unlike the chat route no context bound refuses long text
    early (a count past the context is a valid answer, as in vLLM).
    """
    st.check_accepting()
    parsed = parse(read_json(req, min(st.settings.max_request_bytes, MAX_BODY_BYTES)))
    st.check_model(getattr(parsed, "model", None))
    return parsed, st.tokinfo()


def tokenize_ids(st: ServeState, tokenizer, treq: TokenizeRequest) -> list[list[int]]:
    """The token ids of each prompt of `treq` (one sequence for the messages form)."""
    if treq.chat is None:
        return [encode_text(tokenizer, p, "prompt", add_special_tokens=treq.add_special_tokens)
                for p in treq.prompts]
    creq = treq.chat
    # Exactly ChatCompletions' steps, so the ids are the ones the engine would receive.
    apply_template_defaults(creq, st.settings.default_chat_template_kwargs)
    rendered = render_chat(tokenizer, creq, add_generation_prompt=treq.add_generation_prompt,
                           trust_request_template=st.settings.trust_request_chat_template)
    if not treq.add_special_tokens:
        return [rendered.ids]
    # vLLM's chat form with add_special_tokens true: the rendered text encoded with the
    # tokenizer's own specials added (then no longer what the chat route submits).
    return [encode_text(tokenizer, rendered.text, "messages", add_special_tokens=True)]


class Tokenize:
    """POST /tokenize: `{"tokens", "count", "max_model_len", "token_strs"}` (SGLang's fields plus
    vLLM's `token_strs`, null unless `return_token_strs`); per-prompt lists for a batch."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        with Admission(st):  # tokenization work counts against the HTTP layer's admission
            treq, ti = begin(st, req, parse_tokenize)
            seqs = tokenize_ids(st, ti.tokenizer, treq)
        strs = [list(ti.tokenizer.convert_ids_to_tokens(ids)) for ids in seqs] if treq.return_token_strs else None
        if treq.batch:
            resp.media = {"tokens": seqs, "count": [len(s) for s in seqs], "max_model_len": st.context_len,
                          "token_strs": strs}
        else:
            resp.media = {"tokens": seqs[0], "count": len(seqs[0]), "max_model_len": st.context_len,
                          "token_strs": strs[0] if strs is not None else None}


class Detokenize:
    """POST /detokenize: `{"text", "prompt"}`, the decoded text under SGLang's name (`text`) and
    vLLM's (`prompt`); per-sequence lists for a batch."""

    def __init__(self, state: ServeState):
        self.state = state

    def on_post(self, req, resp) -> None:
        st = self.state
        vocab = st.engine.model_info.vocab_size
        with Admission(st):
            dreq, ti = begin(st, req, lambda body: parse_detokenize(body, vocab))
            texts = []
            for ids in dreq.sequences:
                try:
                    texts.append(ti.tokenizer.decode(ids, skip_special_tokens=dreq.skip_special_tokens) if ids else "")
                except (TypeError, ValueError, OverflowError) as e:
                    # The ids are in the model's vocabulary; one the tokenizer still cannot decode
                    # (a model vocabulary padded past the tokenizer's) is the input's fault, not a 500.
                    raise bad_request(f"tokens could not be decoded: {type(e).__name__}", "tokens")
        text = texts if dreq.batch else texts[0]
        resp.media = {"text": text, "prompt": text}
