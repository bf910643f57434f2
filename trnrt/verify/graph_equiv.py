"""`trnrt verify graph-equiv`: prove a preset's graphs unchanged, against a lock file or a git ref.

For each spec of expand(preset, flags) the step graph is exported and reduced to its canonical
Merkle hash (trnrt.compile.graph_hash). The reference is either the committed lock file
presets/<preset>.graphs.lock.json or the same computation at another git revision.

Lock files keep, per graph, the hash, the op histogram and the short hashes of every node, so a
mismatch against a lock still names the first differing node of the current graph and its source
line (the first node whose hash the reference lacks while all of its inputs are known: where the
change originates). `--base-ref` has both graphs at hand and shows the reference node too.

Dims: "tiny" exports the embedded tiny model's config on the CPU with uninitialised weights (the
same graph `trnrt compile` exports from the tiny checkpoint, so lock and manifest hashes agree),
"real" GLM-5.3-Flash's released dimensions on the meta device. No checkpoint is read, and real
dims fit in a few hundred MB.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

LOCK_SCHEMA = 1
DIMS = ("tiny", "real")


# ---------------------------------------------------------------------------------------------
# Computing fingerprints


def model_config_for(dims: str):
    """The model config hashed for `dims`: the tiny checkpoint's, or the released model's."""
    from trnrt.models.glm5_next.config import Glm5NextConfig

    if dims == "tiny":
        from trnrt.models.tiny import tiny_text_config

        return Glm5NextConfig.from_dict(tiny_text_config())
    if dims == "real":
        return Glm5NextConfig.from_dict({})
    raise ValueError(f"dims must be tiny or real, got {dims!r}")


@dataclass
class PresetPlan:
    """What checking one preset takes, worked out without building a model: its graphs, each with
    its fingerprint-cache key (trnrt.compile.fingerprint_cache.key)."""
    preset: str  # the preset's path (what a worker process reads again)
    flags: tuple[str, ...]
    dims: str
    preset_sha256: str
    model_config_sha256: str
    lock_path: str
    keys: dict[str, str]  # graph id -> cache key, in catalogue order


def plan_preset(preset: str, flags: Iterable[str] = (), dims: str = "tiny",
                only: Iterable[str] | None = None) -> PresetPlan:
    """The graphs of `preset` (expand(preset, flags), narrowed to `only`) and their cache keys."""
    from trnrt.compile import fingerprint_cache
    from trnrt.compile.catalogue import expand
    from trnrt.compile.manifest import model_config_hash
    from trnrt.config.presets import phase_settings_hash, preset_hash, read_preset

    p = read_preset(preset)
    flags = tuple(sorted(set(flags)))
    # Flags go into the config the model and step see, so a base graph that reads them would show.
    cfg = p.engine_config.replace(variants=flags)
    mcfg = model_config_for(dims)
    specs = expand(cfg, list(flags))
    if only is not None:
        wanted = set(only)
        specs = [s for s in specs if s.graph_id in wanted]
    keys = {s.graph_id: fingerprint_cache.key(phase_settings_hash(p.engine_config, s.phase), mcfg, flags, s.graph_id)
            for s in specs}
    return PresetPlan(str(p.path), flags, dims, preset_hash(p.engine_config), model_config_hash(mcfg),
                      str(p.lock_path), keys)


class GraphExporter:
    """Exports and hashes the graphs of one (preset, flags, dims), building its model once."""

    def __init__(self, preset: str, flags: Iterable[str], dims: str):
        from trnrt.compile.catalogue import expand
        from trnrt.compile.pipeline import meta_model_and_state
        from trnrt.config.presets import read_preset

        flags = sorted(set(flags))
        self.cfg = read_preset(preset).engine_config.replace(variants=tuple(flags))
        self.model, self.state = meta_model_and_state(self.cfg, model_config_for(dims),
                                                      device="cpu" if dims == "tiny" else "meta")
        self.specs = {s.graph_id: s for s in expand(self.cfg, flags)}

    def fingerprint(self, graph_id: str):
        from trnrt.compile.export import export_spec
        from trnrt.compile.graph_hash import fingerprint

        return fingerprint(export_spec(self.model, self.state, self.cfg, self.specs[graph_id]).program)


def fingerprints_for(preset: str, flags: Iterable[str] = (), dims: str = "tiny", only: Iterable[str] | None = None,
                     on_graph: Callable[[str, int, int, bool], None] | None = None, use_cache: bool = True) -> dict:
    """{"preset_sha256", "model_config_sha256", "graphs": {graph_id: GraphFingerprint}} for a preset,
    exported one after another in this process (in-process patches count; the CLI's parallel
    exports are trnrt.verify.export_pool).

    With `use_cache`, a fingerprint that `trnrt compile` or an earlier check stored for the same
    traced sources, preset, model config, flags and graph is read instead of exporting the graph
    again (trnrt.compile.fingerprint_cache)."""
    from trnrt.compile import fingerprint_cache

    plan = plan_preset(preset, flags, dims, only)
    exporter = None
    graphs = {}
    for i, (gid, k) in enumerate(plan.keys.items()):
        fp = fingerprint_cache.get(k) if use_cache else None
        cached = fp is not None
        if fp is None:
            exporter = exporter or GraphExporter(plan.preset, plan.flags, dims)
            fp = exporter.fingerprint(gid)
            if use_cache:
                fingerprint_cache.put(k, fp)
        graphs[gid] = fp
        if on_graph:
            on_graph(gid, i, len(plan.keys), cached)
    return {"preset_sha256": plan.preset_sha256, "model_config_sha256": plan.model_config_sha256, "graphs": graphs,
            "lock_path": plan.lock_path}


# ---------------------------------------------------------------------------------------------
# Lock files


def _pack(short_hashes: list[str]) -> str:
    return base64.b64encode(bytes.fromhex("".join(short_hashes))).decode()


def _unpack(packed: str, width: int) -> set[str]:
    raw = base64.b64decode(packed).hex()
    return {raw[i: i + width] for i in range(0, len(raw), width)}


def lock_entry(fp, with_nodes: bool = True) -> dict:
    """A lock entry. Node hashes (6 bytes a node) let a lock mismatch name the first differing
    node; they are left out at real dims, where ~19k nodes a graph would make the lock ~0.2 MB a
    graph (--base-ref finds the node there)."""
    from trnrt.compile.graph_hash import SHORT

    e = {"hash": fp.hash, "nodes": fp.num_nodes, "ops": fp.op_counts}
    if with_nodes:
        e.update({"node_hash_hex": SHORT, "node_hashes": _pack(fp.short_hashes())})
    return e


def read_lock(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        lock = json.load(f)
    if lock.get("schema") != LOCK_SCHEMA:
        raise ValueError(f"{path}: lock schema {lock.get('schema')!r}, expected {LOCK_SCHEMA}")
    return lock


def write_lock(path: Path, preset: str, dims: str, result: dict, old: dict | None = None,
               replace: bool = False) -> list[str]:
    """Write the fingerprints of `result` for `dims` into the lock; return what changed.

    replace: drop the section's graphs that `result` lacks (a full run); else merge (--only).
    """
    import torch

    from trnrt.compile.graph_hash import HASH_VERSION

    lock = old or {"schema": LOCK_SCHEMA, "preset": preset, "dims": {}}
    lock["schema"], lock["preset"], lock["hash_version"] = LOCK_SCHEMA, preset, HASH_VERSION
    lock["torch"] = torch.__version__.split("+")[0]
    section = lock.setdefault("dims", {}).setdefault(dims, {"graphs": {}})
    section["preset_sha256"] = result["preset_sha256"]
    section["model_config_sha256"] = result["model_config_sha256"]
    changed = []
    if replace:
        for gid in [g for g in section["graphs"] if g not in result["graphs"]]:
            changed.append(f"{gid}: removed")
            del section["graphs"][gid]
    for gid, fp in result["graphs"].items():
        prev = section["graphs"].get(gid, {}).get("hash")
        if prev != fp.hash:
            changed.append(f"{gid}: {prev[:16] if prev else '(new)'} -> {fp.hash[:16]}")
        section["graphs"][gid] = lock_entry(fp, with_nodes=(dims == "tiny"))
    section["graphs"] = dict(sorted(section["graphs"].items()))
    lock["dims"] = dict(sorted(lock["dims"].items()))
    path.write_text(json.dumps(lock, indent=1) + "\n", encoding="utf-8")
    return changed


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclass
class GraphVerdict:
    graph_id: str
    reference: str | None  # hash, None when the reference has no such graph
    current: str | None
    ok: bool
    detail: str = ""


@dataclass
class Report:
    preset: str
    dims: str
    reference_name: str
    verdicts: list[GraphVerdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok}


def compare_to_lock(result: dict, lock: dict, preset: str, dims: str, lock_name: str,
                    complete: bool = True, flags: Iterable[str] = ()) -> Report:
    """Compare fingerprints with a lock. complete: `result` holds every graph of the preset (no
    --only), so a locked graph missing from it is a difference too. flags: the base graphs are
    compared with the (flag-off) lock all the same; variant graphs with their own locked hashes."""
    from trnrt.compile.graph_hash import HASH_VERSION, diff_against_hashes

    rep = Report(preset, dims, lock_name)
    section = lock.get("dims", {}).get(dims)
    if section is None:
        rep.verdicts.append(GraphVerdict("*", None, None, False, f"{lock_name} has no {dims!r} section "
                                         f"(write one with --update-lock)"))
        return rep
    if lock.get("hash_version") != HASH_VERSION:
        rep.notes.append(f"lock made with hash version {lock.get('hash_version')}, this is {HASH_VERSION}: "
                         f"every graph will differ; regenerate with --update-lock")
    if section.get("preset_sha256") != result["preset_sha256"]:
        rep.notes.append("the preset's settings differ from the ones the lock was made with")
    if section.get("model_config_sha256") != result["model_config_sha256"]:
        rep.notes.append(f"the {dims} model config differs from the one the lock was made with")
    import torch

    if lock.get("torch") and lock["torch"] != torch.__version__.split("+")[0]:
        rep.notes.append(f"lock made with torch {lock['torch']}, running {torch.__version__}: ATen graphs can "
                         f"differ between torch versions")
    for gid, fp in result["graphs"].items():
        ref = section["graphs"].get(gid)
        if ref is None:
            rep.verdicts.append(GraphVerdict(gid, None, fp.hash, False, "  not in the lock file (new graph)"))
            continue
        if ref["hash"] == fp.hash:
            rep.verdicts.append(GraphVerdict(gid, ref["hash"], fp.hash, True))
            continue
        if "node_hashes" in ref:
            known = _unpack(ref["node_hashes"], int(ref.get("node_hash_hex", 12)))
            d = diff_against_hashes(fp, known, ref.get("ops", {}))
        else:
            from trnrt.compile.graph_hash import GraphDiff, op_delta

            d = GraphDiff(op_delta(ref.get("ops", {}), fp.op_counts), None, None,
                          f"the lock keeps no node hashes at {dims} dims: run with --base-ref REV to find the "
                          f"first differing node")
        rep.verdicts.append(GraphVerdict(gid, ref["hash"], fp.hash, False, d.render()))
    if complete:
        from trnrt.compile.catalogue import BASE_VARIANT, spec_from_id, variant_name

        current_variant = variant_name(flags)
        for gid in section["graphs"]:
            try:
                variant = spec_from_id(gid).variant
            except ValueError:  # not a catalogue id (a hand-written lock): compare it as a base graph
                variant = BASE_VARIANT
            if gid not in result["graphs"] and variant in (BASE_VARIANT, current_variant):
                rep.verdicts.append(GraphVerdict(gid, section["graphs"][gid]["hash"], None, False,
                                                 f"  {gid} is in the lock but no longer in the preset"))
    return rep


def compare_results(reference: dict, current: dict, preset: str, dims: str, ref_name: str) -> Report:
    from trnrt.compile.graph_hash import diff_fingerprints

    rep = Report(preset, dims, ref_name)
    if reference["preset_sha256"] != current["preset_sha256"]:
        rep.notes.append(f"the preset's settings differ at {ref_name}")
    for gid, fp in current["graphs"].items():
        ref = reference["graphs"].get(gid)
        if ref is None:
            rep.verdicts.append(GraphVerdict(gid, None, fp.hash, False, f"  no graph {gid} at {ref_name}"))
        elif ref.hash == fp.hash:
            rep.verdicts.append(GraphVerdict(gid, ref.hash, fp.hash, True))
        else:
            rep.verdicts.append(GraphVerdict(gid, ref.hash, fp.hash, False, diff_fingerprints(ref, fp).render()))
    for gid in reference["graphs"]:
        if gid not in current["graphs"]:
            rep.verdicts.append(GraphVerdict(gid, reference["graphs"][gid].hash, None, False,
                                             f"  graph {gid} exists at {ref_name} but not now"))
    return rep


# ---------------------------------------------------------------------------------------------
# --base-ref: the same computation in a worktree of another revision


def fingerprints_at_ref(ref: str, preset: str, flags: Iterable[str], dims: str, only: Iterable[str] | None,
                        repo: Path | None = None) -> dict:
    """fingerprints_for() at git revision `ref`: the model and engine code of `ref`, this hasher.

    A detached worktree of `ref` is created in a temporary directory; a subprocess imports
    trnrt.models and trnrt.engine from it (and the preset from its presets/ when present) and
    everything else, including the hash, from this checkout, so only the model side differs.
    """
    here = Path(__file__).resolve().parents[2]
    repo = repo or here
    with tempfile.TemporaryDirectory(prefix="trnrt-base-") as tmp:
        wt = Path(tmp) / "tree"
        r = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(wt), ref],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError(f"cannot check out {ref!r}: {r.stderr.strip()}")
        try:
            out = Path(tmp) / "result.json"
            preset_arg = preset
            base_preset = wt / "presets" / f"{preset}.toml"
            if base_preset.is_file() and os.sep not in preset and not preset.endswith(".toml"):
                preset_arg = str(base_preset)
            cmd = [sys.executable, "-m", "trnrt.verify._worker", "--base-tree", str(wt), "--preset", preset_arg,
                   "--dims", dims, "--out", str(out)]
            for f in flags:
                cmd += ["--flag", f]
            for g in only or ():
                cmd += ["--only", g]
            env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(here))
            if r.returncode != 0:
                raise ValueError(f"exporting at {ref} failed:\n{r.stderr[-3000:]}")
            data = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(wt)], capture_output=True)
    from trnrt.compile.fingerprint_cache import from_json

    data["graphs"] = {k: from_json(v) for k, v in data["graphs"].items()}
    return data


# ---------------------------------------------------------------------------------------------
# Rendering


def render(rep: Report, console) -> None:
    from rich.table import Table

    t = Table(title=f"graph-equiv {rep.preset} ({rep.dims} dims) vs {rep.reference_name}", show_lines=False)
    t.add_column("graph")
    t.add_column("reference")
    t.add_column("current")
    t.add_column("verdict")
    for v in rep.verdicts:
        t.add_row(v.graph_id, (v.reference or "-")[:16], (v.current or "-")[:16],
                  "[green]same[/green]" if v.ok else "[red]DIFFERENT[/red]")
    console.print(t)
    for n in rep.notes:
        console.print(f"[yellow]note:[/yellow] {n}")
    for v in rep.verdicts:
        if not v.ok:
            console.print(f"[bold red]{v.graph_id}[/bold red]: reference {(v.reference or '-')[:16]} vs current "
                          f"{(v.current or '-')[:16]} -> DIFFERENT")
            if v.detail:
                console.print(v.detail, markup=False, highlight=False)
