"""Outputs that cross stage boundaries on their way to a client.

`RequestOutput` is the incremental unit the engine pushes onto a request's stream;
`SchedulerOutput` / `RunnerOutput` are the contract between the Scheduler and the ModelRunner.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trnrt.engine.request import FinishReason, SamplingParams


@dataclass
class TokenLogprob:
    """Logprob of one sampled token, with the top-N alternatives as (token_id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    # 1 + the number of tokens more likely than token_id (prompt logprobs only; vLLM's rank)
    rank: int | None = None

    def to_dict(self) -> dict:
        d = {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}
        if self.rank is not None:
            d["rank"] = self.rank
        return d


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
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (both tiers)
    num_cached_tokens_host: int = 0  # of those, tokens brought back from the host tier
    error: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs), on the request's first output only: one
    # entry per prompt position from SamplingParams.prompt_logprobs_start on, the prompt token's
    # logprob given the tokens before it with the top-N alternatives; position 0's entry is None.
    prompt_logprobs: list[TokenLogprob | None] | None = None


# -- Engine <-> runner (one row per scheduled sequence) ----------------------------------------


@dataclass
class RowInput:
    """One sequence's work for this step, as the engine hands it to a runner's `execute`.

    The model runner needs only the token/position/cache/sampling fields; `request_id` and
    `do_sample` are there for runners that keep per-request state (the scripted runner replays a
    script per request and must know which row ends a prompt). The model runner ignores both.
    """

    token_ids: list[int]  # the new tokens fed this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]  # the sequence's block table
    slot_id: int
    temperature: float
    top_p: float
    top_k: int  # -1 / 0 = disabled
    min_p: float
    seed: int
    num_logprobs: int | None  # None: no logprobs
    request_id: str = ""
    do_sample: bool = True  # False: a partial prefill chunk (its result is ignored)
    # Logits-processor inputs (trnrt.engine.sample.logits_processors); None = neutral (the row samples as
    # in the base graph). A batch where every row is neutral runs in the base graph.
    token_bitmask: Any = None  # structured outputs: [ceil(V/32)] int32, xgrammar's packed mask
    # penalties: the request's trnrt.engine.sample.penalties.PenaltyState (fills the dense scale/bias rows)
    penalties: Any = None
    # Prompt logprobs: the token each fed position predicts (the next prompt token; any id where
    # none is wanted), len(token_ids) of them, and the top-N width. Set only on prompt chunks of a
    # request that asked for prompt logprobs: the row then runs in the prompt-logprobs prefill
    # graph (even a one-token chunk) and its RowResult carries `prompt_logprobs`.
    prompt_next_ids: list[int] | None = None
    num_prompt_logprobs: int = 0
    # Speculative decoding (trnrt.engine.spec): `speculative` marks a request the drafter follows
    # (every chunk and step of it must feed the drafter); `spec_decode` a decode step of one, which
    # verifies `num_lookahead` drafts (0: a plain step through the verify path). `next_token_id`:
    # the known token after this chunk (a partial prompt chunk's next prompt token), else None.
    speculative: bool = False
    spec_decode: bool = False
    num_lookahead: int = 0
    next_token_id: int | None = None


@dataclass
class RowResult:
    """What a runner produced for one row: the sampled token (and its logprobs when asked).

    `error` set means this row (its request) failed inside the runner while the other rows of the
    step are fine: the engine finishes that request with an error and `token_id` is ignored. A
    runner whose whole step failed raises instead.
    """

    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None
    # RowInput.prompt_next_ids set: per fed position i, the logprob of prompt_next_ids[i] and the
    # top-N (num_prompt_logprobs) alternatives at i.
    prompt_logprobs: list[TokenLogprob] | None = None
    # A speculative decode row: the tokens emitted after `token_id` (accepted drafts then the
    # correction or bonus token: `token_id` is the first emitted), drafts verified and accepted.
    extra_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0
    num_accepted: int = 0


# -- Scheduler <-> ModelRunner --------------------------------------------------------------
#
# One engine step:  Scheduler.schedule() -> SchedulerOutput -> ModelRunner -> RunnerOutput
#                   -> Scheduler.update_from_output(SchedulerOutput, RunnerOutput)
# Both types are plain data (no Sequence objects), so a runner, a fake runner in a test, or a
# remote worker can produce a RunnerOutput without touching scheduler state.


@dataclass
class ScheduledSequence:
    """One sequence's work in a step: feed `token_ids` at positions
    `num_computed_tokens .. num_computed_tokens + num_new_tokens - 1`.

    `block_table` covers every position up to the last one fed; `slot_id` holds the sequence's
    recurrent state (num_computed_tokens == 0 means: start from an empty state). When `do_sample`
    is True the chunk reaches the end of the known tokens and the runner samples one token from
    the last position; a partial prefill chunk (`do_sample` False) only writes state.
    `is_prefill` is False exactly for a decode (one token fed on top of existing state).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    slot_id: int
    is_prefill: bool
    do_sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # tokens generated before this step (e.g. for min_tokens)
    # Speculative decoding: the request is followed by the drafter; a decode step of it may verify
    # `num_lookahead` drafts (the block table covers num_computed + 1 + num_lookahead tokens, and
    # the step's token budget counts them). `next_token_id`: the token after this chunk when known.
    speculative: bool = False
    num_lookahead: int = 0
    next_token_id: int | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def start_pos(self) -> int:
        """Position of token_ids[0] (== num_computed_tokens)."""
        return self.num_computed_tokens


CACHE_OP_KINDS = ("save_slot", "load_slot", "load_slot_host", "pages_to_host", "pages_to_device", "ckpt_to_host",
                  "copy_pages")


@dataclass(frozen=True)
class CacheOp:
    """A state copy the runner makes outside the step graphs (prefix cache; pure data).

    kinds (src -> dst, id lists of equal length):
      save_slot        slot ids -> device checkpoint ids  (KDA state, conv window, indexer tail)
      load_slot        device checkpoint ids -> slot ids
      load_slot_host   host checkpoint ids -> slot ids
      pages_to_host    device page ids -> host page ids    (MLA latents, pooled indexer keys)
      pages_to_device  host page ids -> device page ids
      ckpt_to_host     device checkpoint ids -> host checkpoint ids
      copy_pages       device page ids -> device page ids  (a fork's partial last page)
    """

    kind: str
    src: tuple[int, ...]
    dst: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in CACHE_OP_KINDS or len(self.src) != len(self.dst):
            raise ValueError(f"bad cache op {self!r}")


@dataclass
class SchedulerOutput:
    """What to run this step, in order: decodes first (by default), then prefill chunks.

    `preempted_request_ids`: sequences preempted during this schedule() (their pages and slot are
    already free; their state must not be read again). `finished_request_ids`: sequences that
    finished or were aborted since the previous schedule(), so the runner can drop per-request
    caches.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    step_id: int = 0
    # Prefix cache: copies to make before the step (host tier, checkpoint restores) and after it
    # (checkpoints of the state the step leaves in a slot), in order.
    cache_ops: list[CacheOp] = field(default_factory=list)
    snapshot_ops: list[CacheOp] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decodes(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if not s.is_prefill]

    @property
    def prefills(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if s.is_prefill]


@dataclass
class RunnerOutput:
    """What the runner produced for a SchedulerOutput, aligned with `SchedulerOutput.scheduled`.

    `sampled_token_ids[i]` is the token sampled for scheduled[i], or None when scheduled[i] was a
    partial prefill chunk (`do_sample` False; any value given there is ignored).
    `logprobs[i]` is set when that request asked for logprobs. `failed` maps request ids whose rows
    failed inside the runner to an error message: those requests finish with an abort and the
    others go on.
    """

    sampled_token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decode rows: the tokens emitted after sampled_token_ids[i] (None: none anywhere)
    extra_token_ids: list[list[int]] | None = None
