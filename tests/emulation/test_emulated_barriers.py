"""__syncthreads() on the CPU emulation: threads of a block really wait for each other, and
a barrier that not every thread reaches (or reaches at another call site) fails the launch."""
from __future__ import annotations

import numpy as np
import pytest

from .support import device, kernels

_REDUCE = r"""
extern "C" __global__ void block_sums(const double* in, double* out, long long n) {
    __shared__ double part[1024];
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    part[threadIdx.x] = i < n ? in[i] : 0.0;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}
"""


@pytest.fixture(scope="module")
def block_sums():
    return kernels.RawKernel(_REDUCE, "block_sums")


@pytest.mark.parametrize("threads", [2, 64, 256, 1024])
def test_a_shared_memory_tree_reduction_sums_each_block(block_sums, threads):
    """Every step of the tree reads what other threads wrote before the barrier."""
    n, blocks = 3 * threads - 5, 3
    values = np.random.default_rng(threads).integers(-1000, 1000, n).astype(np.float64)
    out = device(np.zeros(blocks))
    block_sums((blocks,), (threads,), (device(values), out, n))
    padded = np.concatenate([values, np.zeros(blocks * threads - n)])
    np.testing.assert_array_equal(out.host, padded.reshape(blocks, threads).sum(axis=1))


_COUNT = r"""
extern "C" __global__ void votes(const int* flags, int* out) {
    const int t = threadIdx.x + blockDim.x * threadIdx.y;
    const int n = __syncthreads_count(flags[t]);
    const int all = __syncthreads_and(flags[t]);
    const int any = __syncthreads_or(flags[t]);
    out[3 * t] = n; out[3 * t + 1] = all; out[3 * t + 2] = any;
}
"""


@pytest.mark.parametrize("flags", [[0] * 12, [1] * 12, [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1]])
def test_barrier_votes_count_over_a_two_dimensional_block(flags):
    """__syncthreads_count/_and/_or give every thread the vote of the whole block."""
    out = device(np.full(36, -1, np.int32))
    kernels.RawKernel(_COUNT, "votes")((1,), (4, 3), (device(flags, np.int32), out))
    got = out.host.reshape(12, 3)
    assert (got[:, 0] == sum(flags)).all()
    assert (got[:, 1] == int(all(flags))).all()
    assert (got[:, 2] == int(any(flags))).all()


_WARP_SUMS = r"""
extern "C" __global__ void warp_sums(const float* in, float* out) {
    __shared__ float part[256];
    const int lane = threadIdx.x & 31, first = threadIdx.x - lane;
    part[threadIdx.x] = in[threadIdx.x];
    __syncwarp();
    for (int h = 16; h > 0; h >>= 1) {
        if (lane < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncwarp();
    }
    out[threadIdx.x] = part[first];
}
"""


def test_syncwarp_orders_a_warps_shared_memory():
    """After __syncwarp() a lane reads what the other lanes of its warp wrote before it:
    a tree over each warp of 256 threads gives every lane its warp's sum."""
    values = np.arange(256, dtype=np.float32)
    out = device(np.zeros(256, np.float32))
    kernels.RawKernel(_WARP_SUMS, "warp_sums")((1,), (256,), (device(values), out))
    np.testing.assert_array_equal(out.host, np.repeat(values.reshape(8, 32).sum(axis=1), 32))


_DIVERGENT = r"""
extern "C" __global__ void divergent(float* out) {
    if (threadIdx.x < 128) {
        out[threadIdx.x] = 1.0f;
        __syncthreads();
    }
}
"""

_TWO_SITES = r"""
extern "C" __global__ void two_sites(float* out) {
    if (threadIdx.x < 32) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}
"""


def _floats(n: int):
    return device(np.zeros(n, np.float32))


def _line_of(source: str, text: str, nth: int = 1) -> int:
    lines = [i + 1 for i, line in enumerate(source.splitlines()) if text in line]
    return lines[nth - 1]


def test_a_barrier_in_a_divergent_branch_fails_naming_both_sides():
    """Threads 0-127 wait at a barrier that threads 128-255 never reach: BarrierError with
    the kernel, the block, both groups of threads and the barrier's line."""
    with pytest.raises(kernels.BarrierError) as info:
        kernels.RawKernel(_DIVERGENT, "divergent")((2,), (256,), (_floats(256),))
    message = str(info.value)
    line = _line_of(_DIVERGENT, "__syncthreads")
    assert "kernel divergent, block (0, 0, 0)" in message
    assert f"threads 0-127 wait at the one on line {line}" in message
    assert "threads 128-255 have returned" in message
    assert info.value.kernel == "divergent"


def test_threads_at_different_barriers_fail_naming_both_lines():
    """Two call sites are two barriers: threads split between them fail the launch."""
    with pytest.raises(kernels.BarrierError) as info:
        kernels.RawKernel(_TWO_SITES, "two_sites")((1,), (64,), (_floats(64),))
    first = _line_of(_TWO_SITES, "__syncthreads", 1)
    second = _line_of(_TWO_SITES, "__syncthreads", 2)
    assert f"threads 0-31 wait at the one on line {first}" in str(info.value)
    assert f"threads 32-63 wait at the one on line {second}" in str(info.value)


def test_launches_after_a_barrier_failure_run_normally(block_sums):
    """A failed launch leaves no fiber behind: the next synchronising kernel is right."""
    with pytest.raises(kernels.BarrierError):
        kernels.RawKernel(_DIVERGENT, "divergent")((1,), (256,), (_floats(256),))
    out = device(np.zeros(2))
    block_sums((2,), (128,), (device(np.ones(256)), out, 256))
    assert out.host.tolist() == [128.0, 128.0]


def test_a_single_thread_block_passes_its_barriers():
    """With one thread per block a barrier holds nobody up, wherever it is."""
    out = device(np.zeros(4, np.float32))
    kernels.RawKernel(_DIVERGENT, "divergent")((4,), (1,), (out,))
    assert out.host.tolist() == [1.0, 0.0, 0.0, 0.0]


_MAYBE_SYNCED = """
extern "C" __global__ void maybe(int* x) {
#if SYNC
    __syncthreads();
#endif
    x[threadIdx.x] = 1;
}
"""


@pytest.mark.parametrize("sync", [0, 1])
def test_threads_run_as_fibers_only_when_the_compiled_code_synchronises(sync):
    """A __syncthreads() the preprocessor removes leaves plain calls (the cheap way);
    one that stays makes the block's threads fibers."""
    kernel = kernels.RawKernel(_MAYBE_SYNCED, "maybe", options=(f"-DSYNC={sync}",))
    out = device(np.zeros(64, np.int32))
    kernel((1,), (64,), (out,))
    assert (out.host == 1).all()
    assert kernel.kernel.fibers == bool(sync)
