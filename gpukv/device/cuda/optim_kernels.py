"""Multi-tensor optimizer kernels for CuPy: one launch updates every key of a group.

A group is the keys of one push that share a home GPU and a weight dtype. The launch
gets device arrays describing them: six pointers per key (stored weight, gradient,
float32 master copy, three states), its size, its per-key scalars (lr, wd, two extras),
and a chunk table: block b updates elements [chunk_start[b], chunk_start[b] + CHUNK) of
key chunk_tensor[b]. The update rule itself is the optimizer's `cuda_body` (see
`gpukv/optim/_rules.py`), spliced into the loop below.

The code is compiled with --fmad=false: no multiply-add is fused, so every operation
rounds as the NumPy twin (`Optimizer.host_chunk`) rounds, and host and GPU agree bit for
bit on +, -, *, / and sqrt (LAMB's norms are summed in double and may differ in the last
bit of float32), except that float32 subnormals flush to zero on the GPU: CuPy compiles
every kernel with -ftz=true, so a float32 operand or result below 2**-126 in magnitude
becomes a (signed) zero there and not on the host (float64 keys are not affected).
16-bit weights are converted with PTX `cvt.rn` (float16) and round-to-nearest-even bit
arithmetic (bfloat16), as NumPy and ml_dtypes convert.

CuPy is imported only by the functions here, which `CudaDevice.optimizer_step` calls.
"""
from __future__ import annotations

import functools

import numpy as np

from .kernels import TableCache, dtype_name, upload

BLOCK = 256
CHUNK = 8192
NPTR = 6
NSCALAR = 4

_PRELUDE = r"""
typedef CT_TYPE ct;
__device__ __forceinline__ ct clipv(ct x, ct c) { return x > c ? c : (x < -c ? -c : x); }
__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short f2b(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16); }
#if WKIND == 1
typedef unsigned short wt;
#define LOAD_STORED(i) ((ct)h2f(W[i]))
#define STORE_W(i, v) do { M[i] = (v); W[i] = f2h((float)(v)); } while (0)
#define LOAD_W(i) (M[i])
#elif WKIND == 2
typedef unsigned short wt;
#define LOAD_STORED(i) ((ct)b2f(W[i]))
#define STORE_W(i, v) do { M[i] = (v); W[i] = f2b((float)(v)); } while (0)
#define LOAD_W(i) (M[i])
#else
typedef ct wt;
#define LOAD_STORED(i) (W[i])
#define STORE_W(i, v) do { W[i] = (v); } while (0)
#define LOAD_W(i) (W[i])
#endif

extern "C" __global__ void gpukv_optim_step(
        const unsigned long long* __restrict__ ptrs, const long long* __restrict__ sizes,
        const long long* __restrict__ chunk_start, const long long* __restrict__ toff,
        const int* __restrict__ chunk_tensor, const float* __restrict__ scal,
        const float* __restrict__ hp, double* __restrict__ sums, ct* __restrict__ tmp) {
    const int k = chunk_tensor[blockIdx.x];
    const long long n = sizes[k];
    const long long start = chunk_start[blockIdx.x];
    long long end = start + CHUNK_SIZE;
    if (end > n) end = n;
    const unsigned long long* P = ptrs + (long long)k * 6;
    wt* W = (wt*)P[0];
    const ct* G = (const ct*)P[1];
    ct* M = (ct*)P[2];
    ct* S0 = (ct*)P[3];
    ct* S1 = (ct*)P[4];
    ct* S2 = (ct*)P[5];
    const ct lr = (ct)scal[k * 4 + 0];
    const ct wd = (ct)scal[k * 4 + 1];
    const ct x0 = (ct)scal[k * 4 + 2];
    const ct x1 = (ct)scal[k * 4 + 3];
    const ct rescale = (ct)hp[0];
    const ct clip = (ct)hp[1];
HYPER_DECLS
    (void)G; (void)M; (void)S0; (void)S1; (void)S2; (void)x0; (void)x1; (void)lr; (void)wd;
    (void)rescale; (void)clip; (void)sums; (void)tmp; (void)toff;
#if PHASE == 0
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        ct w = LOAD_W(i);
        ct g = G[i];
BODY
        STORE_W(i, w);
    }
#elif PHASE == 1
    __shared__ double sh_w[BLOCK_SIZE];
    __shared__ double sh_d[BLOCK_SIZE];
    double acc_w = 0.0, acc_d = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        ct w = LOAD_W(i);
        ct g = G[i];
BODY
        tmp[toff[k] + i] = d;
        const double ws = (double)LOAD_STORED(i);
        acc_w += ws * ws;
        acc_d += (double)d * (double)d;
    }
    sh_w[threadIdx.x] = acc_w;
    sh_d[threadIdx.x] = acc_d;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sh_w[threadIdx.x] += sh_w[threadIdx.x + s];
            sh_d[threadIdx.x] += sh_d[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(&sums[2 * k], sh_w[0]);
        atomicAdd(&sums[2 * k + 1], sh_d[0]);
    }
#else
    float r1 = sqrtf((float)sums[2 * k]);
    const float r2 = sqrtf((float)sums[2 * k + 1]);
#if HAS_LB
    r1 = fmaxf(r1, (float)hp[5]);
#endif
#if HAS_UB
    r1 = fminf(r1, (float)hp[6]);
#endif
    const ct r = (r1 == 0.0f || r2 == 0.0f) ? (ct)1 : (ct)(r1 / r2);
    const ct lra = lr * r;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        ct w = LOAD_W(i);
        w = w - lra * tmp[toff[k] + i];
        STORE_W(i, w);
    }
#endif
}
"""


def kernel_source(optimizer, wdtype, phase: int = 0, body: str | None = None) -> str:
    """The CUDA source of `optimizer`'s step for weights of `wdtype` (phase: LAMB's 1 or 2).

    `body` replaces the rule's `cuda_body` (e.g. its `sparse_cuda_body`).
    """
    return _source(tuple(optimizer.defines().items()), tuple(optimizer.hyper_names),
                   optimizer.cuda_body if body is None else body, dtype_name(wdtype), phase)


@functools.cache
def _source(switches: tuple, hyper_names: tuple, body: str, name: str, phase: int) -> str:
    wkind = {"float16": 1, "bfloat16": 2}.get(name, 0)
    ct = "double" if name == "float64" else "float"
    defines = {"CT_TYPE": ct, "WKIND": wkind, "PHASE": phase, "CHUNK_SIZE": CHUNK,
               "BLOCK_SIZE": BLOCK, "HAS_LB": 0, "HAS_UB": 0}
    defines.update(switches)
    decls = "\n".join(f"    const ct {h} = (ct)hp[{2 + j}];"
                      for j, h in enumerate(hyper_names))
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + _PRELUDE.replace("HYPER_DECLS", decls).replace("BODY", body)


@functools.cache
def _compiled(source: str):
    from .runtime import cupy_module
    return cupy_module().RawKernel(source, "gpukv_optim_step", options=("--fmad=false",))


_STEP_TABLES = TableCache()


def _unused(cp, ct) -> tuple:
    """Stand-ins for LAMB's sums and scratch arguments, one pair per GPU and dtype (never
    read nor written outside LAMB's phases)."""
    key = (cp.cuda.runtime.getDevice(), dtype_name(ct))
    found = _UNUSED.get(key)
    if found is None:
        found = _UNUSED.setdefault(key, (cp.zeros(2, np.float64), cp.zeros(1, ct)))
    return found


_UNUSED: dict = {}


def hyper_vector(optimizer, hp: dict) -> np.ndarray:
    return np.array([hp["rescale"], hp["clip"]]
                    + [hp[h] for h in optimizer.hyper_names], np.float32)


def addresses(items) -> tuple:
    """Per item of `items` [(stored, grad, master, states, scalars)]: its NPTR addresses
    (0 for none) and its size, as plain ints (what the tables are made and found by)."""
    rows = []
    for stored, grad, master, states, _ in items:
        row = [stored.data.ptr, grad.data.ptr, 0 if master is None else master.data.ptr]
        row += [a.data.ptr for a in states]
        rows.append(tuple(row + [0] * (NPTR - len(row))) + (stored.size,))
    return tuple(rows)


def scalars_of(items) -> np.ndarray:
    """The per-key scalars (lr, wd, two extras) of `items`, float32, NSCALAR per key."""
    scal = np.zeros((len(items), NSCALAR), np.float32)
    for j, item in enumerate(items):
        scal[j, :len(item[4])] = item[4]
    return scal


def plan(items) -> tuple:
    """Host-side tables for `items` [(stored, grad, master, states, scalars)]."""
    n = len(items)
    rows = np.array(addresses(items), np.uint64).reshape(n, NPTR + 1)
    ptrs, sizes = np.ascontiguousarray(rows[:, :NPTR]), rows[:, NPTR].astype(np.int64)
    scal = scalars_of(items)
    nchunks = (sizes + CHUNK - 1) // CHUNK
    chunk_tensor = np.repeat(np.arange(n, dtype=np.int32), nchunks)
    first = np.concatenate(([0], np.cumsum(nchunks)[:-1]))
    chunk_start = (np.arange(int(nchunks.sum()), dtype=np.int64)
                   - np.repeat(first, nchunks)) * CHUNK
    toff = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    return ptrs, sizes, chunk_start, toff, chunk_tensor, scal


def step(optimizer, home, items, hp: dict, body: str | None = None) -> None:
    """Update every key of `items` on `home` (a CUDA device) with one launch (LAMB: two).

    Runs on `home`'s stream: `CudaDevice.optimizer_step` calls it with `home` activated.
    `body`: run it instead of the rule's `cuda_body` (in one phase-0 launch).
    """
    from .runtime import cupy_module
    cp = cupy_module()
    if body is not None and body == optimizer.cuda_body:
        body = None  # the rule itself (LAMB keeps its two phases)
    items = [it for it in items if it[0].size]
    if not items:
        return
    wdtype = items[0][0].dtype
    stream = cp.cuda.get_current_stream()
    # The tables of the keys' addresses and chunks stay the same step after step: they
    # are made and uploaded once (by content, per GPU and stream); the scalars go every
    # step. Each upload is asynchronous: the host never waits here for the GPU's work.
    key = (cp.cuda.runtime.getDevice(), stream.ptr, addresses(items))
    tables = _STEP_TABLES.get(key)
    if tables is None:
        ptrs, sizes, chunk_start, toff, chunk_tensor, _ = plan(items)
        tables = (upload(cp, np.concatenate([ptrs.view(np.int64).reshape(-1), sizes,
                                             chunk_start, toff]), stream),
                  upload(cp, chunk_tensor, stream), int(sizes.sum()))
        _STEP_TABLES.put(key, tables)
    ints, d_ct, total = tables
    scal = scalars_of(items)
    n, nc = len(items), len(d_ct)
    d_ptrs = ints[:NPTR * n]
    d_sizes = ints[NPTR * n:NPTR * n + n]
    d_start = ints[NPTR * n + n:NPTR * n + n + nc]
    d_toff = ints[NPTR * n + n + nc:]
    floats = upload(cp, np.concatenate([scal.reshape(-1), hyper_vector(optimizer, hp)]),
                    stream)
    d_scal, d_hp = floats[:NSCALAR * n], floats[NSCALAR * n:]
    ct = np.float64 if wdtype == np.float64 else np.float32
    grid, block = (nc,), (BLOCK,)
    if optimizer.name != "lamb" or body is not None:
        kernel = _compiled(kernel_source(optimizer, wdtype, 0, body))
        unused = _unused(cp, ct)  # the phase-0 step reads neither LAMB argument
        kernel(grid, block, (d_ptrs, d_sizes, d_start, d_toff, d_ct, d_scal, d_hp) + unused)
        return
    sums = cp.zeros(2 * n, np.float64)
    tmp = cp.empty(total, ct)
    args = (d_ptrs, d_sizes, d_start, d_toff, d_ct, d_scal, d_hp, sums, tmp)
    _compiled(kernel_source(optimizer, wdtype, 1))(grid, block, args)
    _compiled(kernel_source(optimizer, wdtype, 2))(grid, block, args)
