"""Canonical graph identity on small modules: what must not move the hash, and what must."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trnrt.compile.graph_hash import diff_against_hashes, diff_fingerprints, fingerprint


class Base(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, x, cache, idx):
        h = F.silu(self.lin(x))
        z = x * 2.0
        cache.index_copy_(0, idx, h)  # in-place state update: part of the identity
        return h.mean(-1) + z.sum(-1) + self.eps


class RenamedDeadSwapped(Base):
    # a forward-argument rename, a local rename, a dead Python line, a dead tensor op and two
    # independent lines swapped
    def forward(self, inp, kv, positions):
        twice = inp * 2.0
        unused = 3  # noqa: F841
        dead = inp + 5.0  # noqa: F841
        act = F.silu(self.lin(inp))
        kv.index_copy_(0, positions, act)
        return act.mean(-1) + twice.sum(-1) + self.eps


class Gelu(Base):
    def forward(self, x, cache, idx):
        h = F.gelu(self.lin(x))
        z = x * 2.0
        cache.index_copy_(0, idx, h)
        return h.mean(-1) + z.sum(-1) + self.eps


class Rewired(Base):  # the same ops, one input swapped
    def forward(self, x, cache, idx):
        h = F.silu(self.lin(x))
        z = h * 2.0
        cache.index_copy_(0, idx, h)
        return h.mean(-1) + z.sum(-1) + self.eps


class NoStateWrite(Base):
    def forward(self, x, cache, idx):
        h = F.silu(self.lin(x))
        z = x * 2.0
        return h.mean(-1) + z.sum(-1) + self.eps


def fp(mod_cls, batch=2, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    m = mod_cls(**kw).to(dtype)
    args = (torch.randn(batch, 8, dtype=dtype), torch.zeros(4, 8, dtype=dtype), torch.arange(batch))
    return fingerprint(torch.export.export(m, args))


@pytest.fixture(scope="module")
def base():
    return fp(Base)


def test_deterministic(base):
    assert fp(Base).hash == base.hash


def test_renames_dead_code_and_order_do_not_count(base):
    assert fp(RenamedDeadSwapped).hash == base.hash


def test_weights_do_not_count(base):
    torch.manual_seed(1)
    m = Base()
    with torch.no_grad():
        m.lin.weight.mul_(3.0)
    args = (torch.randn(2, 8), torch.zeros(4, 8), torch.arange(2))
    assert fingerprint(torch.export.export(m, args)).hash == base.hash


@pytest.mark.parametrize(
    "variant",
    [
        dict(mod_cls=Base, eps=1e-5),  # a constant
        dict(mod_cls=Base, eps=1e-6 * (1 + 1e-7)),  # a constant, by one part in 10^7
        dict(mod_cls=Gelu),  # an activation
        dict(mod_cls=Base, batch=3),  # a shape
        dict(mod_cls=Base, dtype=torch.float64),  # a dtype
        dict(mod_cls=Rewired),  # wiring
        dict(mod_cls=NoStateWrite),  # a dropped in-place state update
    ],
    ids=["eps", "eps-1e-7", "activation", "shape", "dtype", "wiring", "state-write"],
)
def test_changes_do_count(base, variant):
    assert fp(**variant).hash != base.hash


def test_diff_names_first_node_and_source_line(base):
    d = diff_fingerprints(base, fp(Gelu))
    assert d.op_delta == {"aten.gelu.default": 1, "aten.silu.default": -1}
    assert d.current.op == "aten.gelu.default" and d.reference.op == "aten.silu.default"
    text = d.render()
    assert "test_graph_hash.py" in text and "F.gelu(self.lin(x))" in text

    d = diff_fingerprints(base, fp(Base, eps=1e-5))
    assert d.op_delta == {}
    assert d.current.op == "aten.add.Tensor"
    assert (1e-5).hex() in d.render() and (1e-6).hex() in d.render()


def test_diff_from_lock_hashes_only(base):
    cur = fp(Base, eps=1e-5)
    d = diff_against_hashes(cur, set(base.short_hashes()), base.op_counts)
    assert d.reference is None
    assert d.current.op == "aten.add.Tensor" and "self.eps" in d.render()


def test_random_ops_are_not_merged():
    class TwoDraws(nn.Module):
        def forward(self, x):
            return torch.rand_like(x) - torch.rand_like(x)

    class OneDraw(nn.Module):
        def forward(self, x):
            r = torch.rand_like(x)
            return r - r

    a = fingerprint(torch.export.export(TwoDraws(), (torch.zeros(3),)))
    b = fingerprint(torch.export.export(OneDraw(), (torch.zeros(3),)))
    assert a.hash != b.hash
