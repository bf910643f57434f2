"""Request parsing and validation for /tokenize and /detokenize (also under /v1/).

SGLang 0.5.23 and vLLM 0.33 both serve these routes; one body format accepts both spellings:

- `/tokenize` takes exactly one of `prompt` (a string, or a list of strings for a batch) or
  `messages` (the chat form: `tools`, `tool_choice`, `chat_template_kwargs`, `reasoning_effort`,
  `add_generation_prompt`, read by the chat route's own parser so the rendered prompt is the one
  `/v1/chat/completions` would submit). `add_special_tokens` defaults to true for `prompt` and to
  false for `messages` (the rendered template already holds the special tokens; vLLM's default,
  and what makes `count` equal the chat request's `usage.prompt_tokens`). vLLM's
  `return_token_strs` is served.
- `/detokenize` takes `tokens`: a list of ids, or a list of lists for a batch, each id an int in
  [0, vocab) (checked here, so a bad id is a 400 naming `tokens`, not SGLang's 500).

Everything here raises `bad_request(message, field)`. Pure Python (no tokenizer): the handler
(trnrt.serve.handlers.tokenize) does the tokenizer work on the request thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trnrt.serve.http.errors import bad_request, safe, unsupported
from trnrt.serve.protocol.fields import is_int, is_text, read_bool, read_str, refuse_unserved
from trnrt.serve.protocol.openai import ChatRequest, parse_chat

log = logging.getLogger("trnrt.serve")

# A batch larger than this is refused: each item is a tokenizer call on a waitress thread, and the
# body limit (ServeSettings.max_request_bytes) alone would allow ~10^5 tiny ones.
MAX_BATCH = 1024

# The tokenizer routes read at most this much body (or the server's smaller --max-request-bytes):
# all of it is tokenizer work on a waitress thread; 2 MiB of text is ~500k tokens, past any context.
MAX_BODY_BYTES = 2 << 20

# The body keys that shape the rendered chat prompt; only these reach the chat parser, so its
# sampling defaults are the chat route's and it warns about nothing that belongs to /tokenize.
CHAT_RENDER_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
                      "continue_final_message")

TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs", "add_generation_prompt",
                   "chat_template", "mm_processor_kwargs", "media_io_kwargs", *CHAT_RENDER_FIELDS}
DETOKENIZE_FIELDS = {"model", "tokens", "skip_special_tokens"}


@dataclass
class TokenizeRequest:
    """A validated /tokenize body: either `prompts` (the prompt form) or `chat` (the messages form).

    batch: `prompt` was a list, so the response's `tokens`/`count`/`token_strs` are lists per prompt.
    """

    model: str | None
    prompts: list[str] | None
    chat: ChatRequest | None
    batch: bool
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


@dataclass
class DetokenizeRequest:
    """A validated /detokenize body. batch: `tokens` was a list of lists (the response's `text`
    and `prompt` are then lists)."""

    model: str | None
    sequences: list[list[int]]
    batch: bool
    skip_special_tokens: bool


def _warn_unknown(body: dict, allowed: set[str]) -> None:
    # As on the other routes (and in SGLang/vLLM): unknown fields are ignored, with a warning.
    unknown = [k for k in body if k not in allowed]
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(safe(repr(k)) for k in unknown[:16]))


def _present(body: dict, name: str) -> bool:
    # SGLang's pydantic model treats an explicit null like an absent field.
    return body.get(name) is not None


def parse_tokenize(body: dict) -> TokenizeRequest:
    """Validate a /tokenize body (either form); a 400 naming the field otherwise."""
    _warn_unknown(body, TOKENIZE_FIELDS)
    model = read_str(body, "model", None)
    has_prompt, has_messages = _present(body, "prompt"), _present(body, "messages")
    if has_prompt == has_messages:
        raise bad_request("Exactly one of 'prompt' or 'messages' must be provided.",
                          "messages" if has_messages else "prompt")
    # Served only as "off", on both forms (it means nothing for a prompt either).
    refuse_unserved(body, ["continue_final_message"])
    if _present(body, "chat_template"):
        # The model's own template is the only one the chat route renders with; a different one
        # would make the count disagree with /v1/chat/completions.
        raise unsupported("chat_template", "is not supported: the server renders with the model's chat template")
    return_token_strs = read_bool(body, "return_token_strs", False)
    add_generation_prompt = read_bool(body, "add_generation_prompt", True)

    if has_prompt:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompts, batch = [prompt], False
        elif isinstance(prompt, list):
            if not prompt:
                raise bad_request("prompt must be a string or a non-empty list of strings", "prompt")
            if not all(isinstance(p, str) for p in prompt):
                raise bad_request("prompt must be a string or a list of strings", "prompt")
            if len(prompt) > MAX_BATCH:
                raise bad_request(f"prompt accepts at most {MAX_BATCH} strings, got {len(prompt)}", "prompt")
            prompts, batch = list(prompt), True
        else:
            raise bad_request(f"prompt must be a string or a list of strings, got {type(prompt).__name__}",
                              "prompt")
        if not all(is_text(p) for p in prompts):
            raise bad_request("prompt is not valid Unicode (it holds a lone surrogate)", "prompt")
        return TokenizeRequest(model, prompts, None, batch, read_bool(body, "add_special_tokens", True),
                               add_generation_prompt, return_token_strs)

    chat = parse_chat({k: body[k] for k in CHAT_RENDER_FIELDS if k in body})
    return TokenizeRequest(model, None, chat, False, read_bool(body, "add_special_tokens", False),
                           add_generation_prompt, return_token_strs)


def _ids(seq: list, vocab_size: int, where: str) -> list[int]:
    for t in seq:
        if not is_int(t):  # bools, floats (even 2.0), strings, nested lists
            raise bad_request(f"tokens must hold integer token ids; {where} holds {safe(repr(t))[:40]}", "tokens")
        if not 0 <= t < vocab_size:
            raise bad_request(f"tokens holds {t} in {where}, outside the vocabulary [0, {vocab_size})", "tokens")
    return list(seq)


def parse_detokenize(body: dict, vocab_size: int) -> DetokenizeRequest:
    """Validate a /detokenize body against a vocabulary of `vocab_size` ids."""
    _warn_unknown(body, DETOKENIZE_FIELDS)
    model = read_str(body, "model", None)
    skip = read_bool(body, "skip_special_tokens", True)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens is required and must be a list of token ids or a list of lists of token ids",
                          "tokens")
    if tokens and all(isinstance(s, list) for s in tokens):
        if len(tokens) > MAX_BATCH:
            raise bad_request(f"tokens accepts at most {MAX_BATCH} sequences, got {len(tokens)}", "tokens")
        return DetokenizeRequest(model, [_ids(s, vocab_size, f"tokens[{i}]") for i, s in enumerate(tokens)],
                                 True, skip)
    # `[]` is one empty sequence (SGLang answers ""); a list mixing ids and lists fails in _ids.
    return DetokenizeRequest(model, [_ids(tokens, vocab_size, "tokens")], False, skip)


__all__ = ["TokenizeRequest", "DetokenizeRequest", "parse_tokenize", "parse_detokenize", "MAX_BATCH",
           "MAX_BODY_BYTES"]
