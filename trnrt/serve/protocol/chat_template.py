"""Rendering a chat request into prompt token ids (the chat template, tools, template kwargs).

One path for `/v1/chat/completions` and `/tokenize` with `messages`, so `/tokenize`'s count equals
the chat request's `usage.prompt_tokens`. Runs on the waitress worker thread with that thread's
tokenizer, never on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def render_chat(tokenizer, creq, *, add_generation_prompt: bool = True) -> RenderedPrompt:
    """The prompt of a parsed ChatRequest (trnrt.serve.protocol.openai), or a 400 naming `messages`."""
    kwargs = dict(creq.template_kwargs)
    kwargs.setdefault("enable_thinking", creq.enable_thinking)
    # tool_choice "none": the tools are left out of the prompt too (vLLM's
    # --exclude-tools-when-tool-choice-none), so the model is not invited to call them.
    tools = creq.tools if creq.tool_choice != "none" else None
    try:
        text = tokenizer.apply_chat_template(creq.messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError (raise_exception), TypeError from odd kwargs, ...
        raise bad_request(f"messages could not be rendered by the chat template: {e}", "messages")
    if not isinstance(text, str):
        raise bad_request("the chat template did not render a string", "messages")
    ids = encode_text(tokenizer, text, "messages", add_special_tokens=False)
    if not ids:
        raise bad_request("messages rendered to an empty prompt", "messages")
    return RenderedPrompt(text, ids, text.rstrip().endswith("<think>"))


def encode_text(tokenizer, text: str, param: str, *, add_special_tokens: bool = False) -> list[int]:
    """Tokenize `text`; text the tokenizer cannot take (lone surrogates) is a 400 naming `param`."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, UnicodeError, ValueError) as e:
        raise bad_request(f"{param} could not be tokenized: {type(e).__name__}", param)
