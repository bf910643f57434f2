"""Outputs that cross stage boundaries on their way to a client.

`RequestOutput` is the incremental unit the engine pushes onto a request's stream. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trnrt.engine.request import FinishReason


@dataclass
class TokenLogprob:
    """Logprob of one sampled token, with the top-N alternatives as (token_id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass
class RequestOutput:
    """One incremental update for one request.

    `new_token_ids` / `new_text` / `new_logprobs` hold only what is new since the previous update
    (text is held back while it could still be the start of a stop string or an incomplete UTF-8
    character). The final update has `finished=True` and a `finish_reason`; `error` is set when the
    request failed inside the engine (finish_reason.type == "abort" then).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
