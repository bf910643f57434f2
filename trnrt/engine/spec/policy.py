"""DynamicSpeculation: which requests speculate, under a dynamic preset (pure Python, no model).

A verify emits its accepted drafts plus one token. Speculation pays while the speculative rows'
tokens per verify exceed the step's break-even (`StepCosts.line`): the tokens per verify at which
this step, its plain decode rows in one call and its speculative rows (draft, verify, rollback)
in another, emits tokens as fast as one plain decode call over all its decode rows would. The
runner times both kinds of call per decode batch bucket on the running engine, so the line
follows the machine, the graphs (eager or compiled) and the batch: with no plain rows it is the
cost of a speculative call in plain calls of the same bucket (about 1 where decoding is
memory-bound, GPU and Trainium; 1.5-10 on a 2-core CPU: docs/PERFORMANCE.md); beside plain rows it
is higher, since those rows would have carried the speculative ones for little more.
`min_accept_length` is a floor under it (and the line until the costs are measured). Two pieces
of evidence decide:

* each request's own verifies: after `probe_verifies` of them, a request whose average is below
  the line goes on with plain decode steps; sooner where the verifies it has left before that
  could not lift its average to the line even if each emitted `max_tokens_per_verify` (k + 1:
  every draft accepted), which is after its first verify where the line is k + 1 or more (then
  speculation cannot pay at any acceptance, and the gate below stays closed too);
* the engine's last `window` verifies, every request's: while they hold at least
  `probe_verifies` verifies and average below the line, a speculating request falls back after
  its first verify below the line, and a new request speculates only as a probe (the
  `probe_every`-th one gated; each probe that falls back doubles that interval, up to
  `max_probe_every`; the gate opening resets it).

The second rule is what bounds the cost of speculating where nothing is accepted: the first
batch of requests pays one verify each instead of `probe_verifies`, and later requests pay one
verify in ever fewer requests. A request whose drafts do pay keeps speculating whatever the
others do.
"""

from __future__ import annotations

import collections


class StepCosts:
    """Seconds per runner call, per decode batch bucket: speculative calls (draft, verify,
    rollback of one group of rows) and plain decode calls, each an exponential average. The first
    speculative call of a bucket is not counted (graph loading and first-call work would make
    speculation look dear).

    bucket(n) -> the decode batch bucket of n rows (EngineConfig.decode_bucket); max_batch: the
    largest bucket (more rows run in several calls)."""

    def __init__(self, bucket, max_batch: int, alpha: float = 0.2):
        self.bucket = bucket
        self.max_batch = int(max_batch)
        self.alpha = float(alpha)
        self._spec: dict[int, float] = {}
        self._plain: dict[int, float] = {}
        self._seen_spec: set[int] = set()
        self._seeded: set[int] = set()  # buckets whose two costs are still the warm-up's estimate

    def _add(self, table: dict[int, float], bucket: int, seconds: float) -> None:
        old = table.get(bucket)
        table[bucket] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe_spec(self, bucket: int, seconds: float) -> None:
        if bucket not in self._seen_spec:
            self._seen_spec.add(bucket)
            return
        if bucket in self._seeded:  # the first measured speculative call replaces the estimate,
            self._seeded.discard(bucket)  # and the plain cost is measured again (missing_plain)
            self._spec[bucket] = seconds
            self._plain.pop(bucket, None)
            return
        self._add(self._spec, bucket, seconds)

    def seed(self, bucket: int, spec_s: float, plain_s: float) -> None:
        """A first estimate of a bucket's two costs (the runner's warm-up: its graphs' own call
        times), where nothing is measured yet. The two stay a pair, measured plain calls leaving
        it alone (they also count the step's Python work, which the graph times do not), until
        the first measured speculative call replaces both."""
        if bucket not in self._spec and bucket not in self._plain:
            self._spec[bucket], self._plain[bucket] = float(spec_s), float(plain_s)
            self._seeded.add(bucket)

    def observe_plain(self, bucket: int, seconds: float) -> None:
        if bucket in self._seeded:
            return
        self._add(self._plain, bucket, seconds)

    def buckets(self, n: int) -> list[int]:
        """The buckets of the calls n decode rows run in (none for 0 rows)."""
        full, rest = divmod(int(n), self.max_batch)
        return [self.max_batch] * full + ([self.bucket(rest)] if rest else [])

    def missing_plain(self, *counts: int) -> list[int]:
        """The buckets that `line` over these row counts needs a plain time for and has none."""
        need = {b for n in counts for b in self.buckets(n)}
        return sorted(b for b in need if b not in self._plain)

    def _time(self, table: dict[int, float], n: int) -> float | None:
        total = 0.0
        for b in self.buckets(n):
            if b not in table:
                return None
            total += table[b]
        return total

    def line(self, num_plain: int, num_spec: int) -> float | None:
        """The break-even tokens per verify of a step with `num_plain` plain decode rows and
        `num_spec` speculative rows: where (num_plain + num_spec * a) tokens in
        plain(num_plain) + spec(num_spec) seconds equal (num_plain + num_spec) tokens in
        plain(num_plain + num_spec) seconds. None until those times are measured."""
        if num_spec <= 0:
            return None
        spec = self._time(self._spec, num_spec)
        plain_all = self._time(self._plain, num_plain + num_spec)
        plain_rows = self._time(self._plain, num_plain) if num_plain else 0.0
        if spec is None or plain_rows is None or not plain_all:
            return None
        n = num_plain + num_spec
        return (n * (plain_rows + spec) / plain_all - num_plain) / num_spec

    def break_even(self, bucket: int) -> float | None:
        """The line of a step whose decode rows are `bucket` speculative rows and nothing else."""
        return self.line(0, bucket)

    def snapshot(self) -> dict[int, dict[str, float | None]]:
        """{bucket: {"spec_s", "plain_s", "break_even"}} (stats, logs); break_even: a step of
        speculative rows only."""
        spec, plain = dict(self._spec), dict(self._plain)  # copies: another thread may read this
        return {b: {"spec_s": spec.get(b), "plain_s": plain.get(b),
                    "break_even": spec[b] / plain[b] if b in spec and plain.get(b) else None}
                for b in sorted(set(spec) | set(plain))}


class DynamicSpeculation:
    """The dynamic-speculation bookkeeping of one engine (engine thread only).

    min_accept_length > 0: the least tokens per verify that pay (a floor under the measured
    break-even, `break_even`, which the engine sets from StepCosts.line each step);
    probe_verifies: verifies a request gets before its own average decides; probe_every: one
    gated new request in this many still speculates (at first; max_probe_every: the most it
    backs off to); window: how many recent verifies (all requests) the engine-wide average covers;
    max_tokens_per_verify: the most one verify emits (k + 1), None: no bound (no early fallback).
    """

    def __init__(self, min_accept_length: float, probe_verifies: int = 4, probe_every: int = 16,
                 window: int = 100, max_probe_every: int = 256, max_tokens_per_verify: int | None = None):
        if min_accept_length <= 0:
            raise ValueError("min_accept_length must be > 0 for dynamic speculation")
        self.min_accept_length = float(min_accept_length)
        self.probe_verifies = max(1, int(probe_verifies))
        self.probe_every = max(1, int(probe_every))
        self._own: dict[str, list[int]] = {}  # request -> [verifies, tokens]
        self._recent: collections.deque[int] = collections.deque(maxlen=max(1, int(window)))
        self._recent_tokens = 0
        self.max_probe_every = max(self.probe_every, int(max_probe_every))
        self.probe_interval = self.probe_every  # grows as probes fail, back to probe_every when the gate opens
        self._gated = 0  # new requests the gate saw while closed, since the last probe
        self._probes: set[str] = set()  # requests admitted as probes, still speculating
        self.num_gated = 0  # new requests started plain by the gate (stats / tests)
        self.break_even: float | None = None  # measured (StepCosts), set by the engine
        self.max_tokens_per_verify = None if max_tokens_per_verify is None else int(max_tokens_per_verify)

    @property
    def line(self) -> float:
        """Tokens per verify below which speculating does not pay: the measured break-even of
        the latest speculative step, or min_accept_length where that is higher."""
        return max(self.min_accept_length, self.break_even or 0.0)

    def _hopeless(self, line: float) -> bool:
        """No acceptance pays at this line: a verify emits at most max_tokens_per_verify."""
        return self.max_tokens_per_verify is not None and line >= self.max_tokens_per_verify

    def _recent_low(self, line: float | None = None) -> bool:
        n = len(self._recent)
        line = self.line if line is None else max(self.min_accept_length, line)
        return self._hopeless(line) or (n >= self.probe_verifies and self._recent_tokens < line * n)

    def admit(self, request_id: str = "", line: float | None = None) -> bool:
        """Whether a new request speculates (the gate: see the module doc). `line`: the
        break-even of the step it would join (StepCosts.line of the running decode rows plus
        it); None: the latest step's."""
        if not self._recent_low(line):
            self.probe_interval = self.probe_every
            return True
        self._gated += 1
        if self._gated >= self.probe_interval:
            self._gated = 0
            self._probes.add(request_id)
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
        line = self.line
        if own is None or own[1] >= line * own[0]:
            return False
        if own[0] >= self.probe_verifies or self._recent_low():
            return True
        if self.max_tokens_per_verify is not None:  # its probe verifies cannot reach the line any more
            best = own[1] + (self.probe_verifies - own[0]) * self.max_tokens_per_verify
            return best < line * self.probe_verifies
        return False

    def fell_back(self, request_id: str) -> None:
        """The request went on with plain steps (after should_fall_back): a probe that fails
        doubles the probe interval."""
        if request_id in self._probes:
            self.probe_interval = min(self.max_probe_every, self.probe_interval * 2)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """The request finished or fell back: drop its own counts."""
        self._own.pop(request_id, None)
        self._probes.discard(request_id)

    @property
    def recent_accept_length(self) -> float | None:
        """Tokens per verify over the recent window (None before any verify)."""
        return self._recent_tokens / len(self._recent) if self._recent else None
