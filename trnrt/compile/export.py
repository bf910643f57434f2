"""torch.export of one graph spec: the step function with the model's state as graph inputs.

Why the state goes in as inputs: the model keeps its paged cache and slot tensors in a plain
ModelState object, not in registered buffers, so torch.export would lift them as *constants* and
silently drop the in-place updates (measured: no mutation output at all). Passed as user inputs,
their in-place updates become USER_INPUT_MUTATION outputs of the functionalised graph, and
AOTInductor writes them back into the very tensors it was called with (measured on torch 2.13
CPU: the compiled call updates the caller's tensors in place). So the compiled callable takes the
engine's own state tensors on every call and updates them where they are.

Why plain tensor attributes of modules are turned into buffers for the export: tensors such as
fused projection matrices, stored as ordinary attributes, would otherwise be lifted as constants,
hashed by value (a weight change would move the graph hash) and baked into the compiled artifact
instead of being shared with the live model. As buffers they are graph inputs named by FQN, like
parameters, and AOTInductor takes them from the caller at load time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trnrt.config.engine_config import EngineConfig
from trnrt.engine.runner.step import STEP_INPUT_NAMES, STEP_OUTPUT_NAMES, GraphSpec, StepFunction, example_inputs

from .catalogue import BASE_VARIANT, get_variant
from .torch_warnings import quiet_torch_leafspec_warning


# ---------------------------------------------------------------------------------------------
# State tensors: flatten to a list, and rebuild a state object around other tensors


def state_tensors(state: Any) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors with stable names, in a fixed order.

    Supports a dataclass (tensor fields in field order; ModelState), an nn.Module (its buffers),
    a dict, or a list/tuple of tensors.
    """
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)
                if isinstance(getattr(state, f.name), torch.Tensor)]
    if isinstance(state, nn.Module):
        return list(state.named_buffers())
    if isinstance(state, dict):
        return [(str(k), v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    if isinstance(state, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(state) if isinstance(v, torch.Tensor)]
    raise TypeError(f"cannot find the tensors of a state of type {type(state).__name__}")


def rebind_state(state: Any, tensors: list[torch.Tensor]) -> Any:
    """A shallow copy of `state` holding `tensors` instead of its own (same order as state_tensors)."""
    names = [n for n, _ in state_tensors(state)]
    if len(names) != len(tensors):
        raise ValueError(f"state has {len(names)} tensors, got {len(tensors)}")
    new = dict(zip(names, tensors))
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **new)
    if isinstance(state, nn.Module):
        import copy

        clone = copy.copy(state)
        clone._buffers = dict(state._buffers)
        clone._modules = dict(state._modules)
        for name, t in new.items():
            *path, leaf = name.split(".")
            mod = clone
            for p in path:
                child = copy.copy(getattr(mod, p))
                child._buffers = dict(child._buffers)
                child._modules = dict(child._modules)
                mod._modules[p] = child
                mod = child
            mod._buffers[leaf] = t
        return clone
    if isinstance(state, dict):
        out = dict(state)
        out.update(new)
        return out
    out = list(state)
    for i, t in zip([int(n) for n in names], tensors):
        out[i] = t
    return type(state)(out) if isinstance(state, tuple) else out


# ---------------------------------------------------------------------------------------------
# Plain tensor attributes of modules -> temporary buffers


def plain_tensor_attrs(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, FQN) of every tensor stored as a plain attribute (not param/buffer)."""
    out = []
    for prefix, mod in model.named_modules():
        for name, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and not name.startswith("__"):
                out.append((mod, name, f"{prefix}.{name}" if prefix else name))
    return out


@contextlib.contextmanager
def tensors_as_buffers(model: nn.Module) -> Iterator[None]:
    """Within the block, plain tensor attributes are registered as non-persistent buffers."""
    moved = plain_tensor_attrs(model)
    for mod, name, _ in moved:
        t = vars(mod).pop(name)
        mod.register_buffer(name, t, persistent=False)
    try:
        yield
    finally:
        for mod, name, _ in moved:
            t = mod._buffers.pop(name)
            mod.__dict__[name] = t


def model_constants(model: nn.Module, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor a compiled graph reads from the model, by the FQN the export gave it."""
    out = {prefix + k: v for k, v in model.named_parameters(remove_duplicate=False)}
    out.update({prefix + k: v for k, v in model.named_buffers(remove_duplicate=False)})
    for _, _, fqn in plain_tensor_attrs(model):
        mod = model.get_submodule(fqn.rsplit(".", 1)[0]) if "." in fqn else model
        out[prefix + fqn] = getattr(mod, fqn.rsplit(".", 1)[-1])
    return out


# ---------------------------------------------------------------------------------------------
# The exported module


@contextlib.contextmanager
def without_mtp(model: nn.Module) -> Iterator[None]:
    """Within the block the model has no `mtp` submodule: a target graph (decode, prefill,
    verify) never reads the MTP layer, and its weights must not become inputs of those graphs
    (they would change their hashes between a model loaded with and without it)."""
    mods = getattr(model, "_modules", {})
    mtp = mods.get("mtp")
    if mtp is None:
        yield
        return
    mods["mtp"] = None
    try:
        yield
    finally:
        mods["mtp"] = mtp


def graph_model_state(model: nn.Module, state: Any, spec: GraphSpec) -> tuple[nn.Module, Any]:
    """The module and state a graph of `spec` runs over: the model and its ModelState, or for a
    `draft` graph the MTP parts (spec.draft_step.DraftModel) and the MTP stack (`state.mtp`)."""
    if spec.phase != "draft":
        return model, state
    from trnrt.engine.spec.draft_step import DraftModel

    if getattr(state, "mtp", None) is None:
        raise ValueError(f"{spec.graph_id}: the state has no MTP stack (allocate it with mtp=True)")
    return DraftModel(model), state.mtp


def step_output_names(spec: GraphSpec) -> tuple[str, ...]:
    from trnrt.engine.spec.draft_step import DRAFT_OUTPUT_NAMES, VERIFY_OUTPUT_NAMES

    if spec.phase == "verify":
        return VERIFY_OUTPUT_NAMES
    if spec.phase == "draft":
        return DRAFT_OUTPUT_NAMES
    if spec.phase == "spec_prefill":
        from trnrt.engine.spec.prefill import SPEC_PREFILL_OUTPUT_NAMES

        return SPEC_PREFILL_OUTPUT_NAMES
    return STEP_OUTPUT_NAMES if spec.variant == BASE_VARIANT else get_variant(spec.variant).output_names


class ExportStep(nn.Module):
    """step(*step_inputs, *state_tensors): the step function of one variant, state as inputs.

    `model` is a registered submodule (its parameters and buffers are graph inputs by FQN
    "model.<name>"); the state template is kept out of the module tree on purpose.
    """

    def __init__(self, model: nn.Module, state: Any, engine_config: EngineConfig, variant: str = BASE_VARIANT,
                 sampling: str = "full", phase: str = "decode", tokens: int = 1):
        super().__init__()
        self.phase = phase
        self.tokens = tokens
        self.model = model
        object.__setattr__(self, "_state_template", state)
        self.num_state = len(state_tensors(state))
        self.engine_config = engine_config
        self.variant = variant
        self.sampling = sampling

    def make_step(self, state: Any) -> nn.Module:
        if self.phase == "verify":
            from trnrt.engine.spec.verify import VerifyFunction

            return VerifyFunction(self.model, state, greedy_only=self.sampling == "greedy")
        if self.phase == "draft":
            from trnrt.engine.spec.draft_step import DraftFunction

            return DraftFunction(self.model, state, self.tokens - 1)
        if self.phase == "spec_prefill":
            from trnrt.engine.spec.prefill import SpecPrefillFunction

            return SpecPrefillFunction(self.model, state, self.engine_config.max_top_logprobs)
        if self.variant == BASE_VARIANT:
            return StepFunction(self.model, state, self.engine_config.max_top_logprobs, self.sampling)
        step = get_variant(self.variant).make_step(self.model, state, self.engine_config)
        if self.sampling != "full":
            if not isinstance(step, StepFunction):
                raise ValueError(f"variant {self.variant!r} has no {self.sampling} sampler")
            step.sampling = self.sampling
        return step

    def forward(self, *args: torch.Tensor):
        n = len(args) - self.num_state
        inputs, st = args[:n], args[n:]
        state = rebind_state(self._state_template, list(st))
        return tuple(self.make_step(state)(*inputs))


def spec_inputs(spec: GraphSpec, engine_config: EngineConfig, vocab_size: int, device="cpu",
                hidden_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """Example step inputs of `spec` (base inputs, then the variant's extra inputs; a draft
    graph's own inputs, spec.draft_step.DRAFT_INPUT_NAMES)."""
    if spec.phase == "draft":  # hidden_size: the model's (its config.hidden_size), needed here only
        from trnrt.engine.runner.graph_inputs import draft_example_inputs

        if hidden_size is None:
            raise ValueError(f"{spec.graph_id}: a draft graph's example inputs need the model's hidden_size")
        return draft_example_inputs(spec.batch, spec.tokens - 1, engine_config.table_blocks(spec.context),
                                    int(hidden_size), getattr(torch, engine_config.dtype), device=device)
    base = example_inputs(spec, engine_config.table_blocks(spec.context), vocab_size, device=device)
    if spec.variant == BASE_VARIANT:
        return base
    extra = get_variant(spec.variant).example_extra_inputs(spec, engine_config, vocab_size, device)
    return tuple(base) + tuple(extra)


def input_names(spec: GraphSpec, state: Any) -> list[str]:
    if spec.phase == "draft":
        from trnrt.engine.spec.draft_step import DRAFT_INPUT_NAMES

        return list(DRAFT_INPUT_NAMES) + [f"state.mtp.{n}" for n, _ in state_tensors(state)]
    names = list(STEP_INPUT_NAMES)
    if spec.variant != BASE_VARIANT:
        names += list(get_variant(spec.variant).extra_input_names)
    return names + [f"state.{n}" for n, _ in state_tensors(state)]


def _tensor_meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


@dataclass
class ExportedGraph:
    spec: GraphSpec
    program: "torch.export.ExportedProgram"
    inputs: list[dict]  # name, shape, dtype (step inputs, then state tensors)
    outputs: list[dict]  # name, shape, dtype
    export_s: float
    graph_hash: str = ""  # set by the pipeline once hashed (graph_hash.fingerprint)


def vocab_size_of(model: nn.Module) -> int:
    return int(model.config.vocab_size)


def export_spec(model: nn.Module, state: Any, engine_config: EngineConfig, spec: GraphSpec,
                device: str | torch.device | None = None) -> ExportedGraph:
    """torch.export the step graph of `spec` (strict=False: the model is plain PyTorch)."""
    import time

    dev = device if device is not None else next(iter(state_tensors(state)))[1].device
    vocab = vocab_size_of(model)
    inputs = spec_inputs(spec, engine_config, vocab, device=dev, hidden_size=model.config.hidden_size)
    gmodel, gstate = graph_model_state(model, state, spec)
    st = [t for _, t in state_tensors(gstate)]
    t0 = time.perf_counter()
    hide = without_mtp(gmodel) if spec.phase != "draft" else contextlib.nullcontext()
    with hide, tensors_as_buffers(gmodel), quiet_torch_leafspec_warning():
        mod = ExportStep(gmodel, gstate, engine_config, spec.variant, spec.sampling, spec.phase, spec.tokens)
        ep = torch.export.export(mod, tuple(inputs) + tuple(st), strict=False)
    dt = time.perf_counter() - t0
    names = input_names(spec, gstate)
    in_meta = [{"name": n, **_tensor_meta(t)} for n, t in zip(names, list(inputs) + st)]
    out_vals = [n.meta.get("val") for n in _output_nodes(ep)]
    step_out = step_output_names(spec)
    out_names = list(step_out) + [f"out{i}" for i in range(len(step_out), len(out_vals))]
    out_meta = [{"name": n, **_tensor_meta(v)} for n, v in zip(out_names, out_vals) if isinstance(v, torch.Tensor)]
    return ExportedGraph(spec=spec, program=ep, inputs=in_meta, outputs=out_meta, export_s=dt)


def _output_nodes(ep) -> list:
    out = next(n for n in ep.graph.nodes if n.op == "output")
    vals = out.args[0]
    return [v for v in (vals if isinstance(vals, (list, tuple)) else [vals]) if hasattr(v, "meta")]


def eager_callable(model: nn.Module, state: Any, engine_config: EngineConfig, spec: GraphSpec) -> Callable:
    """The step of `spec` run eagerly, with the shapes checked against the spec."""
    gmodel, gstate = graph_model_state(model, state, spec)
    step = ExportStep(gmodel, gstate, engine_config, spec.variant, spec.sampling, spec.phase,
                      spec.tokens).make_step(gstate)
    b, s, mb = spec.batch, spec.tokens, engine_config.table_blocks(spec.context)

    def run(*inputs: torch.Tensor):
        if tuple(inputs[0].shape) != (b, s) or tuple(inputs[3].shape) != (b, mb):
            raise ValueError(f"{spec.graph_id}: inputs of shape {tuple(inputs[0].shape)} / "
                             f"{tuple(inputs[3].shape)}, expected {(b, s)} / {(b, mb)}")
        with torch.no_grad():
            return tuple(step(*inputs))

    return run
