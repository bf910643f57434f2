"""A safetensors file read with pread into the caller's own buffers: a slice costs only its
bytes (plus one bounded chunk), never the pages of the whole tensor.

safetensors' `safe_open` memory-maps the file: a column slice (a row-parallel weight) touches
every page of the tensor, and those file pages count in the process's RSS until the file is
closed, so a rank reading a tenth of a checkpoint would peak near the whole of what it touched.
Here rows are read whole (one `preadv` into the result when the slice keeps whole rows), or in
chunks of at most CHUNK_BYTES whose kept columns are copied out. The format: an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

CHUNK_BYTES = 4 << 20
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """`with SafetensorsFile(path) as f: f.keys(); f.get_slice(name)[idx]` (safe_open's reading API)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        n = struct.unpack("<Q", os.pread(self.fd, 8, 0))[0]
        header = json.loads(os.pread(self.fd, n, 8))
        self.meta = header.pop("__metadata__", None) or {}
        self.entries = header
        self.base = 8 + n

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def keys(self) -> list[str]:
        return list(self.entries)

    def metadata(self) -> dict:
        return self.meta

    def get_slice(self, name: str) -> "_Slice":
        e = self.entries[name]
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']}")
        return _Slice(self, _DTYPES[e["dtype"]], tuple(e["shape"]), self.base + e["data_offsets"][0])


class _Slice:
    def __init__(self, f: SafetensorsFile, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.f, self.dtype, self.shape, self.offset = f, dtype, shape, offset

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _read(self, start: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        got = os.preadv(self.f.fd, [memoryview(buf.numpy())], self.offset + start)
        if got != nbytes:
            raise OSError(f"{self.f.path}: short read ({got} of {nbytes} bytes)")
        return buf

    def __getitem__(self, idx) -> torch.Tensor:
        if not isinstance(idx, tuple):
            idx = (idx,)
        shape = self.shape
        if not shape:
            return self._read(0, self.dtype.itemsize).view(self.dtype).reshape(())
        sl = [range(n)[s] for s, n in zip(idx + (slice(None),) * (len(shape) - len(idx)), shape)]
        if any(r.step != 1 for r in sl):
            raise ValueError("only step-1 slices are supported")
        row = math.prod(shape[1:]) * self.dtype.itemsize  # bytes of one dim-0 row
        rows = sl[0]
        whole_rows = all(len(r) == n for r, n in zip(sl[1:], shape[1:]))
        if whole_rows:  # one read straight into the result
            out = self._read(rows.start * row, len(rows) * row)
            return out.view(self.dtype).view(len(rows), *shape[1:])
        out = torch.empty((len(rows),) + tuple(len(r) for r in sl[1:]), dtype=self.dtype)
        inner = tuple(slice(r.start, r.stop) for r in sl[1:])
        step = max(1, CHUNK_BYTES // max(row, 1))
        for a in range(0, len(rows), step):
            n = min(step, len(rows) - a)
            chunk = self._read((rows.start + a) * row, n * row).view(self.dtype).view(n, *shape[1:])
            out[a:a + n] = chunk[(slice(None),) + inner]
        return out
