"""Canonical graph identity: a Merkle hash over an exported ATen graph.

Why a Merkle hash and not the serialized program or `gm.code`: the serialized forms carry
absolute paths, line numbers and node names (from parameter FQNs and forward-argument names), and
`gm.code` carries no shapes or dtypes. Here each node's hash covers its op (qualified overload),
its literal arguments (floats exactly, via float.hex), its output value metadata (shape, dtype,
stride, device type) and the hashes of the nodes it reads. The graph hash covers the signature
(user inputs by position, parameters and buffers by FQN, lifted constants by value) and the
hashes of what it returns, including in-place updates of state (buffer or user-input mutations
become outputs of the functionalised graph).

Consequences, each tested in tests/compile/test_graph_hash.py:
- names, source locations, line shifts and forward-argument names do not count;
- dead nodes (unreachable from an output) do not count;
- the order of independent nodes does not count (the hash follows data flow, not list order);
- any change of op, literal, shape, dtype or wiring changes the hash.
Ops tagged nondeterministic_seeded (random number generation) are additionally chained in graph
order, since two identical random draws are not the same value.

Hashes are computed on the functionalised ATen graph (`ep.run_decompositions({})`), so in-place
updates appear as data flow; composite ops are kept, so a report names the op the model calls.
Stack traces are kept on each NodeInfo for reports only.

Depends on torch and the standard library only: `trnrt verify graph-equiv --base-ref` loads this
file by path into a process that imports the *other* checkout's trnrt.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

HASH_VERSION = 1
SHORT = 12  # hex digits of a node hash kept in lock files (48 bits: no collision in practice)

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), sort_keys=False).encode()).hexdigest()


def tensor_value_hash(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes (meta/fake tensors: of their metadata, since they have no data)."""
    if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
        return "novalue:" + _h(_meta(t))
    c = t.detach().contiguous().cpu()
    if c.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
        c = c.view(torch.int16)
    return hashlib.sha256(c.numpy().tobytes()).hexdigest()


def _meta(v: Any) -> Any:
    """Canonical value metadata: shape, dtype, stride, device type (never the device index)."""
    if isinstance(v, torch.Tensor):
        try:
            stride = [int(s) for s in v.stride()]
        except Exception:  # sparse or otherwise strideless
            stride = None
        return ["T", [int(s) if not isinstance(s, torch.SymInt) else str(s) for s in v.shape], str(v.dtype), stride, v.device.type]
    if isinstance(v, (list, tuple)):
        return ["L", [_meta(x) for x in v]]
    if isinstance(v, torch.SymInt):
        return ["symint", str(v)]
    if isinstance(v, bool):
        return ["b", v]
    if isinstance(v, int):
        return ["i", v]
    if isinstance(v, float):
        return ["f", v.hex() if math.isfinite(v) else repr(v)]
    if v is None:
        return None
    return ["other", type(v).__name__]


def op_name(target: Any) -> str:
    """Qualified op name: "aten.add.Tensor" for ATen overloads, module.qualname for functions."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "hop." + target.name()
    mod = getattr(target, "__module__", None) or ""
    qn = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{qn}" if mod else qn


def _is_nondeterministic(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


@dataclass
class NodeInfo:
    """One reachable node, for reports: hash, op, canonical arguments, value meta, source."""

    index: int  # position in the graph's node list (display order)
    hash: str
    op: str
    args: Any  # canonical arguments, node references as ["%", short hash]
    meta: Any
    inputs: tuple[str, ...]  # hashes of the nodes it reads
    source: str | None  # innermost stack frame "path:line in fn: code", display only

    def describe(self, width: int = 200) -> str:
        a = json.dumps(self.args, separators=(",", ":"))
        if len(a) > width:
            a = a[: width - 3] + "..."
        m = json.dumps(self.meta, separators=(",", ":"))
        return f"{self.op} args={a} val={m}"


@dataclass
class GraphFingerprint:
    hash: str
    nodes: list[NodeInfo]  # reachable nodes in graph order
    op_counts: dict[str, int]
    num_nodes: int = 0
    extra: dict = field(default_factory=dict)

    def short_hashes(self) -> list[str]:
        return sorted({n.hash[:SHORT] for n in self.nodes})


def _source(node: torch.fx.Node) -> str | None:
    st = node.meta.get("stack_trace")
    if not st:
        return None
    frames = list(_FRAME_RE.finditer(st))
    if not frames:
        return None
    # The innermost frame outside torch itself is the model line that made this op.
    user = [f for f in frames if "site-packages" not in f.group("file") and "/torch/" not in f.group("file")]
    f = (user or frames)[-1]
    path = f.group("file")
    for marker in ("/trnrt/", "/tests/"):
        if marker in path:
            path = path[path.rindex(marker) + 1 :]
            break
    return f"{path}:{f.group('line')} in {f.group('fn').strip()}: {f.group('code').strip()}"


class _Hasher:
    def __init__(self, gm: torch.fx.GraphModule, placeholder_roles: dict[str, Any]):
        self.gm = gm
        self.roles = placeholder_roles
        self.hashes: dict[torch.fx.Node, str] = {}
        self.canon_args: dict[torch.fx.Node, Any] = {}
        self.last_random: str | None = None

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ["%", self.hashes[a]]
        if isinstance(a, bool):
            return ["b", a]
        if isinstance(a, int):
            return ["i", a]
        if isinstance(a, float):
            return ["f", a.hex() if math.isfinite(a) else repr(a)]
        if a is None:
            return None
        if isinstance(a, str):
            return ["s", a]
        if isinstance(a, (list, tuple)):
            return ["l", [self.arg(x) for x in a]]
        if isinstance(a, dict):
            return ["d", [[k, self.arg(a[k])] for k in sorted(a)]]
        if isinstance(a, torch.dtype):
            return ["dtype", str(a)]
        if isinstance(a, torch.device):
            return ["device", a.type]
        if isinstance(a, (torch.layout, torch.memory_format)):
            return ["enum", str(a)]
        if isinstance(a, slice):
            return ["slice", [self.arg(a.start), self.arg(a.stop), self.arg(a.step)]]
        if isinstance(a, torch.Tensor):  # a tensor literal inside args
            return ["tensor", _meta(a), tensor_value_hash(a)]
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ["sym", str(a)]
        return ["repr", type(a).__name__, repr(a)]

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "output":
                continue
            meta = _meta(node.meta.get("val")) if "val" in node.meta else None
            if node.op == "placeholder":
                canon = ["input", self.roles.get(node.name, ["unknown"])]
                op = "input"
            elif node.op == "get_attr":
                attr = self.gm
                for part in node.target.split("."):
                    attr = getattr(attr, part)
                if isinstance(attr, torch.fx.GraphModule):
                    sub = _fingerprint_graph(attr, {n.name: ["sub", i] for i, n in enumerate(
                        x for x in attr.graph.nodes if x.op == "placeholder")})
                    canon = ["subgraph", sub.hash]
                elif isinstance(attr, torch.Tensor):
                    canon = ["tensor_attr", _meta(attr), tensor_value_hash(attr)]
                else:
                    canon = ["attr", type(attr).__name__]
                op = "get_attr"
            else:  # call_function (call_module/call_method do not occur in exported graphs)
                op = op_name(node.target)
                canon = [node.op, op, self.arg(list(node.args)), self.arg(dict(node.kwargs))]
                if _is_nondeterministic(node.target):
                    canon.append(["after_random", self.last_random])
            h = _h([canon, meta])
            if node.op == "call_function" and _is_nondeterministic(node.target):
                self.last_random = h
            self.hashes[node] = h
            self.canon_args[node] = (op, canon, meta)


def _reachable(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    out = [n for n in gm.graph.nodes if n.op == "output"]
    seen: set[torch.fx.Node] = set()
    stack = list(out)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _short_args(canon: Any) -> Any:
    """Canonical args with node hashes shortened, for display."""
    if isinstance(canon, list):
        if len(canon) == 2 and canon[0] == "%" and isinstance(canon[1], str):
            return ["%", canon[1][:8]]
        return [_short_args(c) for c in canon]
    return canon


def _fingerprint_graph(gm: torch.fx.GraphModule, roles: dict[str, Any], output_roles: list | None = None) -> GraphFingerprint:
    hs = _Hasher(gm, roles)
    hs.run()
    live = _reachable(gm)
    nodes: list[NodeInfo] = []
    ops: Counter = Counter()
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "output" or node not in live:
            continue
        op, canon, meta = hs.canon_args[node]
        if node.op == "call_function":
            ops[op] += 1
        args = canon[2:] if node.op == "call_function" else canon
        nodes.append(NodeInfo(
            index=i, hash=hs.hashes[node], op=op if node.op != "placeholder" else f"input {json.dumps(canon[1])}",
            args=_short_args(args), meta=meta,
            inputs=tuple(hs.hashes[a] for a in node.all_input_nodes), source=_source(node),
        ))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    out_canon = []
    for j, o in enumerate(outs):
        role = output_roles[j] if output_roles is not None else ["out", j]
        out_canon.append([role, hs.arg(o)])
    # Every input is part of the signature, used or not (a compiled artifact expects them all).
    inputs = sorted(json.dumps(["input", roles.get(n.name), _meta(n.meta.get("val"))])
                    for n in gm.graph.nodes if n.op == "placeholder")
    graph_hash = _h(["trnrt-graph", HASH_VERSION, inputs, out_canon])
    return GraphFingerprint(hash=graph_hash, nodes=nodes, op_counts=dict(sorted(ops.items())),
                            num_nodes=len(nodes))


def fingerprint(ep: "torch.export.ExportedProgram", decompose: bool = True) -> GraphFingerprint:
    """The canonical fingerprint of an exported program (functionalised first)."""
    from torch.export.graph_signature import InputKind, OutputKind

    if decompose:
        # An empty table functionalises (in-place updates become data flow and outputs) without
        # lowering composite ops, so reports name the ops the model code calls.
        from .torch_warnings import quiet_torch_leafspec_warning

        with quiet_torch_leafspec_warning():  # torch deep-copies its own pytree specs here
            ep = ep.run_decompositions({})
    sig = ep.graph_signature
    roles: dict[str, Any] = {}
    user_pos: dict[str, int] = {}
    k = 0
    for spec in sig.input_specs:
        name = spec.arg.name if hasattr(spec.arg, "name") else str(spec.arg)
        if spec.kind == InputKind.USER_INPUT:
            roles[name] = ["user", k]
            user_pos[name] = k
            k += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            roles[name] = [spec.kind.name.lower(), spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            val = ep.constants.get(spec.target)
            roles[name] = ["constant", _meta(val) if isinstance(val, torch.Tensor) else None,
                           tensor_value_hash(val) if isinstance(val, torch.Tensor) else repr(type(val))]
        else:
            roles[name] = [spec.kind.name.lower(), spec.target]
    out_roles = []
    user_out = 0
    for spec in sig.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            out_roles.append(["user_output", user_out])
            user_out += 1
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            out_roles.append(["mutates_user_input", user_pos.get(spec.target, spec.target)])
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            out_roles.append(["mutates_buffer", spec.target])
        else:
            out_roles.append([spec.kind.name.lower(), spec.target])
    return _fingerprint_graph(ep.graph_module, roles, out_roles)


# ---------------------------------------------------------------------------------------------
# Comparing fingerprints


@dataclass
class GraphDiff:
    """Why two graphs differ: op-count delta and the first differing node on each side."""

    op_delta: dict[str, int]
    current: NodeInfo | None  # first node of the current graph that the reference lacks
    reference: NodeInfo | None  # its counterpart in the reference, when the reference is at hand
    note: str = ""

    def render(self, indent: str = "  ") -> str:
        lines = []
        if self.op_delta:
            lines.append(f"{indent}op-count delta: " + ", ".join(f"{k} {v:+d}" for k, v in sorted(self.op_delta.items())))
        if self.current is not None:
            lines.append(f"{indent}first difference at node #{self.current.index}:")
            if self.reference is not None:
                lines.append(f"{indent}  reference  {self.reference.describe()}")
                lines.append(f"{indent}             @ {self.reference.source or '(no source)'}")
            lines.append(f"{indent}  current    {self.current.describe()}")
            lines.append(f"{indent}             @ {self.current.source or '(no source)'}")
        if self.note:
            lines.append(f"{indent}{self.note}")
        return "\n".join(lines)


def op_delta(reference_counts: dict[str, int], current_counts: dict[str, int]) -> dict[str, int]:
    keys = set(reference_counts) | set(current_counts)
    d = {k: current_counts.get(k, 0) - reference_counts.get(k, 0) for k in keys}
    return {k: v for k, v in d.items() if v}


def _frontier(nodes: list[NodeInfo], known: set[str], short: bool) -> list[NodeInfo]:
    """Nodes absent from `known` whose inputs are all present: where a change originates."""
    key = (lambda h: h[:SHORT]) if short else (lambda h: h)
    return [n for n in nodes if key(n.hash) not in known and all(key(i) in known for i in n.inputs)]


def diff_against_hashes(current: GraphFingerprint, reference_short_hashes: set[str],
                        reference_counts: dict[str, int]) -> GraphDiff:
    """Diff when only the reference's node hashes (as in a lock file) are known."""
    fr = _frontier(current.nodes, reference_short_hashes, short=True)
    first = fr[0] if fr else None
    note = "" if first is not None else "no differing node found (the difference is in the signature or outputs)"
    return GraphDiff(op_delta(reference_counts, current.op_counts), first, None, note)


def diff_fingerprints(reference: GraphFingerprint, current: GraphFingerprint) -> GraphDiff:
    """Full diff of two fingerprints: pair the first new node with its counterpart by inputs."""
    ref_hashes = {n.hash for n in reference.nodes}
    cur_hashes = {n.hash for n in current.nodes}
    fr_cur = _frontier(current.nodes, ref_hashes, short=False)
    fr_ref = _frontier(reference.nodes, cur_hashes, short=False)
    first = fr_cur[0] if fr_cur else None
    counterpart = None
    if first is not None:
        same_inputs = [n for n in fr_ref if set(n.inputs) == set(first.inputs)]
        same_op = [n for n in same_inputs if n.op == first.op]
        pool = same_op or same_inputs or [n for n in fr_ref if n.op == first.op] or fr_ref
        counterpart = pool[0] if pool else None
    elif fr_ref:  # only removals: report the first node the current graph lost
        return GraphDiff(op_delta(reference.op_counts, current.op_counts), None, fr_ref[0],
                         f"node removed: {fr_ref[0].describe()} @ {fr_ref[0].source}")
    note = "" if first is not None else "no differing node found (the difference is in the signature or outputs)"
    return GraphDiff(op_delta(reference.op_counts, current.op_counts), first, counterpart, note)
