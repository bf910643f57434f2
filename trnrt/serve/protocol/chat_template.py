"""Rendering a chat request into prompt token ids (the chat template, tools, template kwargs).

One path for `/v1/chat/completions` and `/tokenize` with `messages`, so `/tokenize`'s count equals
the chat request's `usage.prompt_tokens`. Runs on the waitress worker thread with that thread's
tokenizer, never on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from trnrt.serve import prompt_cache
from trnrt.serve.http.errors import bad_request


@dataclass
class RenderedPrompt:
    text: str
    ids: list[int]
    # The prompt ends with `<think>`: the output starts inside the reasoning block.
    forced_reasoning: bool


def apply_template_defaults(creq, defaults: dict) -> None:
    """Server defaults (--default-chat-template-kwargs) under the request's kwargs; the effective
    enable_thinking decides whether the reasoning parser runs."""
    creq.template_kwargs = {**defaults, **creq.template_kwargs}
    thinking = creq.template_kwargs.get("enable_thinking", creq.template_kwargs.get("thinking", True))
    creq.enable_thinking = thinking is not False


def render_chat(tokenizer, creq, *, add_generation_prompt: bool = True, max_tokens: int | None = None,
                trust_request_template: bool = False) -> RenderedPrompt:
    """The prompt of a parsed ChatRequest (trnrt.serve.protocol.openai), or a 400 naming `messages`.

    `max_tokens`: refuse (without tokenizing) messages that cannot fit in that many tokens.
    `trust_request_template` (ServeSettings.trust_request_chat_template): render the client's own
    template (`creq.chat_template`) in the bounded sandbox of protocol.template_sandbox; without
    it such a request is a 400 naming the field the template came in.
    """
    client_template = getattr(creq, "chat_template", None)
    template_param = getattr(creq, "chat_template_param", "chat_template_kwargs")
    if client_template is not None and not trust_request_template:
        # Refused before any work: a client's Jinja template runs on the server (vLLM refuses it the
        # same way without --trust-request-chat-template).
        where = "chat_template" if template_param == "chat_template" else "chat_template_kwargs.chat_template"
        raise bad_request(f"{where} is refused: this server renders only its own chat template (start it with "
                          "--trust-request-chat-template to allow client templates)", template_param)
    if max_tokens is not None:
        # The template only adds text: messages that alone cannot fit are refused before rendering.
        chars = sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in creq.messages)
        at_least = -(-chars // max_token_chars(tokenizer))
        if at_least >= max_tokens:
            raise bad_request(f"The input (at least {at_least} tokens) is longer than the model's context length "
                              f"({max_tokens} tokens): messages must tokenize to fewer than {max_tokens} tokens.",
                              "messages")
    kwargs = dict(creq.template_kwargs)
    kwargs.setdefault("enable_thinking", creq.enable_thinking)
    # tool_choice "none": the tools are left out of the prompt too (vLLM's
    # --exclude-tools-when-tool-choice-none), so the model is not invited to call them.
    tools = creq.tools if creq.tool_choice != "none" else None
    if client_template is not None:
        text = _render_client(tokenizer, creq, client_template, template_param, tools, add_generation_prompt,
                              kwargs, max_tokens)
    else:
        try:
            text = tokenizer.apply_chat_template(creq.messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
        except Exception as e:  # jinja2 TemplateError (raise_exception), TypeError from odd kwargs, ...
            raise bad_request(f"messages could not be rendered by the chat template: {e}", "messages")
    if not isinstance(text, str):
        raise bad_request("the chat template did not render a string", "messages")
    def encode() -> list[int]:
        return encode_text(tokenizer, text, "messages", add_special_tokens=False, max_tokens=max_tokens)

    cache = prompt_cache.active() if client_template is None else None
    if cache is not None and cache.enabled and _may_fit(tokenizer, text, max_tokens):
        # the previous turn's ids + the tail, checked against this full render (trnrt.serve.prompt_cache)
        ids = cache.encode(tokenizer, creq.messages, {"tools": tools, "kwargs": kwargs,
                                                      "add_generation_prompt": add_generation_prompt}, text, encode)
    else:
        ids = encode()
    if not ids:
        raise bad_request("messages rendered to an empty prompt", "messages")
    return RenderedPrompt(text, ids, text.rstrip().endswith("<think>"))


def _render_client(tokenizer, creq, source: str, param: str, tools, add_generation_prompt: bool, kwargs: dict,
                   max_tokens: int | None) -> str:
    """A client template rendered in the sandbox with HF's variables; any failure is a 400 naming
    the field the template came in (the template is what the client got wrong)."""
    from trnrt.serve.http.errors import safe
    from trnrt.serve.protocol.template_sandbox import (Limits, TemplateLimitError, render_client_template,
                                                       template_variables)

    limits = Limits()
    if max_tokens is not None:
        # No text longer than this can fit the context (the lower bound of encode_text): stop there.
        limits = Limits(max_output_chars=min(limits.max_output_chars, max_tokens * max_token_chars(tokenizer)))
    where = "chat_template" if param == "chat_template" else "chat_template_kwargs.chat_template"
    try:
        return render_client_template(source, template_variables(tokenizer, creq.messages, tools,
                                                                 add_generation_prompt, kwargs), limits)
    except TemplateLimitError as e:
        raise bad_request(f"{where} was stopped: {e}", param)
    except RecursionError:
        raise bad_request(f"{where} could not be rendered: it nests or recurses too deeply", param)
    except Exception as e:  # syntax errors, raise_exception, undefined names, TypeError, MemoryError, ...
        raise bad_request(f"{where} could not be rendered: {type(e).__name__}: {safe(str(e))[:300]}", param)


_MAX_TOKEN_CHARS: dict[int, tuple[object, int]] = {}


def max_token_chars(tokenizer) -> int:
    """The longest token of `tokenizer`, in characters (cached per tokenizer object).

    No token covers more text than its own string (a byte-level BPE token of k characters stands for
    k bytes, hence at most k characters), so a text of N characters needs at least
    ceil(N / max_token_chars) tokens: a lower bound that never refuses a prompt that fits.
    """
    hit = _MAX_TOKEN_CHARS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    longest = 1 << 30  # no bound
    try:
        if _byte_level_without_unk(tokenizer):
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    except Exception:  # a tokenizer without these views: no bound
        pass
    _MAX_TOKEN_CHARS[id(tokenizer)] = (tokenizer, max(1, longest))
    return max(1, longest)


def _byte_level_without_unk(tokenizer) -> bool:
    """The bound holds for byte-level BPE with no unknown token and no normalizer (GLM's
    tokenizers): every input byte is covered by some token's characters. A WordPiece `[UNK]` or a
    normalizer can cover more text than the token's own string, so those get no bound."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    return (model.get("type") == "BPE" and not model.get("unk_token") and spec.get("normalizer") is None
            and '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer")))


def _may_fit(tokenizer, text: str, max_tokens: int | None) -> bool:
    """False when encode_text's lower bound refuses `text` (the full path then raises its 400)."""
    return max_tokens is None or -(-len(text) // max_token_chars(tokenizer)) < max_tokens


def encode_text(tokenizer, text: str, param: str, *, add_special_tokens: bool = False,
                max_tokens: int | None = None) -> list[int]:
    """Tokenize `text`; text the tokenizer cannot take (lone surrogates) is a 400 naming `param`.

    With `max_tokens` (the context length), a text that cannot possibly fit is refused before it is
    tokenized (tokenizing a 3 MB message took ~700 MB and 6 s of CPU), from the bound above.
    """
    if max_tokens is not None:
        at_least = -(-len(text) // max_token_chars(tokenizer))
        if at_least >= max_tokens:
            raise bad_request(f"The input (at least {at_least} tokens) is longer than the model's context length "
                              f"({max_tokens} tokens): {param} must tokenize to fewer than {max_tokens} tokens.",
                              param)
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, UnicodeError, ValueError) as e:
        raise bad_request(f"{param} could not be tokenized: {type(e).__name__}", param)
