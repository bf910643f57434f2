"""GrammarSpec: what a request's structured output asks for, as plain data. Pure Python.

The HTTP layer reads every API's spelling (OpenAI response_format, vLLM structured_outputs and
guided_*, SGLang json_schema / regex / ebnf / structural_tag, Responses text.format) into one
GrammarSpec on SamplingParams.grammar; the engine compiles it at submit, on the caller's thread
(trnrt.engine.sample.grammar), so the engine thread never waits for a compile.
"""

from __future__ import annotations

from dataclasses import dataclass

# "tool_call": tool_choice "required" / a named tool, a structural tag built by
# trnrt.engine.sample.tool_call_grammar (compiled against the vocabulary that keeps the tag tokens).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag", "tool_call")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint on a request's output.

    kind: one of GRAMMAR_KINDS. value: the grammar text (a JSON schema / structural tag as
    canonical JSON text, a regex, an EBNF grammar; "choice" holds a JSON list of strings;
    "tool_call" a structural tag as JSON text).
    param: the request field it came from, in the client's spelling (a grammar error is a 400
    naming it). after_token: when set (the id of `</think>` for a request that reasons), the
    grammar applies to the tokens after the first such token; before it the output is free.
    any_whitespace: JSON may hold whitespace between tokens (bounded, see trnrt.engine.sample.grammar);
    False: compact JSON (vLLM's disable_any_whitespace).
    """

    kind: str
    value: str
    param: str
    after_token: int | None = None
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")

    def with_after_token(self, token_id: int | None) -> "GrammarSpec":
        from dataclasses import replace

        return replace(self, after_token=token_id)
