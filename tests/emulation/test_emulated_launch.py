"""Launching kernels on the CPU emulation: results, argument passing and checks, launch
configuration limits, and launches from several threads."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gpukv.device.cuda import kernels as _kernels
from gpukv.device.host_kernels import multi_sum_host

from ..bfloat16 import BF16, needs_bfloat16
from .support import device, kernels


def _random(rng, dtype, n):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-50 if dtype.kind == "i" else 0, 50, n).astype(dtype)
    return (rng.standard_normal(n) * 3).astype(dtype)


def _sum_kernel(t, u):
    name, source = _kernels.sum_source(t, u)
    return kernels.RawKernel(source, name, options=_kernels.COMPILE_OPTIONS)


@pytest.mark.parametrize("t, u", [
    (np.float32, np.float32), (np.float16, np.float16),
    pytest.param(BF16, BF16, id="bfloat16-bfloat16", marks=needs_bfloat16),
    (np.float16, np.float32), (np.float32, np.float16),
    pytest.param(BF16, np.float32, id="bfloat16-float32", marks=needs_bfloat16),
    pytest.param(np.float32, BF16, id="float32-bfloat16", marks=needs_bfloat16),
    (np.float64, np.float64), (np.int32, np.int32), (np.int8, np.int64),
    (np.uint8, np.float16)],
    ids=lambda d: np.dtype(d).name)
def test_sum_kernel_matches_its_numpy_twin_bit_for_bit(t, u):
    """gpukv's fused multi-key sum, run through the emulation, gives multi_sum_host's bytes
    for every key, with keys that loop over the grid and outputs summed into in place."""
    rng = np.random.default_rng(7)
    sizes = [1, 1000, 5000, 3, 2048]
    outs = [device(_random(rng, u, n)) for n in sizes]
    terms = [[device(_random(rng, t, n)) for _ in range(k % 3 + 1)]
             for k, n in enumerate(sizes)]
    expected = [o.host.copy() for o in outs]
    multi_sum_host([_kernels.SumItem(e, tuple(x.host for x in a), (e,))
                    for e, a in zip(expected, terms)])
    table, blocks = _kernels.build_table(
        [o.data.ptr for o in outs], sizes,
        [[x.data.ptr for x in a] for a in terms], [[o.data.ptr] for o in outs],
        max_blocks=2)
    _sum_kernel(t, u)((blocks,), (_kernels.THREADS,), (device(table), np.int32(len(sizes))))
    for k, (got, want) in enumerate(zip(outs, expected)):
        assert got.host.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), f"key {k}"


_ARGS_SOURCE = r"""
extern "C" __global__ void take_values(long long a, double b, float c, unsigned char d,
                                       short e, int f, const float* none, double* out) {
    out[0] = (double)a; out[1] = b; out[2] = (double)c; out[3] = (double)d;
    out[4] = (double)e; out[5] = (double)f; out[6] = none == nullptr ? 1.0 : 0.0;
}
"""


@pytest.fixture(scope="module")
def take_values():
    return kernels.RawKernel(_ARGS_SOURCE, "take_values")


def test_arguments_arrive_as_cupy_passes_them(take_values):
    """Python int as int64, float as float64, NumPy scalars as their type, None as null."""
    out = device(np.zeros(7))
    take_values((1,), (1,), (-(2 ** 40), 2.5, np.float32(1.25), np.uint8(200), np.int16(-7),
                             np.int32(123456), None, out))
    assert out.host.tolist() == [-(2 ** 40), 2.5, 1.25, 200, -7, 123456, 1.0]


_GOOD = (1, 2.5, np.float32(1), np.uint8(1), np.int16(1), np.int32(1), None)


@pytest.mark.parametrize("index, value, words", [
    (5, 3, "Python int"),                 # int64 for an int
    (2, np.float64(1.0), "float64"),      # float64 for a float
    (1, np.float32(1.0), "float32"),      # float32 for a double
    (0, 2.0, "Python float"),             # a float for a long long
    (2, np.int32(1), "int32"),            # an int for a float
    (6, np.int64(0), "int64"),            # a scalar for a pointer
    (0, "array", "DeviceArray"),          # an array for a scalar
])
def test_an_argument_of_the_wrong_type_is_a_type_error(take_values, index, value, words):
    """Each argument must have its parameter's size and kind, as a GPU would otherwise
    read it wrong; the error names the kernel, the parameter and what was given."""
    args = list(_GOOD) + [device(np.zeros(7))]
    args[index] = device(np.zeros(1)) if value == "array" else value
    with pytest.raises(TypeError, match=f"take_values.*argument {index}.*{words}") as info:
        take_values((1,), (1,), tuple(args))
    assert f"parameter {index}" in str(info.value)


def test_a_python_bool_is_passed_as_int64_as_cupy_does():
    """CuPy tests for int before bool, so True reaches a `long long` as 1 and cannot be
    given for a one-byte `bool` parameter."""
    out = device(np.zeros(7))
    take_values = kernels.RawKernel(_ARGS_SOURCE, "take_values")
    take_values((1,), (1,), (True,) + _GOOD[1:] + (out,))
    assert out.host[0] == 1.0
    flag = kernels.RawKernel(
        'extern "C" __global__ void flag(bool on, int* out) { out[0] = on ? 7 : 3; }', "flag")
    got = device(np.zeros(1, np.int32))
    flag((1,), (1,), (np.bool_(True), got))
    assert got.host[0] == 7
    with pytest.raises(TypeError, match="argument 0 is a Python int"):
        flag((1,), (1,), (True, got))


@pytest.mark.parametrize("args, match", [
    (_GOOD, "takes 8 argument"),
    (_GOOD + (None, None), "takes 8 argument"),
    (_GOOD + (np.zeros(7),), "Unsupported type <class 'numpy.ndarray'>"),
    (_GOOD + ([0.0] * 7,), "Unsupported type <class 'list'>"),
    pytest.param(_GOOD[:-1] + (None if BF16 is None else np.float32(1).astype(BF16), None),
                 "Unsupported type", marks=needs_bfloat16),
])
def test_wrong_argument_lists_are_type_errors(take_values, args, match):
    """A wrong count, or an object CuPy cannot pass (a host array, a list), is refused."""
    with pytest.raises(TypeError, match=match):
        take_values((1,), (1,), args)


def test_only_registered_array_types_pass_as_device_pointers(take_values):
    """An object with `.data.ptr` whose class was not registered is refused like any
    unknown object: only the emulation's own arrays are device memory."""
    class Lookalike:
        def __init__(self, ptr):
            self.data = type("Memory", (), {"ptr": ptr})()

    out = device(np.zeros(7))
    with pytest.raises(TypeError, match="Unsupported type .*Lookalike"):
        take_values((1,), (1,), _GOOD + (Lookalike(out.data.ptr),))
    kernels.register_array_type(Lookalike)
    take_values((1,), (1,), _GOOD + (Lookalike(out.data.ptr),))
    assert out.host[0] == 1.0


def test_setting_a_describer_returns_the_one_it_replaces():
    """So whoever installs one for a while can put the previous one back."""
    def first(address):
        return "first"

    previous = kernels.set_address_describer(first)
    try:
        assert kernels.set_address_describer(first) is first
    finally:
        kernels.set_address_describer(previous)


_INDEX_SOURCE = r"""
extern "C" __global__ void where(unsigned int* out) {
    const unsigned int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned int i = b * (blockDim.x * blockDim.y * blockDim.z) + t;
    out[4 * i] = b; out[4 * i + 1] = t; out[4 * i + 2] = threadIdx.y; out[4 * i + 3] = warpSize;
}
"""


@pytest.fixture(scope="module")
def where():
    return kernels.RawKernel(_INDEX_SOURCE, "where")


@pytest.mark.parametrize("grid, block", [((3,), (5,)), ((2, 3), (4, 2)),
                                         ((2, 1, 2), (2, 2, 2)), ((1,), (1024,)),
                                         ((1, 1, 1), (1, 1, 64))])
def test_every_thread_of_every_block_runs_once_with_its_indices(where, grid, block):
    """Grid and block as tuples of one to three: each (block, thread) runs once and sees
    its blockIdx, threadIdx, blockDim, gridDim and warpSize."""
    g, b = grid, block
    nb, nt = int(np.prod(g)), int(np.prod(b))
    out = device(np.full(4 * nb * nt, 0xFFFFFFFF, np.uint32))
    where(grid, block, (out,))
    got = out.host.reshape(nb, nt, 4)
    assert (got[:, :, 0] == np.arange(nb)[:, None]).all()
    assert (got[:, :, 1] == np.arange(nt)[None, :]).all()
    bx = b[0]
    by = b[1] if len(b) > 1 else 1
    assert (got[:, :, 2] == (np.arange(nt) // bx) % by).all()
    assert (got[:, :, 3] == 32).all()


@pytest.mark.parametrize("grid, block, match", [
    ((1,), (1025,), "x = 1025"), ((1,), (32, 33), "1056 threads"),
    ((1,), (1, 1, 65), "z = 65"), ((1,), (1, 1025), "y = 1025"), ((1,), (0,), "empty along x"),
    ((0,), (32,), "empty along x"), ((1, 0), (32,), "empty along y"), ((-1,), (32,), "empty"),
    ((1, 65536), (1,), "y = 65536"), ((1, 1, 65536), (1,), "z = 65536"),
    ((2 ** 31,), (1,), "x = 2147483648")])
def test_launch_configurations_beyond_cuda_limits_are_refused(where, grid, block, match):
    """Block dims (1024, 1024, 64) with 1024 threads at most, grid dims (2**31-1, 65535,
    65535), none empty: as cuLaunchKernel, which refuses anything else."""
    out = device(np.zeros(16, np.uint32))
    with pytest.raises(kernels.InvalidConfigurationError, match=match) as info:
        where(grid, block, (out,))
    assert info.value.status == "CUDA_ERROR_INVALID_VALUE"
    assert "where" in str(info.value)


@pytest.mark.parametrize("grid", [1, [1], (1, 1, 1, 1), 1.0, (1, "2")])
def test_grid_must_be_a_short_tuple(where, grid):
    """An int, a list, a float or four dimensions is a TypeError (CuPy takes tuples)."""
    with pytest.raises(TypeError, match="grid"):
        where(grid, (1,), (device(np.zeros(4, np.uint32)),))


_SHARED_SOURCE = r"""
extern "C" __global__ void reverse(const float* in, float* out) {
    extern __shared__ __align__(16) float scratch[];
    scratch[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = scratch[blockDim.x - 1 - threadIdx.x];
}
"""


def test_dynamic_shared_memory_is_sized_at_launch():
    """`extern __shared__` arrays get `shared_mem` bytes; above 48 KiB only after raising
    max_dynamic_shared_size_bytes, as on a GPU."""
    kernel = kernels.RawKernel(_SHARED_SOURCE, "reverse")
    x = device(np.arange(512, dtype=np.float32))
    out = device(np.zeros(512, np.float32))
    kernel((2,), (256,), (x, out), shared_mem=256 * 4)
    assert (out.host == np.concatenate([np.arange(255, -1, -1), np.arange(511, 255, -1)])).all()
    with pytest.raises(kernels.InvalidConfigurationError, match="shared memory"):
        kernel((2,), (256,), (x, out), shared_mem=64 * 1024)
    kernel.max_dynamic_shared_size_bytes = 64 * 1024
    kernel((2,), (256,), (x, out), shared_mem=64 * 1024)


def test_launches_from_several_threads_all_complete():
    """Threads launching at once each get their own correct result (launches serialise)."""
    kernel = _sum_kernel(np.float32, np.float32)
    errors, n = [], 20000

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            xs = [device(rng.standard_normal(n).astype(np.float32)) for _ in range(2)]
            out = device(np.zeros(n, np.float32))
            for _ in range(5):
                table, blocks = _kernels.build_table([out.data.ptr], [n],
                                                     [[x.data.ptr for x in xs]], [[]])
                kernel((blocks,), (256,), (device(table), np.int32(1)))
                np.testing.assert_array_equal(out.host, xs[0].host + xs[1].host)
        except Exception as exc:  # collected: an assertion in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
