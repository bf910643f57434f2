"""Scheduling policies: waiting-queue order, priority preemption, the queue limit. Pure Python.

SGLang 0.5.23's semantics (`srt/managers/schedule_policy.py`, `scheduler.py`), as pure functions
the Scheduler calls on the engine thread:

    validate_policy(config, cache_enabled)            at start-up; -> the effective policy
    order_waiting(waiting, config, match=, rng=)      each schedule(), before admitting
    preemption_victims(running, head, config, ...)    when the head waiting request cannot be admitted
    queue_admission(waiting, incoming, config)        at add_request (max_queued_requests/_tokens)
    priority_refusal(priority, config)                at add_request (abort_on_priority_when_disabled)

Priorities. A sequence's priority is `seq.priority`, else `config.default_priority_value`, else the
least preferred value (-sys.maxsize-1; sys.maxsize with schedule_low_priority_values_first). Larger
values are preferred unless schedule_low_priority_values_first. Internally everything compares
`preference_key = priority * sign` (sign -1 by default, +1 in low-first mode): smaller is better,
as in SGLang's `priority * priority_sign` sort keys.

Policies (`order_waiting`):
    fcfs        the order given (arrival order). With priority scheduling: (preference, arrival_index).
    lof         longest output first: -max_new_tokens (stable). With priority scheduling:
                (preference, -max_new_tokens).
    random      rng.shuffle.
    lpm         longest prefix match first: -matched tokens (stable), with SGLang's in-batch
                dedupe (see _order_lpm). Falls back to fcfs over 128 waiting requests.
    dfs-weight  depth first over the radix nodes the requests last matched (see _order_dfs_weight).
    shortest-prefill-first (alias spf)
                (deprioritised, uncached tokens, arrival_index): the request with the least left to
                prefill first. Uncached tokens = num_tokens (the prompt, plus what a preempted
                request already generated: it re-prefills those too) minus the prefix-cache match;
                deprioritised = lpm's in-batch dedupe (see _in_batch_dedupe).
Both cache-aware policies (lpm, dfs-weight) are fcfs without a prefix cache (`match is None`). As
in SGLang, only lpm (and SGLang's hrrn) switches to fcfs over 128 waiting requests; dfs-weight and
shortest-prefill-first do not. Without a prefix cache shortest-prefill-first is trnrt's choice, not
SGLang's (which runs fcfs there): (num_tokens, arrival_index), shortest prompt first, no dedupe
(a duplicate gains nothing from waiting when nothing is cached).
"""

from __future__ import annotations

import random as _random
import sys
from typing import Callable, Iterable, Optional

from trnrt.engine.cache.radix_node import TreeNode
from trnrt.engine.output.sequence import Sequence

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "shortest-prefill-first")
# Other names accepted for a policy; configs hold (and /server_info reports) the canonical one.
SCHEDULE_POLICY_ALIASES = {"spf": "shortest-prefill-first"}
# Policies that are fcfs without a prefix cache (shortest-prefill-first is not: see above).
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
PRIORITY_POLICIES = ("fcfs", "lof")
# SGLang's CLI lists these too; trnrt does not implement them ("priority" is unusable in SGLang
# 0.5.23 itself: its policy enum lacks it, so it fails as unknown).
UNSUPPORTED_SGLANG_POLICIES = ("routing-key", "hrrn")

# lpm switches to fcfs when more requests than this wait (SGLang: prefix matching every waiting
# request each step gets expensive).
LPM_MAX_WAITING = 128
# In-batch prefix dedupe (SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and
# IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, both 32 by default).
IN_BATCH_CHECK_THRESHOLD = 32
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32

PRIORITY_POLICY_MESSAGE = "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."
QUEUE_FULL_MESSAGE = "The request queue is full."
DISPLACED_MESSAGE = "The request is aborted by a higher priority request."
PRIORITY_DISABLED_MESSAGE = "Using priority is disabled for this server. Please send a new request without a priority."

MatchFn = Callable[[Sequence], "tuple[int, Optional[TreeNode]]"]


# -- validation -----------------------------------------------------------------------------------


def canonical_policy(name):
    """The canonical name of a policy (`spf` -> `shortest-prefill-first`); anything else as given."""
    return SCHEDULE_POLICY_ALIASES.get(name, name) if isinstance(name, str) else name


def validate_policy(config, cache_enabled: bool) -> str:
    """Check the policy settings of a SchedulerConfig; return the policy that will actually run.

    The effective policy is `config.schedule_policy` (an alias as its canonical name), except
    that a cache-aware one (lpm, dfs-weight) is fcfs when `cache_enabled` is False (SGLang's
    _validate_and_adjust_policy).

    Raises:
        ValueError: SGLang's "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."
            (checked on the configured policy, before any cache fallback); "Unknown
            schedule_policy: policy='...'" for a policy SGLang does not know; a message naming the
            policy for SGLang's policies trnrt does not implement; a message naming the field for
            a priority/queue setting of the wrong type.
    """
    policy = canonical_policy(config.schedule_policy)
    if policy in UNSUPPORTED_SGLANG_POLICIES:
        raise ValueError(f"schedule_policy {policy!r} is not supported (supported: {', '.join(SCHEDULE_POLICIES)})")
    if policy not in SCHEDULE_POLICIES:
        raise ValueError(f"Unknown schedule_policy: policy={policy!r}")
    if config.enable_priority_scheduling and policy not in PRIORITY_POLICIES:
        raise ValueError(PRIORITY_POLICY_MESSAGE)

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(config.priority_preemption_threshold):
        raise ValueError(f"priority_preemption_threshold must be an integer, got {config.priority_preemption_threshold!r}")
    if config.default_priority_value is not None and not is_int(config.default_priority_value):
        raise ValueError(f"default_priority_value must be an integer or None, got {config.default_priority_value!r}")
    q = config.max_queued_requests
    if q is not None and (not is_int(q) or q < 0):
        raise ValueError(f"max_queued_requests must be an integer >= 0 or None, got {q!r}")
    t = config.max_queued_tokens
    if t is not None and (not is_int(t) or t < 1):
        raise ValueError(f"max_queued_tokens must be a positive integer or None, got {t!r}")
    if config.random_seed is not None and not is_int(config.random_seed):
        raise ValueError(f"random_seed must be an integer or None, got {config.random_seed!r}")
    if policy in CACHE_AWARE_POLICIES and not cache_enabled:
        return "fcfs"
    return policy


def make_rng(config) -> _random.Random:
    """The `random` policy's generator; the Scheduler should make one and keep it across steps."""
    return _random.Random(config.random_seed)


# -- priorities -----------------------------------------------------------------------------------


def priority_of(seq: Sequence, config) -> int:
    """seq.priority, else config.default_priority_value, else the least preferred value."""
    if seq.priority is not None:
        return seq.priority
    if config.default_priority_value is not None:
        return config.default_priority_value
    return sys.maxsize if config.schedule_low_priority_values_first else -sys.maxsize - 1


def priority_sign(config) -> int:
    """SGLang's priority_sign: +1 in low-values-first mode, else -1 (larger values preferred)."""
    return 1 if config.schedule_low_priority_values_first else -1


def preference_key(seq: Sequence, config) -> int:
    """priority * sign: smaller is more preferred, whatever the direction."""
    return priority_of(seq, config) * priority_sign(config)


def priority_refusal(priority: int | None, config) -> str | None:
    """The abort message for a request carrying `priority`, or None to accept it.

    With abort_on_priority_when_disabled and priority scheduling off, a request that sets a
    priority is refused (SGLang: 503 with PRIORITY_DISABLED_MESSAGE); otherwise the field is used
    (priority scheduling on) or ignored.
    """
    if priority is not None and not config.enable_priority_scheduling and config.abort_on_priority_when_disabled:
        return PRIORITY_DISABLED_MESSAGE
    return None


# -- waiting-queue order --------------------------------------------------------------------------


def order_waiting(
    waiting: Iterable[Sequence],
    config,
    *,
    match: MatchFn | None = None,
    rng: _random.Random | None = None,
) -> list[Sequence]:
    """The waiting queue in the order admission should try it. Does not modify `waiting`.

    Args:
        waiting: the waiting sequences in arrival order (preempted ones first, as the queue
            holds them); fcfs without priority scheduling returns exactly this order.
        config: the SchedulerConfig (schedule_policy, enable_priority_scheduling, ...); assumed
            to have passed validate_policy.
        match: the prefix cache's lookup, `match(seq) -> (matched tokens, last matched node)`
            (the node may be None for no match); None when there is no prefix cache, which makes
            lpm and dfs-weight fcfs and shortest-prefill-first count whole prompts. Called
            once per waiting sequence, in order; it should not lock anything.
        rng: the `random` policy's generator (make_rng(config), kept by the caller across steps);
            None uses the module-level random.
    """
    seqs = list(waiting)
    policy = canonical_policy(config.schedule_policy)
    prio = config.enable_priority_scheduling
    if policy in CACHE_AWARE_POLICIES and match is None:
        policy = "fcfs"
    if policy == "lpm" and len(seqs) > LPM_MAX_WAITING:
        policy = "fcfs"
    if policy == "fcfs":
        if prio:
            seqs.sort(key=lambda s: (preference_key(s, config), s.arrival_index))
        return seqs
    if policy == "lof":
        if prio:
            seqs.sort(key=lambda s: (preference_key(s, config), -s.sampling_params.max_new_tokens))
        else:
            seqs.sort(key=lambda s: -s.sampling_params.max_new_tokens)
        return seqs
    if policy == "random":
        (rng or _random).shuffle(seqs)
        return seqs
    if policy == "lpm":
        return _order_lpm(seqs, match)
    if policy == "dfs-weight":
        return _order_dfs_weight(seqs, match)
    if policy == "shortest-prefill-first":
        return _order_spf(seqs, match)
    raise ValueError(f"Unknown schedule_policy: policy={config.schedule_policy!r}")


def _in_batch_dedupe(seqs: list[Sequence], match: MatchFn) -> dict[int, tuple[int, bool]]:
    """id(seq) -> (cache-matched tokens, deprioritised), SGLang's in-batch prefix dedupe.

    Requests are visited in queue order; one whose cache match is short (<=
    IN_BATCH_CHECK_THRESHOLD tokens) is matched against the waiting requests visited before it
    (SGLang inserts them into a throw-away radix tree). If it shares >=
    IN_BATCH_DEPRIORITIZE_THRESHOLD tokens with one of them it is deprioritised (sorted last this
    round, so the first of the group runs alone and later ones then hit the cache); otherwise it
    is recorded for the ones after it. A request with a long cache match is neither checked nor
    recorded. Here the throw-away tree is a set of token prefixes: a shared prefix of >= 32 tokens
    means the first 32 tokens (of prompt + output, as SGLang matches) are equal. Calls `match`
    once per sequence, in order.
    """
    k = IN_BATCH_DEPRIORITIZE_THRESHOLD
    seen: set[tuple[int, ...]] = set()
    out: dict[int, tuple[int, bool]] = {}
    for s in seqs:
        matched, _ = match(s)
        deprioritised = False
        if matched <= IN_BATCH_CHECK_THRESHOLD:
            head = tuple(s.token_slice(0, k))
            if len(head) >= k and head in seen:
                deprioritised = True
            elif len(head) >= k:
                seen.add(head)
            # a sequence shorter than k tokens can never share k tokens with another: recording
            # it would change nothing
        out[id(s)] = (matched, deprioritised)
    return out


def _order_lpm(seqs: list[Sequence], match: MatchFn) -> list[Sequence]:
    """Longest prefix match first (stable), in-batch duplicates last in queue order (_in_batch_dedupe)."""
    marks = _in_batch_dedupe(seqs, match)

    def key(s: Sequence) -> float:
        matched, deprioritised = marks[id(s)]
        return float("inf") if deprioritised else -matched

    return sorted(seqs, key=key)


def _order_spf(seqs: list[Sequence], match: MatchFn | None) -> list[Sequence]:
    """Shortest prefill first: (deprioritised, num_tokens - cache match, arrival_index).

    With a prefix cache, `deprioritised` and the match are lpm's (_in_batch_dedupe); without one
    (match None) every request is matched by 0 tokens and none is deprioritised.
    """
    marks = _in_batch_dedupe(seqs, match) if match is not None else {}

    def key(s: Sequence) -> tuple[bool, int, int]:
        matched, deprioritised = marks.get(id(s), (0, False))
        return deprioritised, s.num_tokens - matched, s.arrival_index

    return sorted(seqs, key=key)


def _order_dfs_weight(seqs: list[Sequence], match: MatchFn) -> list[Sequence]:
    """Depth first over the radix tree, heaviest subtree first.

    Each sequence sits at the node it last matched (`match(seq)[1]`). A node's weight is the
    number of waiting sequences at it or below it. The walk starts at the root, visits a node's
    children in decreasing weight (ties: the children dict's order) and emits the sequences of a
    node after those of its subtree (post-order), so requests sharing a long cached prefix run
    together, deepest first. Only the paths from the root to the matched nodes are walked (other
    nodes have weight 0 and no sequences: SGLang's whole-tree walk gives the same order).
    Sequences without a node (no match at all) belong to the root: they come last.
    """
    at: dict[int, list[Sequence]] = {}
    nodes: dict[int, TreeNode] = {}
    unplaced: list[Sequence] = []
    for s in seqs:
        _, node = match(s)
        if node is None:
            unplaced.append(s)
            continue
        at.setdefault(node.id, []).append(s)
        nodes[node.id] = node
    weight: dict[int, int] = {}
    roots: list[TreeNode] = []
    for nid, group in at.items():
        n: TreeNode | None = nodes[nid]
        while n is not None:
            weight[n.id] = weight.get(n.id, 0) + len(group)
            if n.parent is None and n.id not in {r.id for r in roots}:
                roots.append(n)
            n = n.parent
    out: list[Sequence] = []
    for root in roots:
        # iterative post-order: (node, expanded?)
        stack: list[tuple[TreeNode, bool]] = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                out.extend(at.get(n.id, ()))
                continue
            stack.append((n, True))
            kids = [c for c in n.children.values() if c.id in weight]
            kids.sort(key=lambda c: -weight[c.id])  # stable: dict order breaks ties
            stack.extend((c, False) for c in reversed(kids))
    out.extend(unplaced)
    return out


# -- priority preemption --------------------------------------------------------------------------


def preemption_victims(
    running: Iterable[Sequence],
    incoming: Sequence,
    config,
    tokens_needed: int,
    tokens_of: Callable[[Sequence], int],
) -> list[Sequence]:
    """Running sequences to preempt so that `incoming` can be admitted (SGLang's preempt_to_schedule).

    Running sequences are scanned from the least preferred (lowest priority, then the newest:
    highest arrival_index); each is preemptible only if `incoming` is better by MORE than
    priority_preemption_threshold, and the scan stops at the first that is not. Victims are taken
    until their `tokens_of` sum reaches `tokens_needed` (at least one is taken). If that cannot
    be reached, nothing is preempted.

    Returns:
        The victims, least preferred first; [] when priority scheduling is off,
        disable_priority_preemption is set, or not enough can be freed. The caller preempts them
        (frees their pages and slots, re-queues them); this function changes nothing.
    """
    if not config.enable_priority_scheduling or config.disable_priority_preemption:
        return []
    sign = priority_sign(config)
    mine = priority_of(incoming, config)
    candidates = [s for s in running if s is not incoming and not s.is_finished]
    candidates.sort(key=lambda s: (-preference_key(s, config), -s.arrival_index))
    victims: list[Sequence] = []
    need = tokens_needed
    for s in candidates:
        # how much better the incoming one is, in the preferred direction
        if (mine - priority_of(s, config)) * -sign <= config.priority_preemption_threshold:
            break
        victims.append(s)
        need -= tokens_of(s)
        if need <= 0:
            return victims
    return []


# -- queue limit ----------------------------------------------------------------------------------


def queued_tokens(seq: Sequence) -> int:
    """What a waiting sequence counts against max_queued_tokens: the tokens its prefill feeds
    (its prompt; plus its output so far if it was preempted, which it re-prefills)."""
    return seq.num_tokens


def queue_admission(waiting: Iterable[Sequence], incoming: Sequence, config) -> tuple[bool, list[Sequence]]:
    """Whether `incoming` may join the waiting queue under max_queued_requests and max_queued_tokens.

    The request limit is SGLang 0.5.23's: `incoming` fits if len(waiting) + 1 <=
    max_queued_requests; when it does not, one waiting request must leave for it. The token limit
    is trnrt's: it fits if the waiting sequences' queued_tokens plus its own are <=
    max_queued_tokens, or if no other sequence would be waiting (so that one prompt longer than
    the limit can still run: it waits alone).

    With priority scheduling, a refused `incoming` may displace waiting sequences strictly worse
    than it (lower priority; taken least preferred first, the newest on ties) until both limits
    hold: as many as that takes, or none when displacing every worse one would still not make
    room. With the request limit alone that is SGLang's rule (the single worst one, if worse).

    Returns:
        (True, []): queue it.
        (True, displaced): queue it after the caller aborts each of `displaced` (503,
            DISPLACED_MESSAGE), least preferred first.
        (False, []): refuse `incoming` (503, QUEUE_FULL_MESSAGE).
    """
    waiting = list(waiting)
    req_limit, tok_limit = config.max_queued_requests, config.max_queued_tokens
    if req_limit is None and tok_limit is None:
        return True, []
    must_displace = req_limit is not None and len(waiting) + 1 > req_limit
    total = sum(queued_tokens(s) for s in waiting) if tok_limit is not None else 0
    mine = queued_tokens(incoming)

    def fits(num_displaced: int, tokens_displaced: int) -> bool:
        if must_displace and num_displaced == 0:
            return False
        if tok_limit is None or num_displaced == len(waiting):
            return True
        return total - tokens_displaced + mine <= tok_limit

    if fits(0, 0):
        return True, []
    if not config.enable_priority_scheduling:
        return False, []
    key = preference_key(incoming, config)
    worse = sorted((s for s in waiting if preference_key(s, config) > key),
                   key=lambda s: (preference_key(s, config), s.arrival_index), reverse=True)
    freed = 0
    for n, s in enumerate(worse, 1):
        freed += queued_tokens(s)
        if fits(n, freed):
            return True, worse[:n]
    return False, []
