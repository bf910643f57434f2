"""ScriptedRunner: a runner that replays scripted token ids in place of the model. Pure Python.

`Engine.scripted(tokenizer, script)` puts it behind the real Engine, so API tests (and
`trnrt serve --scripted`) run the real scheduler, stop checks, detokenizer, streams, stats and page
and slot accounting, with outputs known in advance. A script maps a request's prompt token ids to
the output token ids it should produce; the runner hands them out one per sampled row, as if the
model had sampled them.

How rows map to requests (`RowInput.request_id`, `RowInput.do_sample`):
- A request's prompt is what is fed from position 0 up to its first sampled row (chunked prefill
  feeds it over several rows). `script(prompt)` is called once, at that first sampled row.
- The sampled row's output index is `start_pos + len(token_ids) - len(prompt)`: 0 for the first
  token, then one more per decode. A preempted request re-prefills prompt + outputs from position
  0; its recorded prompt stays the one first seen, so it resumes at the right index.
- When the script is exhausted the runner returns `eos_token_id` (the model's first EOS id), so
  the stop checker ends the request with "stop" (unless the request ignores EOS: then it keeps
  getting EOS until max_new_tokens, as a model that only says EOS would).
- A script that raises, or returns an id outside the vocabulary, fails that request only
  (`RowResult.error`); the other rows of the step go on.
- A row with a token bitmask (structured outputs) honours it as the model's sampler would: a
  scripted token the mask forbids is replaced by an EOS id when one is allowed, else by the
  lowest allowed id (`num_masked_tokens` counts the replacements).
- Logprobs are deterministic fake values: the chosen token first among `top`, `num_logprobs`
  entries, decreasing. Prompt logprobs (a row with `prompt_next_ids`) likewise, per fed position
  q: `prompt_logprob(q)` for the predicted id, rank 1, first among `num_prompt_logprobs` entries.

Per-request records are dropped by `release()`, which the Engine calls whenever a request
finishes, so the runner holds state only for live requests.

State, simulated (so the prefix cache's bookkeeping is checked exactly, without a model): a slot
"holds" the token ids fed into it since its last `start_pos == 0` row, and a page holds the ids at
its positions. The prefix cache's CacheOps copy those like the model runner copies tensors. A row
whose slot does not hold exactly `start_pos` tokens, or (on a request's first row after admission)
whose block table's pages do not hold its tokens, fails with a "state mismatch" error: a resumed
request that would compute from a wrong state cannot pass silently. A request admitted at
`start_pos > 0` (resumed from the cache) takes its prompt's head from its slot.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from trnrt.engine.output.outputs import RowInput, RowResult, TokenLogprob

log = logging.getLogger(__name__)

Script = Callable[[list[int]], list[int]]


def echo_script(prompt_ids: list[int]) -> list[int]:
    """The script of `trnrt serve --scripted`: the last 16 prompt tokens, reversed."""
    return list(reversed(prompt_ids[-16:]))


def _allowed(mask, token: int) -> bool:
    """Bit `token` of a packed int32 token bitmask row (xgrammar's layout)."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class PauseSwitch:
    """An Event-like flag (set / clear / is_set) that `ScriptedRunner.execute` waits on while set.

    Tests set it to hold the engine inside a step (requests pile up in the inbox and the queue),
    then clear it to let the step finish.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._set = False
        self.holding = threading.Event()  # set while a caller is blocked in wait_while_set

    def set(self) -> None:
        with self._cond:
            self._set = True

    def clear(self) -> None:
        with self._cond:
            self._set = False
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._set

    def wait_while_set(self) -> None:
        """Block until the switch is cleared (returns at once if it is not set)."""
        with self._cond:
            while self._set:
                self.holding.set()
                self._cond.wait()
            self.holding.clear()


@dataclass
class _Record:
    """What the runner knows about one live request."""

    prompt: list[int]
    outputs: list[int] | None = None  # script(prompt), from the first sampled row on
    error: str | None = None  # the script failed: every later sampled row fails too


class ScriptedRunner:
    """Same contract as ModelRunner.execute (one RowResult per row, in order), no model.

    Args:
        script: prompt token ids -> output token ids (called once per request, on the engine
            thread). An exception fails that request only.
        eos_token_id: returned once the script is exhausted (so the request stops).
        vocab_size: scripted ids must lie in [0, vocab_size); fake top-logprob ids wrap around it.
        step_delay_s: sleep per `execute` call, so that streams last (disconnect and abort tests).

    Attributes:
        paused: a PauseSwitch; while it is set, `execute` blocks (the engine thread is held inside
            a step; requests keep arriving in its inbox).
        num_execute_calls: steps run so far.
    """

    def __init__(self, script: Script, *, eos_token_id: int, vocab_size: int, step_delay_s: float = 0.0,
                 block_size: int = 16):
        if not isinstance(eos_token_id, int) or not (0 <= eos_token_id < vocab_size):
            raise ValueError(f"eos_token_id must be a token id in [0, {vocab_size}), got {eos_token_id!r}")
        self.script = script
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.paused = PauseSwitch()
        self.num_execute_calls = 0
        self._records: dict[str, _Record] = {}  # engine thread only
        self.block_size = block_size
        # simulated state (see the module docstring)
        self._slots: dict[int, tuple[int, ...]] = {}
        self._pages: dict[int, list[int | None]] = {}
        self._ckpts: dict[int, tuple[int, ...]] = {}
        self._host_ckpts: dict[int, tuple[int, ...]] = {}
        self._host_pages: dict[int, list[int | None]] = {}
        self.num_cache_ops: dict[str, int] = {}
        self.num_state_mismatches = 0
        self.num_masked_tokens = 0
        self.eos_token_ids: tuple[int, ...] = (eos_token_id,)  # the Engine sets every EOS id

    # -- the runner contract (engine thread) -------------------------------------------------

    def thread_context(self):
        """Entered around the engine thread's loop: nothing to set up (no torch)."""
        return contextlib.nullcontext()

    def execute(self, rows: list[RowInput]) -> list[RowResult]:
        """One step: for each row that samples, the next scripted token of its request (see the
        module docstring); partial prefill chunks get a placeholder result the engine ignores."""
        self.paused.wait_while_set()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_execute_calls += 1
        return [self._row(r) for r in rows]

    def apply_cache_ops(self, ops) -> None:
        """The prefix cache's copies, on the simulated state (a missing source raises: the engine
        then fails the step, as a real copy failure would)."""
        for op in ops:
            self.num_cache_ops[op.kind] = self.num_cache_ops.get(op.kind, 0) + 1
            for a, b in zip(op.src, op.dst):
                if op.kind == "save_slot":
                    self._ckpts[b] = self._slots.get(a, ())
                elif op.kind == "load_slot":
                    self._slots[b] = self._ckpts[a]
                elif op.kind == "load_slot_host":
                    self._slots[b] = self._host_ckpts[a]
                elif op.kind == "pages_to_host":
                    self._host_pages[b] = list(self._pages[a])
                elif op.kind == "pages_to_device":
                    self._pages[b] = list(self._host_pages[a])
                elif op.kind == "ckpt_to_host":
                    self._host_ckpts[b] = self._ckpts[a]
                elif op.kind == "copy_pages":
                    self._pages[b] = list(self._pages[a])
                else:
                    raise ValueError(f"unknown cache op {op.kind!r}")

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests (the Engine calls this for every finish)."""
        for rid in request_ids:
            self._records.pop(rid, None)

    def flush_cache(self) -> None:
        """The engine is idle and flushes its caches: no request is live, so no record should be
        left; drop any (a finish the engine failed to report must not pin memory forever)."""
        self._records.clear()
        self._ckpts.clear()
        self._host_ckpts.clear()
        self._host_pages.clear()

    # -- introspection (tests) ----------------------------------------------------------------

    @property
    def num_records(self) -> int:
        """Requests the runner holds state for (0 once the engine is idle)."""
        return len(self._records)

    def recorded_prompt(self, request_id: str) -> list[int] | None:
        """The prompt recorded for a live request (None if unknown)."""
        rec = self._records.get(request_id)
        return None if rec is None else list(rec.prompt)

    # -- internals -----------------------------------------------------------------------------

    def _state(self, row: RowInput) -> str | None:
        """Check and advance the simulated state of `row`'s slot and pages; an error or None."""
        hist = () if row.start_pos == 0 else self._slots.get(row.slot_id, ())
        bs = self.block_size
        error = None
        if len(hist) != row.start_pos:
            error = f"slot {row.slot_id} holds {len(hist)} tokens, row starts at {row.start_pos}"
        else:
            full = row.start_pos // bs
            for i in range(full + (1 if row.start_pos % bs else 0)):
                lo, hi = i * bs, min((i + 1) * bs, row.start_pos)
                page = self._pages.get(row.block_ids[i]) if i < len(row.block_ids) else None
                if page is None or page[:hi - lo] != list(hist[lo:hi]):
                    error = f"page {row.block_ids[i] if i < len(row.block_ids) else None} does not hold positions {lo}..{hi - 1}"
                    break
        if error is not None:
            self.num_state_mismatches += 1
            return f"scripted runner: state mismatch for {row.request_id!r}: {error}"
        self._slots[row.slot_id] = tuple(hist) + tuple(row.token_ids)
        for i, t in enumerate(row.token_ids):
            p = row.start_pos + i
            page = self._pages.setdefault(row.block_ids[p // bs], [None] * bs)
            page[p % bs] = t
        return None

    def _row(self, row: RowInput) -> RowResult:
        res = self._row_tokens(row)
        if row.prompt_next_ids is not None and res.error is None:
            res.prompt_logprobs = [self._prompt_logprob(row.start_pos + i, t, row.num_prompt_logprobs)
                                   for i, t in enumerate(row.prompt_next_ids)]
        return res

    @staticmethod
    def prompt_logprob(position: int) -> float:
        """The fake logprob the runner reports for the prompt token after `position`."""
        return -1.0 - 0.01 * (position % 50)

    def _prompt_logprob(self, q: int, token: int, n: int) -> TokenLogprob:
        lp = self.prompt_logprob(q)
        top = [(token, lp)] + [((token + k) % self.vocab_size, lp - 0.5 * k) for k in range(1, max(n, 1))]
        return TokenLogprob(token_id=token, logprob=lp, top=top[:n], rank=1)

    def _row_tokens(self, row: RowInput) -> RowResult:
        rid = row.request_id
        rec = self._records.get(rid)
        state_error = self._state(row)
        # A new request, or one preempted before its first token (it re-prefills from 0 and has
        # no outputs to keep): start its prompt afresh. One admitted mid-prompt (resumed from the
        # prefix cache) takes the prompt's head from its slot.
        if rec is None or (rec.outputs is None and row.start_pos == 0):
            rec = self._records[rid] = _Record(prompt=[])
            if row.start_pos > 0 and state_error is None:
                rec.prompt = list(self._slots[row.slot_id][:row.start_pos])
        if state_error is not None and rec.error is None:
            rec.error = state_error
        if rec.outputs is None and rec.error is None:
            if row.start_pos != len(rec.prompt):
                # Chunks of one prompt arrive in order; a gap means the engine lost track of this
                # request (e.g. a record released too early): fail it rather than guess.
                rec.error = (f"scripted runner: {rid!r} fed at position {row.start_pos}, "
                             f"expected {len(rec.prompt)}")
            else:
                rec.prompt.extend(row.token_ids)
        if rec.error is not None:
            return RowResult(token_id=self.eos_token_id, error=rec.error)
        if not row.do_sample:
            return RowResult(token_id=self.eos_token_id)
        if rec.outputs is None and rec.error is None:
            try:
                rec.outputs = [int(t) for t in self.script(list(rec.prompt))]
            except Exception as e:  # the script's failure is this request's failure only
                log.info("script failed for %s: %s", rid, e)
                rec.error = f"{type(e).__name__}: {e}"
        if rec.error is not None:
            return RowResult(token_id=self.eos_token_id, error=rec.error)
        index = row.start_pos + len(row.token_ids) - len(rec.prompt)
        if index < 0:
            rec.error = f"scripted runner: {rid!r} sampled inside its prompt (output index {index})"
            return RowResult(token_id=self.eos_token_id, error=rec.error)
        assert rec.outputs is not None
        token = rec.outputs[index] if index < len(rec.outputs) else self.eos_token_id
        if row.token_bitmask is not None and 0 <= token < self.vocab_size and not _allowed(row.token_bitmask, token):
            token = self._masked_choice(row.token_bitmask)
        if not (0 <= token < self.vocab_size):
            rec.error = f"scripted runner: the script gave token id {token}, outside [0, {self.vocab_size})"
            return RowResult(token_id=self.eos_token_id, error=rec.error)
        lp = None if row.num_logprobs is None else self._logprob(token, index, row.num_logprobs)
        return RowResult(token_id=token, logprob=lp)

    def _masked_choice(self, mask) -> int:
        self.num_masked_tokens += 1
        for e in self.eos_token_ids:
            if _allowed(mask, e):
                return e
        words = [int(w) for w in mask.tolist()] if hasattr(mask, "tolist") else [int(w) for w in mask]
        for w, word in enumerate(words):
            word &= 0xFFFFFFFF
            if word:
                t = 32 * w + ((word & -word).bit_length() - 1)
                if t < self.vocab_size:
                    return t
        return self.eos_token_id  # the engine never sends an all-zero mask

    def _logprob(self, token: int, index: int, n: int) -> TokenLogprob:
        # Deterministic, negative, and the chosen token ranks first: enough for the logprob plumbing.
        lp = -0.05 - 0.1 * (index % 7)
        top = [(token, lp)] + [((token + k) % self.vocab_size, lp - 0.5 * k) for k in range(1, n)]
        return TokenLogprob(token_id=token, logprob=lp, top=top[:n])
