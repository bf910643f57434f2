"""Exporting a step whose state lives in a plain object: state as inputs, updates as outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from trnrt.compile.export import plain_tensor_attrs, rebind_state, state_tensors, tensors_as_buffers


@dataclass
class State:
    cache: torch.Tensor
    slots: torch.Tensor
    block_size: int = 4


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fused = torch.ones(4)  # a plain tensor attribute, as fused weights are

    def forward(self, x, idx, state: State):
        y = self.lin(x) * self.fused
        state.cache.index_copy_(0, idx, y)
        state.slots[idx] += 1.0
        return y.sum(-1)


class Wrapper(nn.Module):
    def __init__(self, model, state):
        super().__init__()
        self.model = model
        object.__setattr__(self, "template", state)

    def forward(self, x, idx, *st):
        return self.model(x, idx, rebind_state(self.template, list(st)))


def test_state_tensors_and_rebind():
    s = State(torch.zeros(3, 4), torch.zeros(3, 4))
    assert [n for n, _ in state_tensors(s)] == ["cache", "slots"]
    a, b = torch.ones(1), torch.ones(2)
    r = rebind_state(s, [a, b])
    assert r.cache is a and r.slots is b and r.block_size == 4 and s.cache.shape == (3, 4)


def test_state_updates_become_mutation_outputs_and_attrs_become_buffers():
    m, s = Model(), State(torch.zeros(3, 4), torch.zeros(3, 4))
    assert [fqn for _, _, fqn in plain_tensor_attrs(m)] == ["fused"]
    with tensors_as_buffers(m):
        ep = torch.export.export(Wrapper(m, s), (torch.randn(2, 4), torch.tensor([0, 2]), s.cache, s.slots))
    assert isinstance(vars(m)["fused"], torch.Tensor) and "fused" not in m._buffers  # restored
    ep = ep.run_decompositions({})
    kinds = [spec.kind for spec in ep.graph_signature.output_specs]
    assert kinds.count(OutputKind.USER_INPUT_MUTATION) == 2
    ins = {spec.target: spec.kind for spec in ep.graph_signature.input_specs if spec.target}
    assert ins["model.fused"] == InputKind.BUFFER  # by FQN, not a constant hashed by value
