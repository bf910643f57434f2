"""DynamicSpeculation: which requests speculate, under a dynamic preset (pure Python, no model).

A verify emits its accepted drafts plus one token. Speculation pays while a row's tokens per
verify exceed what a speculative step costs in plain decode steps of the same batch: `StepCosts`
measures both on the running engine, per decode batch bucket (the runner times its steps), so
the line follows the machine, the graphs (eager or compiled) and the batch size: a verify of
k + 1 tokens costs about one decode step where decoding is memory-bound (GPU, Trainium), 3-7 on a
2-core CPU (docs/PERFORMANCE.md). The line is that ratio, or `min_accept_length` where it is
higher (the configured floor; the only line until both costs are measured). Two pieces of
evidence decide:

* each request's own verifies: after `probe_verifies` of them, a request whose average is below
  the line goes on with plain decode steps;
* the engine's last `window` verifies, every request's: while they hold at least
  `probe_verifies` verifies and average below the line, a new request speculates only if it is
  the `probe_every`-th one gated (the probes keep measuring), and a speculating request falls
  back after its first verify below the line, unless its own average so far is above it.

The second rule is what bounds the cost of speculating where nothing is accepted: the first
batch of requests pays one verify each instead of `probe_verifies`, and later requests pay
one verify in `probe_every` requests (docs/PERFORMANCE.md measures it). A request whose drafts
do pay keeps speculating whatever the others do.
"""

from __future__ import annotations

import collections


class StepCosts:
    """Seconds per runner step, per decode batch bucket: speculative steps (draft, verify,
    rollback) and plain decode steps, each an exponential average. The first speculative step of
    a bucket is not counted (graph loading and first-call work would make speculation look dear)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = float(alpha)
        self._spec: dict[int, float] = {}
        self._plain: dict[int, float] = {}
        self._seen_spec: set[int] = set()

    def _add(self, table: dict[int, float], bucket: int, seconds: float) -> None:
        old = table.get(bucket)
        table[bucket] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe_spec(self, bucket: int, seconds: float) -> None:
        if bucket not in self._seen_spec:
            self._seen_spec.add(bucket)
            return
        self._add(self._spec, bucket, seconds)

    def observe_plain(self, bucket: int, seconds: float) -> None:
        self._add(self._plain, bucket, seconds)

    def has_plain(self, bucket: int) -> bool:
        return bucket in self._plain

    def break_even(self, bucket: int) -> float | None:
        """Tokens per verify at which a speculative step of this bucket costs what plain decode
        steps emitting as many tokens cost (None until both are measured)."""
        spec, plain = self._spec.get(bucket), self._plain.get(bucket)
        if spec is None or not plain:
            return None
        return spec / plain

    def snapshot(self) -> dict[int, dict[str, float | None]]:
        """{bucket: {"spec_s", "plain_s", "break_even"}} (stats, logs)."""
        return {b: {"spec_s": self._spec.get(b), "plain_s": self._plain.get(b), "break_even": self.break_even(b)}
                for b in sorted(set(self._spec) | set(self._plain))}


class DynamicSpeculation:
    """The dynamic-speculation bookkeeping of one engine (engine thread only).

    min_accept_length > 0: the least tokens per verify that pay (a floor under the measured
    break-even, `break_even`, which the engine sets from StepCosts); probe_verifies: verifies a request
    gets before its own average decides; probe_every: one gated new request in this many still
    speculates; window: how many recent verifies (all requests) the engine-wide average covers.
    """

    def __init__(self, min_accept_length: float, probe_verifies: int = 4, probe_every: int = 16,
                 window: int = 100):
        if min_accept_length <= 0:
            raise ValueError("min_accept_length must be > 0 for dynamic speculation")
        self.min_accept_length = float(min_accept_length)
        self.probe_verifies = max(1, int(probe_verifies))
        self.probe_every = max(1, int(probe_every))
        self._own: dict[str, list[int]] = {}  # request -> [verifies, tokens]
        self._recent: collections.deque[int] = collections.deque(maxlen=max(1, int(window)))
        self._recent_tokens = 0
        self._gated = 0  # new requests the gate saw while closed
        self.num_gated = 0  # new requests started plain by the gate (stats / tests)
        self.break_even: float | None = None  # measured (StepCosts), set by the engine

    @property
    def line(self) -> float:
        """Tokens per verify below which speculating does not pay: the measured break-even of
        the latest speculative step's bucket, or min_accept_length where that is higher."""
        return max(self.min_accept_length, self.break_even or 0.0)

    def _recent_low(self) -> bool:
        n = len(self._recent)
        return n >= self.probe_verifies and self._recent_tokens < self.line * n

    def admit(self) -> bool:
        """Whether a new request speculates (the gate: see the module doc)."""
        if not self._recent_low():
            return True
        self._gated += 1
        if self._gated % self.probe_every == 0:
            return True
        self.num_gated += 1
        return False

    def record(self, request_id: str, num_accepted: int) -> None:
        """One verify of `request_id` accepted `num_accepted` drafts (it emitted one more token)."""
        tokens = int(num_accepted) + 1
        own = self._own.setdefault(request_id, [0, 0])
        own[0] += 1
        own[1] += tokens
        if len(self._recent) == self._recent.maxlen:
            self._recent_tokens -= self._recent[0]
        self._recent.append(tokens)
        self._recent_tokens += tokens

    def should_fall_back(self, request_id: str) -> bool:
        """Whether `request_id` (recorded at least once) should go on with plain decode steps."""
        own = self._own.get(request_id)
        if own is None or own[1] >= self.line * own[0]:
            return False
        return own[0] >= self.probe_verifies or self._recent_low()

    def forget(self, request_id: str) -> None:
        """The request finished or fell back: drop its own counts."""
        self._own.pop(request_id, None)

    @property
    def recent_accept_length(self) -> float | None:
        """Tokens per verify over the recent window (None before any verify)."""
        return self._recent_tokens / len(self._recent) if self._recent else None
