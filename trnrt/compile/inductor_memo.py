"""Unbounded memo caches for Inductor's vectorisation index analysis (cpu backend compile time).

The C++ codegen asks, per kernel and loop variable, for the stride of every index expression
within a vector lane (`torch._inductor.sizevars.stride_at_vec_range` and the two helpers it calls,
each a `sympy.simplify`). torch keeps them in `functools.lru_cache`s of the default 128 entries,
but one graph of the tiny model asks about ~520 distinct expressions in a cycle (its six
layers repeat the same kernels), so the caches thrash: measured on decode-b8-t1-base-greedy
(torch 2.13), 1,986 misses with 128 entries vs 520 unbounded, and ~18 s less Python CPU per graph
(106 -> 88 s); later graphs of the same process then miss almost never (+6 misses for the next).

The functions are pure (sympy in, sympy out; the free symbols they introduce are named
deterministically), so the generated C++ is byte-identical (checked: same wrapper and kernel
source). install() only swaps the cache size; it leaves torch alone if the functions are not
there or not lru_cache'd (another torch version).
"""

from __future__ import annotations

import functools

_NAMES = ("stride_at", "simplify_index_in_vec_range", "stride_at_vec_range")


def install() -> bool:
    """Give the three functions unbounded caches (idempotent). True when they are in place."""
    try:
        from torch._inductor import sizevars
        from torch._inductor.codegen import cpp
    except ImportError:
        return False
    fns = [getattr(sizevars, n, None) for n in _NAMES]
    if not all(callable(f) and hasattr(f, "__wrapped__") and hasattr(f, "cache_info") for f in fns):
        return False
    if all(f.cache_info().maxsize is None for f in fns):
        return True
    for name, f in zip(_NAMES, fns):
        # the callers look these names up in sizevars' globals at call time
        setattr(sizevars, name, functools.lru_cache(maxsize=None)(f.__wrapped__))
    if getattr(cpp, "stride_at_vec_range", None) is not None:  # imported by name
        cpp.stride_at_vec_range = sizevars.stride_at_vec_range
    return True
