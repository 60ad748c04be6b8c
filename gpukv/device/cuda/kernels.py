"""The reduction kernels (CUDA); their NumPy twins are `gpukv/device/host_kernels.py`.

Every kernel here has a NumPy twin with the same contract, so the host backend runs
the same algorithm and tests compare the two. The optimizer and compression kernels
live in `optim_kernels.py` and `codec_kernels.py`. Layout of this module:

1. Infrastructure: dtype -> CUDA C type/load/store snippets, the compile cache, and
   launch helpers (pointer tables uploaded to device memory on the launching stream).
2. Reduction kernels: the fused multi-key k-way sum (`multi_sum_gpu`), which also serves
   as the multi-key copy/cast (`multi_copy_gpu`, a bit copy when the dtypes agree): one
   launch sums or copies hundreds of keys, reading their sources directly from peer
   GPUs' memory.
   The same table drives the canonical tree sum (`multi_tree_sum_gpu`), the sum in the
   order of `gpukv.canonical` whatever the number of leaves.
3. The row sum of runs of sorted row-sparse rows (`segment_sum_gpu`), in order, no atomics.

CuPy is never imported at module level, only by the GPU functions when they are
called, so `import gpukv` stays light.
"""
from __future__ import annotations

import collections
import functools
import threading

import numpy as np

from ..._dtypes import NARROW_FLOATS
from ..base import SumItem

# =============================================================== 1. infrastructure


# dtype name -> the C type its elements are stored as (16-bit floats as raw bits)
_CTYPES = {
    "float16": "unsigned short",
    "bfloat16": "unsigned short",
    "float32": "float",
    "float64": "double",
    "int8": "signed char",
    "uint8": "unsigned char",
    "int32": "int",
    "int64": "long long",
}

# Conversions of 16-bit floats without any header: PTX for fp16, bit arithmetic for
# bf16 (round to nearest even, NaN kept quiet). float64 <-> float32 in explicit PTX too:
# CuPy compiles with -ftz=true, under which a C cast is cvt.rn.ftz.f32.f64 (or
# cvt.ftz.f64.f32) and flushes float32 subnormals; PTX without .ftz keeps them, as NumPy's
# casts do. float64 -> float16 in one rounding (cvt.rn.f16.f64), as NumPy casts: through
# float32 it would round twice (1 + 2**-11 + 2**-40 would become 1.0, not 1 + 2**-10).
#: the 16-bit and float64 conversions every kernel source of gpukv starts with
CONVERSIONS = r"""
__device__ __forceinline__ float gpukv_h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short gpukv_f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float gpukv_b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short gpukv_f2b(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float gpukv_d2f(double d) {
    float f; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d)); return f;
}
__device__ __forceinline__ double gpukv_f2d(float f) {
    double d; asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f)); return d;
}
__device__ __forceinline__ unsigned short gpukv_d2h(double d) {
    unsigned short h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(d)); return h;
}
"""


@functools.cache
def dtype_name(dtype) -> str:
    """NumPy's name of `dtype` (a dtype, type or name), remembered: every launch asks
    for it, and NumPy works it out anew each time."""
    return np.dtype(dtype).name


def accumulate_name(out_dtype) -> str:
    """The dtype sums into `out_dtype` are accumulated in (float32 for 16-bit floats)."""
    name = dtype_name(out_dtype)
    return "float32" if name in NARROW_FLOATS else name


def ctype(dtype) -> str:
    """The C storage type of a supported dtype."""
    return _CTYPES[dtype_name(dtype)]


def load_expr(dtype, ptr: str, index: str, acc: str) -> str:
    """C expression reading `ptr[index]` (of `dtype`) as the accumulator C type `acc`
    (a name of `_CTYPES`' values: float64 <-> float32 go through `gpukv_d2f` /
    `gpukv_f2d`, which keep float32 subnormals under -ftz=true)."""
    name = np.dtype(dtype).name
    if name == "float16":
        return f"(({acc})gpukv_h2f({ptr}[{index}]))"
    if name == "bfloat16":
        return f"(({acc})gpukv_b2f({ptr}[{index}]))"
    if name == "float64" and acc == "float":
        return f"gpukv_d2f({ptr}[{index}])"
    if name == "float32" and acc == "double":
        return f"gpukv_f2d({ptr}[{index}])"
    return f"(({acc}){ptr}[{index}])"


def one_term_expr(t_dtype, u_dtype, ptr: str, index: str) -> str | None:
    """C expression converting one T, `ptr[index]`, straight to U's storage where going
    through the accumulator (`load_expr`, then `store_stmt`) would round twice, else None.

    Only float64 -> float16: rounded once, as NumPy casts (float64 -> bfloat16 goes
    through float32, as ml_dtypes' cast does before 0.7, which gpukv requires: 0.7
    rounds it once, and the host's casts would part from the kernels')."""
    t, u = np.dtype(t_dtype).name, np.dtype(u_dtype).name
    if (t, u) == ("float64", "float16"):
        return f"gpukv_d2h({ptr}[{index}])"
    return None


def store_stmt(dtype, ptr: str, index: str, value: str) -> str:
    """C statement writing the accumulator `value` into `ptr[index]` (of `dtype`)."""
    name = np.dtype(dtype).name
    if name == "float16":
        return f"{ptr}[{index}] = gpukv_f2h((float)({value}));"
    if name == "bfloat16":
        return f"{ptr}[{index}] = gpukv_f2b((float)({value}));"
    return f"{ptr}[{index}] = ({_CTYPES[name]})({value});"


#: NVRTC options of every kernel of this module (CuPy adds -arch and a few of its own)
COMPILE_OPTIONS = ("-std=c++14",)

_compile_lock = threading.Lock()
_compiled: dict = {}


def compiled(cupy, name: str, source: str):
    """The RawKernel `name` of `source`, built once per process (CuPy caches per device)."""
    key = (name, source)
    kernel = _compiled.get(key)
    if kernel is None:
        with _compile_lock:
            kernel = _compiled.get(key)
            if kernel is None:
                kernel = cupy.RawKernel(source, name, options=COMPILE_OPTIONS)
                _compiled[key] = kernel
    return kernel


class _PinnedTables:
    """A small pool of page-locked host buffers the pointer tables are uploaded from.

    A copy from pageable memory may make the host wait for the copy (the driver stages
    it); from pinned memory it is truly asynchronous, so the buffer must stay untouched
    until the copy has run: each buffer handed out comes back with the event recorded
    after its copy, and is given out again only once that event has completed. At most
    `keep` idle buffers are kept; a busy one is never dropped.
    """

    MIN_WORDS = 512  # int64 words of the smallest buffer (4 KiB)

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.lock = threading.Lock()
        self.idle: list = []  # buffers free to reuse
        self.busy: list = []  # (event, buffer): in use by a copy until event is done

    def take(self, cupy, words: int) -> np.ndarray:
        """A pinned int64 buffer of at least `words` elements, not in use by any copy."""
        with self.lock:
            still = []
            for event, buf in self.busy:
                if event.done:
                    self.idle.append(buf)
                else:
                    still.append((event, buf))
            self.busy = still
            self.idle.sort(key=lambda b: b.size)
            del self.idle[:max(0, len(self.idle) - self.keep)]  # drop the smallest
            for i, buf in enumerate(self.idle):  # the smallest that fits
                if buf.size >= words:
                    del self.idle[i]
                    return buf
        size = max(self.MIN_WORDS, 1 << (max(1, words) - 1).bit_length())
        mem = cupy.cuda.alloc_pinned_memory(size * 8)
        return np.ndarray((size,), np.int64, buffer=mem)

    def give(self, buf: np.ndarray, event) -> None:
        """Return `buf`, in use until `event` has completed."""
        with self.lock:
            self.busy.append((event, buf))


_TABLES = _PinnedTables()


def upload_table(cupy, table: np.ndarray, stream):
    """`table` (int64) as a device array, copied on `stream` (see `upload`)."""
    return upload(cupy, np.ascontiguousarray(table, dtype=np.int64), stream)


def upload(cupy, table: np.ndarray, stream):
    """Host array `table` as a device array of its dtype, copied on `stream` (the
    launching stream).

    The copy is asynchronous, from a pinned staging buffer that is reused only after an
    event recorded behind the copy has completed, so a launch never waits for the host
    nor the host for it (a copy from pageable memory would first wait for the stream's
    work). Must run with the stream's GPU current. The device array comes from CuPy's
    pool while `stream` is current, so when it is freed the pool hands it out again only
    to later work on the same stream.
    """
    table = np.ascontiguousarray(table)
    with stream:
        dev = cupy.empty(table.shape, table.dtype)
    if table.size:
        words = -(-table.nbytes // 8)
        host = _TABLES.take(cupy, words)
        host.view(np.uint8)[:table.nbytes] = table.reshape(-1).view(np.uint8)
        dev.data.copy_from_host_async(host.ctypes.data, table.nbytes, stream)
        from .runtime import ordering_event
        _TABLES.give(host, ordering_event(stream))
    return dev


# =================================================== 2. reduction: fused multi-key sum

THREADS = 256          # threads per block
PER_THREAD = 4         # elements per thread before a key is given another block
MAX_BLOCKS = 16384     # blocks per key; larger keys loop (grid-stride within the key)
META = 6               # int64 words per key: out, n, a_offset, n_a, b_offset, n_b
#: terms a thread loads all at once, for two elements, before adding them: loads waited
#: for one by one left an H200 at 0.65 (2 terms of 256 MiB) to 0.75 (8) of the copy's
#: speed, the canonical tree at 0.25; loaded so, 2 to 4 terms or leaves ran at 0.98 to
#: 1.01 of it
PREFETCH = 8

# The sum kernels' loop: each thread takes two elements a stride apart (i0 and i1; `two`:
# whether i1 is in the key), so that twice the loads are in flight.
_TWO_AT_A_TIME = """\
    const long long first = (b - starts[lo]) * (long long)blockDim.x + threadIdx.x;
    for (long long i0 = first; i0 < n; i0 += 2 * stride) {
        const long long i1 = i0 + stride;
        const bool two = i1 < n;"""


def plan_blocks(sizes, threads: int = THREADS, per_thread: int = PER_THREAD,
                max_blocks: int = MAX_BLOCKS) -> np.ndarray:
    """Block start of every key (length len(sizes)+1): key k owns blocks [s[k], s[k+1])."""
    per_block = threads * per_thread
    counts = [min(max_blocks, -(-int(n) // per_block)) for n in sizes]
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def build_table(outs, sizes, a_lists, b_lists, **plan) -> tuple[np.ndarray, int]:
    """The int64 table the sum kernel reads, and the number of blocks to launch.

    `outs`, `a_lists`, `b_lists` hold addresses (ints). Layout:
    [block starts (nkeys+1)] [nkeys x META] [addresses of every a and b list].
    """
    nkeys = len(sizes)
    starts = plan_blocks(sizes, **plan)
    meta = np.zeros((nkeys, META), dtype=np.int64)
    pointers: list = []
    for k in range(nkeys):
        a, b = a_lists[k], b_lists[k]
        if sizes[k] and not (a or b):  # the kernel starts from a term
            raise ValueError(f"key {k} of the sum table has no term")
        meta[k] = (outs[k], sizes[k], len(pointers), len(a), len(pointers) + len(a), len(b))
        pointers.extend(a)
        pointers.extend(b)
    table = np.concatenate([starts, meta.reshape(-1), np.asarray(pointers, dtype=np.int64)])
    return table, int(starts[-1])


# The start of the table kernels: the key this block works on, its out, length and `a`
# terms (see `build_table`).
_TABLE_KEY = f"""    const long long* starts = table;
    const long long* meta = table + nkeys + 1;
    const long long* ptrs = meta + {META} * (long long)nkeys;
    const long long b = blockIdx.x;
    int lo = 0, hi = nkeys - 1;
    while (lo < hi) {{  /* the last key whose first block is <= b */
        const int mid = (lo + hi + 1) >> 1;
        if (starts[mid] <= b) lo = mid; else hi = mid - 1;
    }}
    const long long* m = meta + {META} * (long long)lo;
    U* out = (U*)m[0];
    const long long n = m[1];
    const T* const* a = (const T* const*)(ptrs + m[2]);
    const int na = (int)m[3];
"""


def sum_source(t_dtype, u_dtype) -> tuple[str, str]:
    """(kernel name, CUDA source) of the multi-key sum reading T and U, writing U.

    The sum starts from its first term, never from zero: a sum of one term is then a copy
    (with a cast when T is not U) that keeps -0.0, and when T is U the kernel copies the
    raw bits, so no arithmetic can flush a subnormal or change a NaN payload. A cast
    rounds once, as NumPy's does: a float64 term into a float16 out is converted straight
    (`one_term_expr`), and float64 <-> float32 conversions keep float32 subnormals
    (`load_expr`); sums of more terms add in the accumulator (compiler-made float32 adds,
    which -ftz=true flushes).
    """
    return _sum_source(dtype_name(t_dtype), dtype_name(u_dtype))


@functools.cache
def _sum_source(t: str, u: str) -> tuple[str, str]:
    acc = _CTYPES[accumulate_name(u)]
    name = f"gpukv_multi_sum_{t}_{u}"
    one_term = ""
    if t == u:
        one_term = """
        if (na + nb == 1) {  /* one term of the out's own dtype: a bit copy */
            const U* src = na ? (const U*)a[0] : bb[0];
            const U x0 = src[i0];
            const U x1 = two ? src[i1] : x0;
            out[i0] = x0;
            if (two) out[i1] = x1;
            continue;
        }"""
    elif one_term_expr(t, u, "a[0]", "i") is not None:
        first, second = (one_term_expr(t, u, "a[0]", i) for i in ("i0", "i1"))
        one_term = f"""
        if (na + nb == 1) {{  /* one term: converted in one rounding, as NumPy casts */
            const U x0 = na ? {first} : bb[0][i0];
            const U x1 = two ? (na ? {second} : bb[0][i1]) : x0;
            out[i0] = x0;
            if (two) out[i1] = x1;
            continue;
        }}"""
    source = CONVERSIONS + f"""
typedef {_CTYPES[t]} T;
typedef {_CTYPES[u]} U;
typedef {acc} A;
extern "C" __global__ void {name}(const long long* __restrict__ table, const int nkeys) {{
{_TABLE_KEY}    const U* const* bb = (const U* const*)(ptrs + m[4]);
    const int nb = (int)m[5];
    const long long stride = (starts[lo + 1] - starts[lo]) * (long long)blockDim.x;
{_TWO_AT_A_TIME}{one_term}
        if (nb == 0 && na >= 1 && na <= {PREFETCH}) {{  /* every load first, then the adds */
{_load_all(t, acc)}
            A s0 = v[0][0], s1 = v[0][1];
#pragma unroll
            for (int j = 1; j < {PREFETCH}; ++j) if (j < na) {{ s0 += v[j][0]; s1 += v[j][1]; }}
            {store_stmt(u, "out", "i0", "s0")}
            if (two) {store_stmt(u, "out", "i1", "s1")}
            continue;
        }}
        for (int e = 0; e < 2; ++e) {{  /* more terms, or terms of U: one at a time */
            const long long i = e ? i1 : i0;
            if (i >= n) break;
            A s = na ? {load_expr(t, "a[0]", "i", acc)} : {load_expr(u, "bb[0]", "i", acc)};
            for (int j = 1; j < na; ++j) s += {load_expr(t, "a[j]", "i", acc)};
            for (int j = na ? 0 : 1; j < nb; ++j) s += {load_expr(u, "bb[j]", "i", acc)};
            {store_stmt(u, "out", "i", "s")}
        }}
    }}
}}
"""
    return name, source


def _load_all(t: str, acc: str) -> str:
    """The sum kernels' loads of the first PREFETCH `a` terms at elements i0 and i1 into
    v[j][0] and v[j][1] (0 for an i1 past the key), all issued before any add."""
    return f"""            A v[{PREFETCH}][2];
#pragma unroll
            for (int j = 0; j < {PREFETCH}; ++j) {{
                if (j < na) {{
                    v[j][0] = {load_expr(t, "a[j]", "i0", acc)};
                    v[j][1] = two ? {load_expr(t, "a[j]", "i1", acc)} : (A)0;
                }}
            }}"""


def _launch_order(items) -> list:
    """[((T, U), [items])] in launch order: one launch per (T, U) pair and wave, waves in
    order. The k-th item writing an out is in wave k: a key whose terms have several
    dtypes becomes several items, each adding into the out the one before wrote, so it
    must not run before (or in the same launch as) that one."""
    seen: dict = {}
    waves: dict = {}
    for item in items:
        if item.out.size == 0:
            continue
        ptr = item.out.data.ptr
        wave = seen.get(ptr, 0)
        seen[ptr] = wave + 1
        t = item.a[0].dtype if item.a else item.out.dtype
        waves.setdefault((wave, dtype_name(t), dtype_name(item.out.dtype)), []).append(item)
    return [((t, u), group) for (_, t, u), group in sorted(
        waves.items(), key=lambda kv: kv[0][0])]


def multi_sum_gpu(items, stream) -> None:
    """Launch the fused sum for every item, one kernel per (T, U) pair and wave, on
    `stream`.

    Must run with the launching GPU current; sources may live on any GPU the launching
    one has peer access to (the kernel reads them directly), or on the same GPU.
    """
    import cupy

    for (t, u), group in _launch_order(items):
        outs = tuple((it.out.data.ptr, it.out.size) for it in group)
        # Terms of U, where T is U, join the T terms after them (the same adds in the same
        # order), so that the kernel's fast path, for T terms alone, takes them too.
        same = t == u
        a_lists = tuple(tuple(x.data.ptr for x in (tuple(it.a) + tuple(it.b) if same else it.a))
                        for it in group)
        b_lists = tuple(() if same else tuple(x.data.ptr for x in it.b) for it in group)
        _launch_table(cupy, stream, sum_source(t, u), outs, a_lists, b_lists)


def _launch_table(cupy, stream, kernel_source: tuple, outs, a_lists, b_lists) -> None:
    """Launch the table kernel (name, source) on `stream` for `outs` [(address, size)]
    and their terms' addresses, with the table of those (see `build_table`) uploaded
    once and then found in `_SUM_TABLES`."""
    key = (cupy.cuda.runtime.getDevice(), stream.ptr, outs, a_lists, b_lists)
    found = _SUM_TABLES.get(key)
    if found is None:
        table, blocks = build_table([o[0] for o in outs], [o[1] for o in outs],
                                    a_lists, b_lists)
        found = (upload_table(cupy, table, stream), blocks)
        _SUM_TABLES.put(key, found)
    dev_table, blocks = found
    kernel = compiled(cupy, *kernel_source)
    with stream:
        kernel((blocks,), (THREADS,), (dev_table, np.int32(len(outs))))


class TableCache:
    """Uploaded kernel tables of the latest launches, by what they hold: a training loop
    pushes the same arrays step after step, and a table made once is only read. Keyed by
    GPU and stream too, so a table is read only on the stream that uploaded it (after its
    copy). Addresses freed and handed out again hold the same table: a table names
    addresses, not arrays."""

    def __init__(self, keep: int = 256):
        self.keep = keep
        self.lock = threading.Lock()
        self.tables: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        with self.lock:
            found = self.tables.get(key)
            if found is not None:
                self.tables.move_to_end(key)
            return found

    def put(self, key, value) -> None:
        with self.lock:
            self.tables[key] = value
            while len(self.tables) > self.keep:
                self.tables.popitem(last=False)


_SUM_TABLES = TableCache()


#: levels of the tree kernel's partial sums: it takes up to 2**TREE_LEVELS - 1 leaves
TREE_LEVELS = 16

# float32 addition that keeps subnormals: CuPy compiles every kernel with -ftz=true, which
# flushes them in compiler-made arithmetic but not in explicit PTX, so the canonical sum
# gives the host's (NumPy's) bits for every input.
_TREE_ADD = r"""
__device__ __forceinline__ float gpukv_tree_add(float a, float b) {
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ double gpukv_tree_add(double a, double b) { return a + b; }
__device__ __forceinline__ long long gpukv_tree_add(long long a, long long b) {
    return a + b;
}
__device__ __forceinline__ int gpukv_tree_add(int a, int b) { return a + b; }
__device__ __forceinline__ signed char gpukv_tree_add(signed char a, signed char b) {
    return (signed char)(a + b);
}
__device__ __forceinline__ unsigned char gpukv_tree_add(unsigned char a, unsigned char b) {
    return (unsigned char)(a + b);
}
"""


def tree_sum_source(t_dtype, u_dtype) -> tuple[str, str]:
    """(kernel name, CUDA source) of the multi-key canonical tree sum reading T, writing U.

    The table of `sum_source` with only `a` lists: per element, the leaves a[0..na) are
    summed in the tree of `gpukv.canonical` by a binary counter: level L holds the sum
    of the last complete block of 2**L leaves (while bit L of the count is set); leaf j
    is merged with the levels below the lowest zero bit of j, and the levels left are
    added from the lowest up at the end. Up to PREFETCH leaves, that tree is written out
    as one expression per count (`tree_expression`) over leaves loaded all at once; past
    it, the loops over levels are unrolled, so the partial sums stay in registers. Sums
    are in the accumulation type of U (float32 adds keep subnormals, as NumPy's do, and
    so do float64 leaves read as float32) and rounded into the out once; one leaf of the
    out's own dtype is a bit copy, and one float64 leaf into a float16 out is rounded
    once, as NumPy casts it.
    """
    return _tree_sum_source(dtype_name(t_dtype), dtype_name(u_dtype))


@functools.cache
def _tree_sum_source(t: str, u: str) -> tuple[str, str]:
    acc = _CTYPES[accumulate_name(u)]
    name = f"gpukv_tree_sum_{t}_{u}"
    one_term = ""
    if t == u:
        one_term = """
        if (na == 1) {  /* one leaf of the out's own dtype: a bit copy */
            const U x0 = (U)a[0][i0];
            const U x1 = two ? (U)a[0][i1] : x0;
            out[i0] = x0;
            if (two) out[i1] = x1;
            continue;
        }"""
    elif one_term_expr(t, u, "a[0]", "i") is not None:
        first, second = (one_term_expr(t, u, "a[0]", i) for i in ("i0", "i1"))
        one_term = f"""
        if (na == 1) {{  /* one leaf: converted in one rounding, as NumPy casts */
            const U x0 = {first};
            const U x1 = two ? {second} : x0;
            out[i0] = x0;
            if (two) out[i1] = x1;
            continue;
        }}"""
    cases = "".join(
        f"""
                case {na}: s0 = {tree_expression(na, lambda j: f"v[{j}][0]")};
                        s1 = {tree_expression(na, lambda j: f"v[{j}][1]")}; break;"""
        for na in range(2, PREFETCH + 1))
    source = CONVERSIONS + _TREE_ADD + f"""
typedef {_CTYPES[t]} T;
typedef {_CTYPES[u]} U;
typedef {acc} A;
extern "C" __global__ void {name}(const long long* __restrict__ table, const int nkeys) {{
{_TABLE_KEY}    const long long stride = (starts[lo + 1] - starts[lo]) * (long long)blockDim.x;
{_TWO_AT_A_TIME}{one_term}
        if (na <= {PREFETCH}) {{  /* every leaf loaded first, then the tree written out */
{_load_all(t, acc)}
            A s0 = v[0][0], s1 = v[0][1];
            switch (na) {{{cases}
                default: break;  /* one leaf: itself */
            }}
            {store_stmt(u, "out", "i0", "s0")}
            if (two) {store_stmt(u, "out", "i1", "s1")}
            continue;
        }}
        for (int e = 0; e < 2; ++e) {{  /* more leaves: a binary counter, leaf by leaf */
            const long long i = e ? i1 : i0;
            if (i >= n) break;
            A level[{TREE_LEVELS}];
            for (int j = 0; j < na; ++j) {{
                A v = {load_expr(t, "a[j]", "i", acc)};
                bool carry = true;  /* merging: bits 0 .. L-1 of j + 1 are zeros */
#pragma unroll
                for (int L = 0; L < {TREE_LEVELS}; ++L) {{
                    if (carry) {{
                        if (((j + 1) >> L) & 1) {{ level[L] = v; carry = false; }}
                        else v = gpukv_tree_add(level[L], v);
                    }}
                }}
            }}
            A s = (A)0;
            bool have = false;
#pragma unroll
            for (int L = 0; L < {TREE_LEVELS}; ++L) {{
                if ((na >> L) & 1) {{
                    s = have ? gpukv_tree_add(level[L], s) : level[L];
                    have = true;
                }}
            }}
            {store_stmt(u, "out", "i", "s")}
        }}
    }}
}}
"""
    return name, source


def tree_expression(leaves: int, leaf) -> str:
    """The C expression of the canonical tree over `leaves` leaves (`leaf(j)`: the j-th),
    written out as the kernel's binary counter merges them: leaf j joins the levels
    below the lowest zero bit of j + 1, and the levels left are added from the lowest."""
    level: dict = {}
    for j in range(leaves):
        x, L = leaf(j), 0
        while not ((j + 1) >> L) & 1:
            x = f"gpukv_tree_add({level[L]}, {x})"
            L += 1
        level[L] = x
    total = None
    for L in range(leaves.bit_length()):
        if (leaves >> L) & 1:
            total = level[L] if total is None else f"gpukv_tree_add({level[L]}, {total})"
    assert total is not None
    return total


def multi_tree_sum_gpu(items, stream) -> None:
    """Launch the canonical tree sum for every (out, leaves) of `items` (1-D contiguous
    CuPy arrays; the leaves of one item of one dtype, readable by the launching GPU),
    one kernel per (leaf dtype, out dtype) pair, on `stream`, the launching GPU current."""
    import cupy

    groups: dict = {}
    for out, leaves in items:
        if len(leaves) >= 1 << TREE_LEVELS:
            raise ValueError(f"the tree kernel sums at most {(1 << TREE_LEVELS) - 1} "
                             f"arrays, got {len(leaves)}")
        if out.size:
            groups.setdefault((dtype_name(leaves[0].dtype), dtype_name(out.dtype)),
                              []).append((out, leaves))
    for (t, u), group in groups.items():
        outs = tuple((out.data.ptr, out.size) for out, _ in group)
        a_lists = tuple(tuple(x.data.ptr for x in leaves) for _, leaves in group)
        _launch_table(cupy, stream, tree_sum_source(t, u), outs, a_lists,
                      tuple(() for _ in group))


# ============================================ 3. row sums of sorted row-sparse values

SEGMENT_THREADS = 256


def segment_sum_source(t_dtype) -> tuple[str, str]:
    """(kernel name, CUDA source) of the row sum of runs of rows: out[s, c] is the sum of
    data[r, c] over the rows r of run s, added one row after the other from the first
    (deterministic, no atomics), in the accumulation dtype of T (float32 for 16-bit
    floats), which is also the out's dtype. A grid-stride loop over (run, column)."""
    t = np.dtype(t_dtype).name
    a = accumulate_name(t)
    name = f"gpukv_segment_sum_{t}"
    source = CONVERSIONS + f"""
typedef {_CTYPES[t]} T;
typedef {_CTYPES[a]} A;
extern "C" __global__ void {name}(const T* __restrict__ data,
                                   const long long* __restrict__ starts,
                                   A* __restrict__ out, const long long runs,
                                   const long long width) {{
    const long long n = runs * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {{
        const long long run = i / width, c = i - run * width;
        const long long end = starts[run + 1];
        long long r = starts[run];
        A s = {load_expr(t, "data", "r * width + c", _CTYPES[a])};
        for (++r; r < end; ++r) s += {load_expr(t, "data", "r * width + c", _CTYPES[a])};
        out[i] = s;
    }}
}}
"""
    return name, source


#: dtypes the run sum has no kernel for, summed in a wider integer type; the result
#: wraps back on the cast as a sum in the narrow type would (bool: any row set)
_SEGMENT_WIDER = {"int16": "int32", "uint16": "int32", "uint32": "int64",
                  "uint64": "int64", "bool": "int64"}


def segment_sum_gpu(data, bounds):
    """Rows of `data` (CuPy, rows first, on the current GPU) summed per run: run s is rows
    [bounds[s], bounds[s+1]) (`bounds`: int64, runs + 1 entries). Returns the sums in the
    accumulation dtype of data's dtype, in one launch on the current stream."""
    import cupy
    acc = np.dtype(accumulate_name(data.dtype))
    wider = _SEGMENT_WIDER.get(data.dtype.name)
    if wider is not None:
        return segment_sum_gpu(data.astype(wider), bounds).astype(acc)
    data = cupy.ascontiguousarray(data)
    runs = bounds.size - 1
    width = data.size // data.shape[0] if data.shape[0] else 0
    out = cupy.empty((runs,) + data.shape[1:], acc)
    if out.size == 0:
        return out
    name, source = segment_sum_source(data.dtype)
    blocks = min(MAX_BLOCKS, -(-out.size // SEGMENT_THREADS))
    compiled(cupy, name, source)((blocks,), (SEGMENT_THREADS,),
                                 (data, bounds, out, np.int64(runs), np.int64(width)))
    return out


def multi_copy_gpu(pairs, stream) -> None:
    """Copy (with a cast) every (dst, src) pair of 1-D contiguous CuPy arrays in one
    launch on `stream` (a bit copy when the dtypes agree); the launching GPU current."""
    multi_sum_gpu([SumItem(dst, (src,), ()) for dst, src in pairs], stream)
