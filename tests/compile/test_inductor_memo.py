"""trnrt.compile.inductor_memo: unbounded caches, same answers as torch's functions."""

from __future__ import annotations

import sympy


def test_install_makes_the_vectorisation_analysis_caches_unbounded_with_the_same_results():
    from torch._inductor import sizevars
    from torch._inductor.codegen import cpp
    from torch._inductor.utils import sympy_index_symbol

    from trnrt.compile import inductor_memo

    original = sizevars.stride_at_vec_range.__wrapped__
    assert inductor_memo.install() and inductor_memo.install()  # idempotent
    fn = sizevars.stride_at_vec_range
    assert fn.cache_info().maxsize is None and cpp.stride_at_vec_range is fn
    assert all(getattr(sizevars, n).cache_info().maxsize is None for n in inductor_memo._NAMES)
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    x0, x1 = sympy_index_symbol("x0"), sympy_index_symbol("x1")
    exprs = [x0 + 64 * x1, ModularIndexing(x0, 1, 32) + 16 * FloorDiv(x0, 32), 3 * x0 * x0 + x1, sympy.Integer(7)]
    for e in exprs:
        for vec in (None, 8, 16):
            assert fn(e, x0, vec) == original(e, x0, vec), (e, vec)
    assert fn(exprs[0], x0, 16) == 1 and fn(exprs[0], x1, 16) == 64
