"""Sums and copies in main memory: NumPy in cache-sized blocks, split over threads.

Large host reductions are limited by memory bandwidth, not arithmetic. Two things keep the
traffic near its minimum (for k sources: k reads and 1 write to reduce, 1 read and k writes
to broadcast):

- Blocks: the running sum of one block stays in the core's L2 while every source is added
  to it, so the output goes to memory once, not once per source; a broadcast copies one
  block of the source to every output while that block is still in cache.
- Threads: one core rarely saturates the memory of a modern CPU. NumPy releases the GIL
  inside ufuncs and copies, so large arrays are cut into contiguous chunks, one per
  thread of a small persistent pool (`GPUKV_HOST_THREADS`, default: usable CPUs, at
  most 4).

Small arrays skip all of that: one ufunc call per source, nothing else.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._dtypes import NARROW_FLOATS
from .._env import positive_int
from ..canonical.arrays import leaf_plan, run_adds
from . import host_jit
from .host_blocks import BLOCK, POOL_MIN, widen_fp16

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_NDARRAY = np.ndarray
_SAME: dict = {}  # ufunc keywords when every array has the output's dtype: none


def _l2_bytes() -> int:
    """The size of the L2 cache of CPU 0 (Linux sysfs), or 1 MiB when unknown."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        return 1 << 20


# Bytes per block: half of L2 holds the block of the output (the other half is left to
# the streaming sources), clamped to a range where per-block Python overhead is small.
BLOCK_BYTES = min(max(_l2_bytes() // 2, 128 << 10), 1 << 20)
# Arrays at least this large (bytes) are cut in blocks; smaller ones fit in cache anyway.
BLOCKED_BYTES = 1 << 20
# A thread of the pool gets at least this many bytes of output; smaller jobs run inline.
THREAD_BYTES = 1 << 20


def _default_threads() -> int:
    """`GPUKV_HOST_THREADS` (a positive integer), else the usable CPUs, at most 4."""
    threads = positive_int("GPUKV_HOST_THREADS")
    if threads is not None:
        return threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cpus or 1))


def share_cpus(processes: int) -> None:
    """This process shares the machine's CPUs with `processes` - 1 others (the ranks of an
    MPI job on one machine): unless GPUKV_HOST_THREADS says otherwise, a large sum or copy
    uses its share of them, not all of them."""
    if positive_int("GPUKV_HOST_THREADS") is None:
        globals()["THREADS"] = max(1, _default_threads() // max(1, processes))


def thread_count() -> int:
    """The threads a large host sum or copy is cut over (`THREADS`), read from the
    environment on first use; a malformed `GPUKV_HOST_THREADS` is an ArgumentError."""
    n = globals().get("THREADS")
    if n is None:
        n = globals()["THREADS"] = _default_threads()
    return n


def __getattr__(name: str):
    # `THREADS` is read lazily, so that importing gpukv never fails on the environment.
    if name == "THREADS":
        return thread_count()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ACC_CACHE: dict = {}


def accumulate_dtype(dtype):
    """The dtype sums of `dtype` are accumulated in: float32 for 16-bit floats."""
    dtype = np.dtype(dtype)
    acc = _ACC_CACHE.get(dtype)
    if acc is None:  # dtype.name is slow in NumPy, so it is read once per dtype
        acc = _ACC_CACHE[dtype] = _F32 if dtype.name in NARROW_FLOATS else dtype
    return acc


class _Pool:
    """A few persistent threads that run the chunks of one large sum or copy.

    The caller's thread runs the first chunk itself and waits for the others, so a call
    returns only when every chunk is written. Recreated after a fork (threads do not
    survive one).
    """

    def __init__(self):
        self._executor = None
        self._workers = 0
        self._pid = None
        self._lock = threading.Lock()

    def _get(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid() or self._workers < workers:
                if self._executor is not None and self._pid == os.getpid():
                    self._executor.shutdown(wait=False)  # too small: replaced by a larger one
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix="gpukv-host")
                self._workers = workers
                self._pid = os.getpid()
            return self._executor

    def run(self, fn, chunks: list) -> None:
        """Call `fn(*chunk)` for every chunk, concurrently; re-raise the first error."""
        if len(chunks) == 1:
            fn(*chunks[0])
            return
        executor = self._get(len(chunks) - 1)
        futures, inline = [], [chunks[0]]
        for chunk in chunks[1:]:
            try:
                futures.append(executor.submit(fn, *chunk))
            except RuntimeError:  # pool shut down (interpreter exit, resize): run it here
                inline.append(chunk)
        error = None
        try:
            for chunk in inline:
                fn(*chunk)
        except BaseException as e:  # noqa: B036 - re-raised below, after the others finish
            error = e
        for future in futures:
            try:
                future.result()
            except BaseException as e:  # noqa: B036
                error = error or e
        if error is not None:
            raise error


_POOL = _Pool()


def _chunks(n: int, itemsize: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges cutting n elements over the pool: whole blocks, THREAD_BYTES each."""
    parts = max(1, min(thread_count(), (n * itemsize) // THREAD_BYTES))
    if parts == 1:
        return [(0, n)]
    blocks = -(-n // block)
    edges = [min(n, (blocks * i // parts) * block) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def run_chunks(fn, chunks: list) -> None:
    """`fn(*chunk)` for every chunk on the host thread pool, the first on the calling
    thread; returns when all are done and re-raises the first error."""
    _POOL.run(fn, chunks)


def chunk_ranges(n: int, itemsize: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges cutting n elements of `itemsize` bytes over the host threads, in
    whole blocks of `block` elements, at least THREAD_BYTES of them per thread."""
    return _chunks(n, itemsize, block)


def _contiguous(arrays) -> bool:
    for a in arrays:
        if not a.flags.c_contiguous:
            return False
    return True


def _widened_chunks(n: int, itemsize: int, block: int) -> list | None:
    """The chunks of a sum that widens its float16 sources itself, or None where NumPy's
    cast is faster: a sum cut over a pool of fewer than POOL_MIN threads.
    (The widening is vector code, which two vCPUs of one core do not run faster; NumPy's
    per-element cast they run twice as fast.)"""
    chunks = _chunks(n, itemsize, block)
    if len(chunks) > 1 and thread_count() < POOL_MIN:
        return None
    return chunks


def _halves_into_float32(out, sources) -> bool:
    """Whether `sources` are float16 and float32 arrays summed into a float32 `out`, all
    C-contiguous: the sum `_sum_halves_range` does."""
    if out.dtype != _F32 or not out.flags.c_contiguous or not _contiguous(sources):
        return False
    for s in sources:
        if s.dtype != _F16 and s.dtype != _F32:
            return False
    return True


def _overlapping(arrays) -> bool:
    """Whether two of `arrays` may share memory (then only whole-array order is safe)."""
    for i in range(1, len(arrays)):
        for j in range(i):
            if np.may_share_memory(arrays[i], arrays[j]):
                return True
    return False


def _sum_range(out, first, second, rest, kwargs, block, lo, hi) -> None:
    add = np.add
    for start in range(lo, hi, block):
        stop = min(start + block, hi)
        acc = out[start:stop]
        add(first[start:stop], second[start:stop], acc, **kwargs)
        for s in rest:
            add(acc, s[start:stop], acc, **kwargs)


def _term(s, scratch):
    """Block `s` as float32: itself, or a float16 block widened into `scratch`."""
    if s.dtype != _F16:
        return s
    widen_fp16(s, scratch)
    return scratch


def _sum_halves_range(out, sources, lo, hi) -> None:
    """out[lo:hi] = the sum of float16 and float32 `sources` (flat, contiguous), in
    BLOCK blocks: each float16 block widened to float32 exactly (not by
    NumPy's per-element cast), then the float32 adds of np.add(..., dtype=float32), in
    the same order."""
    block = BLOCK
    wide = np.empty(min(block, hi - lo), _F32)
    for start in range(lo, hi, block):
        stop = min(start + block, hi)
        acc = out[start:stop]
        tmp = wide[:stop - start]
        first = _term(sources[0][start:stop], acc)
        np.add(first, _term(sources[1][start:stop], tmp), acc)
        for s in sources[2:]:
            np.add(acc, _term(s[start:stop], tmp), acc)


def _sum_two_halves_range(a, b, out, lo, hi) -> None:
    _sum_halves_range(out, [a, b], lo, hi)


def _widen_range(half, scale, out, accumulate, lo, hi) -> None:
    """out[lo:hi] = float32(half[lo:hi]) (float16 bits; NumPy's cast, which keeps NaN
    payloads), or added to it (`scale`, None: host_jit.fp16_decode's arguments)."""
    wide = half[lo:hi].view(np.float16).astype(np.float32)
    if accumulate:
        np.add(out[lo:hi], wide, out[lo:hi])
    else:
        out[lo:hi] = wide


def _sum_halves_compiled(out, sources, lo, hi) -> None:
    """`_sum_halves_range` compiled (host_jit), the same adds in the same order: two
    float16 sources first summed in one pass, then each next source widened and added
    in one, or added; a chunk with an inf or NaN in a float16 source by NumPy."""
    first = 0
    if sources[0].dtype == _F16 and sources[1].dtype == _F16:
        host_jit.with_twin(host_jit.fp16_sum_two, _sum_two_halves_range)(
            sources[0], sources[1], out, lo, hi)
        first = 2
    widen = host_jit.with_twin(host_jit.fp16_decode, _widen_range)
    for i in range(first, len(sources)):
        s = sources[i]
        if s.dtype == _F16:
            widen(s.view(np.uint16), None, out, i > 0, lo, hi)
        elif i == 0:
            np.copyto(out[lo:hi], s[lo:hi])
        else:
            np.add(out[lo:hi], s[lo:hi], out[lo:hi])


def host_sum(out: np.ndarray, sources: list) -> None:
    """Write the sum of `sources` (arrays of `out`'s shape) into `out`.

    Sources of another dtype than `out` (float16/bfloat16 into a float32 merge buffer)
    are accumulated in `out`'s dtype; when `out` itself is 16-bit the sum is done in a
    float32 buffer and rounded into `out` once. `out` must not be one of `sources`; any
    strides work.
    """
    dtype = out.dtype
    if len(sources) > 1 and out.nbytes < BLOCKED_BYTES and _ACC_CACHE.get(dtype) is dtype:
        # Small, and every source of out's dtype (the common case): the plain ufunc calls.
        for s in sources:
            if s.dtype is not dtype:
                break
        else:
            add = np.add
            add(sources[0], sources[1], out)
            for s in sources[2:]:
                add(out, s, out)
            return
    if len(sources) == 1:
        host_broadcast(sources[0], [out])
        return
    acc = accumulate_dtype(dtype)
    if acc is not dtype:  # a 16-bit out: never round the partial sums
        wide = np.empty(out.shape, acc)
        host_sum(wide, sources)
        host_broadcast(wide, [out])
        return
    first, second, rest = sources[0], sources[1], sources[2:]
    kwargs = _SAME
    for s in sources:
        if s.dtype is not dtype:  # e.g. float16 sources into a float32 merge buffer
            kwargs = {"dtype": acc, "casting": "unsafe"}
            break
    if kwargs is not _SAME and _halves_into_float32(out, sources):
        chunks = _widened_chunks(out.size, dtype.itemsize, BLOCK)
        compiled = host_jit.enabled()
        if compiled and chunks is None:  # compiled code, like the codecs: one thread there
            chunks = [(0, out.size)]
        if chunks is not None:
            flat_out = out.reshape(-1)
            flat = [s.reshape(-1) for s in sources]
            fn = _sum_halves_compiled if compiled else _sum_halves_range
            _POOL.run(fn, [(flat_out, flat, lo, hi) for lo, hi in chunks])
            return
    nbytes = out.nbytes
    if nbytes < BLOCKED_BYTES or not _contiguous(sources) or not out.flags.c_contiguous:
        np.add(first, second, out, **kwargs)
        for s in rest:
            np.add(out, s, out, **kwargs)
        return
    flat_out = out.reshape(-1)
    flat = [s.reshape(-1) for s in sources]
    block = max(1, BLOCK_BYTES // max(dtype.itemsize, acc.itemsize))
    chunks = [(flat_out, flat[0], flat[1], flat[2:], kwargs, block, lo, hi)
              for lo, hi in _chunks(flat_out.size, dtype.itemsize, block)]
    _POOL.run(_sum_range, chunks)


def _copy_range(outs, src, block, lo, hi) -> None:
    copyto = np.copyto
    for start in range(lo, hi, block):
        stop = min(start + block, hi)
        piece = src[start:stop]
        for o in outs:
            copyto(o[start:stop], piece, casting="unsafe")


def host_broadcast(src: np.ndarray, outs: list) -> None:
    """Copy `src` into every array of `outs` (same shape; dtypes cast as NumPy does)."""
    if (src.nbytes < BLOCKED_BYTES or not src.flags.c_contiguous or not _contiguous(outs)
            or _overlapping(outs)):
        for o in outs:
            if type(o) is _NDARRAY:
                o[...] = src  # the same unsafe cast as copyto, with less call overhead
            else:
                np.copyto(o, src, casting="unsafe")
        return
    flat_src = src.reshape(-1)
    flat = [o.reshape(-1) for o in outs]
    widest = max([src.dtype.itemsize] + [o.dtype.itemsize for o in outs])
    block = max(1, BLOCK_BYTES // widest)
    chunks = [(flat, flat_src, block, lo, hi)
              for lo, hi in _chunks(flat_src.size, src.dtype.itemsize, block)]
    _POOL.run(_copy_range, chunks)


def _tree_range(out, sources, ops, temps, acc, kwargs, widen, block, lo, hi) -> None:
    """`out[lo:hi]` = the canonical tree sum of `sources[lo:hi]` (cut on axis 0), block
    by block, by the adds of `leaf_plan`: the temporaries of one block stay in cache,
    so memory sees k reads and one write. An out of the accumulation dtype is the first
    temporary itself (it is written last, from the others). With `widen`, the float16
    leaves (flat, contiguous) of a float32 sum are widened block by block first, as
    `_term` does."""
    shape = (min(block, hi - lo),) + out.shape[1:]
    in_out = out.dtype == acc
    scratch = [np.empty(shape, acc) for _ in range(temps - in_out)]
    wide = [np.empty(shape, _F32) if widen and s.dtype == _F16 else None for s in sources]
    for start in range(lo, hi, block):
        stop = min(start + block, hi)
        dst = out[start:stop]
        slots = [t[:stop - start] for t in scratch]
        if in_out:
            slots.insert(0, dst)
        values = [s[start:stop] if w is None else _term(s[start:stop], w[:stop - start])
                  for s, w in zip(sources, wide)]
        run_adds(ops, values, slots, dst, **kwargs)


def host_tree_sum(out: np.ndarray, sources: list) -> None:
    """Write the canonical tree sum of `sources` (leaves in the order given; see
    `gpukv.canonical`) into `out`, elementwise.

    Sources of any dtype are accumulated in `accumulate_dtype(out.dtype)` (float32 for
    16-bit floats) and the result is rounded into `out` once; one source is a copy with
    a cast (a bit copy when the dtypes agree). Large C-contiguous arrays are summed in
    cache-sized blocks over the thread pool, as `host_sum` is; other layouts whole. Any
    strides work; `out` must not be one of `sources`.
    """
    if not sources:
        raise ValueError("the canonical sum of no arrays")
    if len(sources) == 1:
        host_broadcast(sources[0], [out])
        return
    acc = accumulate_dtype(out.dtype)
    ops, temps = leaf_plan(len(sources))
    kwargs = _SAME
    if out.dtype is not acc or any(s.dtype is not acc for s in sources):
        kwargs = {"dtype": acc, "casting": "unsafe"}
    contiguous = _contiguous(sources) and out.flags.c_contiguous
    # Half of host_sum's block: the live temporaries (at most log2(k), the out being the
    # first) then mostly stay in L2, and per-call overhead stays small (8 x 16 MiB float32
    # on 2 threads, alternating with host_sum: 1/2 of its block cost 4-10% over it, the
    # whole block or 1/4 of it 10-20%, 1/8 of it 50%).
    block = max(1, BLOCK_BYTES // max(out.dtype.itemsize, acc.itemsize) // 2)
    halves = sum(s.dtype == _F16 for s in sources) if acc == _F32 and contiguous else 0
    widened = None
    if halves:
        # A widened block per float16 leaf too: smaller blocks, in multiples of 4096
        # values (which of two NaNs an add returns depends on its loop's path, which
        # NumPy picks by the length: such blocks keep the NaNs of the whole-array add).
        wide_block = max(1, block // (1 + halves // 2) >> 12) << 12
        widened = _widened_chunks(out.size, out.dtype.itemsize, wide_block)
    widen = widened is not None
    if widened is not None:
        block, chunks = wide_block, widened
    elif not contiguous or out.nbytes < BLOCKED_BYTES:
        _tree_range(out[None], [s[None] for s in sources], ops, temps, acc, kwargs, False,
                    1, 0, 1)
        return
    else:
        chunks = _chunks(out.size, out.dtype.itemsize, block)
    flat_out = out.reshape(-1)
    flat = [s.reshape(-1) for s in sources]
    _POOL.run(_tree_range, [(flat_out, flat, ops, temps, acc, kwargs, widen, block, lo, hi)
                            for lo, hi in chunks])
