"""Which graphs the compile tests compile, and how they split into parallel jobs (see conftest.py).

Everything is derived from the catalogue (`trnrt.compile.catalogue.expand`) of PRESETS, once per
flag set of FLAG_SETS, so a new bucket, preset setting or variant is picked up without editing
this file. By TRNRT_TEST_COMPILE:

- "kinds" (default, CI): REPRESENTATIVE's base graphs whole (every bucket, context table and
  sampler of batch8: what `trnrt serve --compiled` and the artifact cache load, and `trnrt
  bench` runs), plus ONE graph of every (phase, variant) of the flag sets, the full sampler, from
  REPRESENTATIVE, leaving out a variant whose flags a larger variant of the same phase holds (the
  processors' superset variant's decode; the prompt-logprobs prefill, which carries the
  processors' prefill path), and one verify (full rule), one draft and one spec_prefill graph of
  mtp-always (their smallest bucket): 11 graphs. A variant's greedy twin, its other buckets and default's
  graphs differ
  from a checked graph only in a sampler, a bucket size or the state sizes; graph-equiv pins
  their hashes, and the other modes compile them.
- "buckets": every bucket of every preset (decode batch x context, prefill tokens x context)
  with the full sampler and the base variant, plus one graph of every other kind (as "kinds").
- "every": every graph of every preset and flag set.
- "variants": every variant graph of every preset and flag set, and no base graph (what
  test_compile_variants checks bucket by bucket; the base-graph tests skip).
- "subset": three of batch8's graphs and mtp-always's smallest verify, draft and spec_prefill (FAST_SUBSET), for
  a quick local run.

Graphs whose hashes are equal in the presets' lock files (the same graph in two presets) are one
compile: they go to the same job, the first preset's is compiled and `trnrt compile` copies it
for the later presets under the same --out. Jobs are balanced by an estimated cost: the graph's
node count in its lock file (Inductor's time is about proportional to it; a graph not in a lock
yet counts as the largest graph of its phase).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

MODE = os.environ.get("TRNRT_TEST_COMPILE", "kinds")
if MODE not in ("kinds", "buckets", "every", "subset", "variants"):
    raise ValueError(f"TRNRT_TEST_COMPILE must be kinds, buckets, every, variants or subset, got {MODE!r}")
SUBSET = MODE == "subset"

PRESETS = ("default", "batch8", "mtp-always")  # mtp-always: default's graphs + verify / draft
# (its plain graphs hash as default's, so they are copies; it takes no grammar / penalty flags)
# Flag sets compiled, each in its own artifact directory (a manifest holds one flag set). The
# base graphs of a flagged catalogue are the unflagged ones, so a flagged set adds only its variant
# graphs: one per kind in "buckets". Add e.g. ("structured_outputs",) to compile its variants.
FLAG_SETS: tuple[tuple[str, ...], ...] = ((), ("penalties", "prompt_logprobs", "structured_outputs"))
REPRESENTATIVE = "batch8"
JOBS = 2  # parallel `trnrt compile` processes (CI has 2 cores)

# The full sampler over the full block table, the greedy sampler over the short one (what a greedy
# batch of short sequences runs, e.g. `trnrt bench`), and the smallest prefill graph.
FAST_SUBSET = {"batch8": ["decode-b8-t1-base", "decode-b8-t1-c128-base-greedy", "prefill-b1-t32-base"],
               "mtp-always": ["verify-b1-t4-base", "draft-b1-t4-base-greedy", "spec_prefill-b1-t16-c128-base"]}


@dataclass(frozen=True)
class Graph:
    preset: str
    flags: tuple[str, ...]
    id: str
    # (phase, variant, sampling, over a context bucket): the context table is one kind only for the
    # base graphs (a variant's graph over either table is the base graph's plus the same processors)
    kind: tuple[str, str, str, bool | None]
    lock_hash: str | None  # tiny-dims hash in the preset's lock (None: not in the lock)
    cost: int  # estimated compile cost (graph nodes)

    @property
    def key(self) -> str:
        """The artifact set it belongs to: the preset, or "preset+variant" for a flag set."""
        return artifact_key(self.preset, self.flags)


def artifact_key(preset: str, flags: tuple[str, ...] = ()) -> str:
    from trnrt.compile.catalogue import variant_name

    return preset if not flags else f"{preset}+{variant_name(flags)}"


@lru_cache(maxsize=None)
def _lock_graphs(preset: str) -> dict:
    from trnrt.config.presets import read_preset

    path = read_preset(preset).lock_path
    try:
        return json.loads(path.read_text())["dims"]["tiny"]["graphs"]
    except (OSError, KeyError, ValueError):
        return {}


@lru_cache(maxsize=None)
def catalogue() -> tuple[Graph, ...]:
    """Every graph of PRESETS x FLAG_SETS, in catalogue order (the base graphs once, unflagged)."""
    from trnrt.compile.catalogue import BASE_VARIANT, expand
    from trnrt.config.presets import load_preset
    from trnrt.engine.spec.config import REFUSED_FLAGS

    out = []
    for flags in FLAG_SETS:
        for preset in PRESETS:
            lock = _lock_graphs(preset)
            biggest = {}
            for gid, g in lock.items():
                phase = gid.split("-")[0]
                biggest[phase] = max(biggest.get(phase, 0), int(g.get("nodes", 0)))
            cfg = load_preset(preset)
            if flags and cfg.speculative_mode == "always" and set(flags) & set(REFUSED_FLAGS):
                continue  # refused by such a preset (catalogue.check_speculative_flags)
            for s in expand(cfg, flags):
                if flags and s.variant == BASE_VARIANT:
                    continue  # compiled with the unflagged set
                entry = lock.get(s.graph_id) if s.variant == BASE_VARIANT else None
                cost = int(entry["nodes"]) if entry else biggest.get(s.phase, 0) or 3500
                out.append(Graph(preset, tuple(sorted(flags)), s.graph_id, (s.phase, s.variant, s.sampling,
                                                                    bool(s.context) if s.variant == BASE_VARIANT else None),
                                 entry["hash"] if entry else None, cost))
    return tuple(out)


@lru_cache(maxsize=None)
def selected() -> tuple[Graph, ...]:
    """The graphs this session compiles (or copies), in catalogue order."""
    graphs = catalogue()
    if MODE == "every":
        return graphs
    if MODE == "variants":
        return tuple(g for g in graphs if g.flags)
    if SUBSET:
        return tuple(g for g in graphs if not g.flags and g.id in FAST_SUBSET.get(g.preset, ()))
    from trnrt.compile.catalogue import BASE_VARIANT

    if MODE == "kinds":
        chosen = [g for g in graphs if g.preset == REPRESENTATIVE and not g.flags]
        pairs = {(g.kind[0], g.kind[1]) for g in graphs if g.flags}
        # a phase's variant whose flags another variant of that phase holds too is covered by it
        # (prefill: the prompt-logprobs graph carries the processors' variant's processors)
        pairs = {(ph, v) for ph, v in pairs
                 if not any(ph == ph2 and set(v.split("+")) < set(v2.split("+")) for ph2, v2 in pairs)}
        for phase_variant in sorted(pairs):
            of_kind = [g for g in graphs if (g.kind[0], g.kind[1]) == phase_variant and g.kind[2] == "full"]
            rep = [g for g in of_kind if g.preset == REPRESENTATIVE] or of_kind
            chosen.append(rep[0])
        # the speculative phases (no variant): their smallest bucket, the full rule, over a context
        # bucket where there is one (what a short prompt runs: the compiled-engine test's)
        for phase in ("verify", "draft", "spec_prefill"):
            of_phase = [g for g in graphs if g.kind[0] == phase and not g.flags]
            full = [g for g in of_phase if g.kind[2] == "full"] or of_phase
            if full:
                chosen.append(min(full, key=lambda g: (not g.kind[3], g.cost, g.id)))
        return tuple(g for g in graphs if g in chosen)
    # every bucket with the full sampler and the base variant, then one graph of every other kind
    chosen = [g for g in graphs if g.kind[1:3] == (BASE_VARIANT, "full") or g.kind[0] == "draft"]  # draft: one rule
    covered = {g.kind for g in chosen}
    for kind in sorted({g.kind for g in graphs} - covered):
        of_kind = [g for g in graphs if g.kind == kind]
        rep = [g for g in of_kind if g.preset == REPRESENTATIVE] or of_kind
        chosen.append(rep[0])
    return tuple(g for g in graphs if g in chosen)


def _units(graphs) -> list[list[Graph]]:
    """Graphs that are one compile: equal lock hashes (same flag set), else each on its own."""
    by_hash: dict = {}
    for g in graphs:
        by_hash.setdefault((g.flags, g.lock_hash or (g.preset, g.id)), []).append(g)
    return list(by_hash.values())


def jobs(n: int = JOBS, graphs=None) -> list[list[tuple[str, tuple[str, ...], list[str]]]]:
    """The compile jobs for `graphs` (default: selected()): each a list of (preset, flags, graph
    ids) steps, run in order into one --out per flag set, balanced by cost (longest first onto the
    least loaded job)."""
    loads = [0] * n
    members: list[list[Graph]] = [[] for _ in range(n)]
    for unit in sorted(_units(selected() if graphs is None else graphs), key=lambda u: (-u[0].cost, u[0].preset, u[0].id)):
        j = loads.index(min(loads))
        loads[j] += unit[0].cost
        members[j] += unit
    out = []
    for mine in members:
        steps = []
        for flags in FLAG_SETS:  # presets in PRESETS order: a copied graph's source comes first
            for preset in PRESETS:
                ids = [g.id for g in mine if g.preset == preset and g.flags == tuple(sorted(flags))]
                if ids:
                    steps.append((preset, tuple(sorted(flags)), ids))
        if steps:
            out.append(steps)
    return out


def compiled_ids() -> dict[str, list[str]]:
    """{artifact key: graph ids} of the graphs the session compiles or copies."""
    out: dict[str, list[str]] = {}
    for g in selected():
        out.setdefault(g.key, []).append(g.id)
    return out


def copied_ids() -> dict[str, set[str]]:
    """{artifact key: graph ids} that are copies of an earlier preset's equal graph."""
    out: dict[str, set[str]] = {}
    for unit in _units(selected()):
        for g in unit[1:]:
            out.setdefault(g.key, set()).add(g.id)
    return out
