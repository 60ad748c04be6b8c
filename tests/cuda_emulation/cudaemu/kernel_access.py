"""Which device memory a kernel launch reads and writes, for the race checker.

gpukv's kernels reach most of their arrays through pointer tables (device arrays of
addresses), so each of its kernels declares here how to read its table, by the roles of
its entries (an out is written, a term read; the optimizer's weights, master copy and
states are read and written, its gradient only read). The table itself is read from
what the host last put there (`shadow`: the bytes of a queued copy from the host, which
has not run yet) or from device memory. Any other kernel is judged by its parameters:
the memory from each pointer argument to the end of its allocation is read, and also
written unless the parameter points to const.
"""
from __future__ import annotations

import ctypes
import re

import numpy as np

from . import memory

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1,
             "uint8": 1, "int32": 4, "int64": 8}
_META = 6    # int64 words per key of the multi-key sum's table
_NPTR = 6    # pointers per key of the optimizer's table: W, G, M, S0, S1, S2


def _words(ptr: int, count: int) -> np.ndarray:
    """`count` int64 words at device address `ptr`, as the host last wrote them (none
    past the end of the allocation)."""
    data = memory.shadow.get(ptr)
    if data is not None and len(data) >= 8 * count:
        return np.frombuffer(data, np.int64, count)
    mem = memory.find(ptr)
    if mem is None:
        return np.zeros(0, np.int64)
    count = min(count, (mem.ptr + mem.size - ptr) // 8)
    return np.frombuffer(ctypes.string_at(ptr, 8 * count), np.int64).copy()


def _span(ptr: int, nbytes: int, write: bool) -> tuple:
    return (int(ptr), int(nbytes), write, memory.find(int(ptr)))


def _to_end(ptr: int, write: bool):
    mem = memory.find(int(ptr))
    if mem is None:
        return None
    return (int(ptr), mem.ptr + mem.size - int(ptr), write, mem)


def _multi_sum(fn, args) -> list:
    m = re.fullmatch(r"gpukv_multi_sum_(\w+?)_(\w+)", fn.name)
    t, u = _ITEMSIZE[m.group(1)], _ITEMSIZE[m.group(2)]
    table, nkeys = args[0], int(args[1])
    tptr = table.data.ptr
    head = _words(tptr, (nkeys + 1) + _META * nkeys)
    if head.size < (nkeys + 1) + _META * nkeys:
        return _by_parameters(fn, args)
    meta = head[nkeys + 1:].reshape(nkeys, _META)
    npointers = int(max((r[2] + r[3] + r[5] for r in meta), default=0))
    words = _words(tptr, nkeys + 1 + _META * nkeys + npointers)
    if words.size < nkeys + 1 + _META * nkeys + npointers:
        return _by_parameters(fn, args)
    ptrs = words[nkeys + 1 + _META * nkeys:]
    out = [_span(tptr, words.nbytes, False)]
    for out_ptr, n, a_off, na, b_off, nb in meta:
        out.append(_span(out_ptr, n * u, True))
        out += [_span(p, n * t, False) for p in ptrs[a_off:a_off + na]]
        out += [_span(p, n * u, False) for p in ptrs[b_off:b_off + nb]]
    return out


def _optim_step(fn, args) -> list:
    text = fn.module.prepared.text
    ct = 8 if re.search(r"#define\s+CT_TYPE\s+double", text) else 4
    wkind = re.search(r"#define\s+WKIND\s+(\d)", text)
    wt = 2 if wkind and wkind.group(1) in ("1", "2") else ct
    d_ptrs, d_sizes = args[0], args[1]
    n = d_sizes.size
    ptrs, sizes = _words(d_ptrs.data.ptr, _NPTR * n), _words(d_sizes.data.ptr, n)
    if ptrs.size < _NPTR * n or sizes.size < n:
        return _by_parameters(fn, args)
    ptrs = ptrs.reshape(n, _NPTR)
    out = [r for r in (_to_end(a.data.ptr, i >= 7) for i, a in enumerate(args[:9])) if r]
    for row, size in zip(ptrs, sizes):
        for j, p in enumerate(row):
            if p:
                out.append(_span(p, size * (wt if j == 0 else ct), j != 1))
    return out


_DECLARED = {"gpukv_multi_sum_": _multi_sum, "gpukv_optim_step": _optim_step}


def _by_parameters(fn, args) -> list:
    out = []
    for value, param in zip(args, fn.params):
        ptr = getattr(getattr(value, "data", None), "ptr", None)
        if not ptr:
            continue
        const = param.declaration.lstrip().startswith("const") if param.declaration \
            else "const" in param.ctype
        found = _to_end(ptr, not const)  # a write covers the kernel's reads of it too
        if found is not None:
            out.append(found)
    return out


def ranges(fn, args) -> list:
    """[(ptr, nbytes, write, Memory)] the launch of `fn` with `args` touches."""
    for prefix, declared in _DECLARED.items():
        if fn.name.startswith(prefix):
            return [r for r in declared(fn, args) if r[1] > 0]
    return [r for r in _by_parameters(fn, args) if r[1] > 0]
