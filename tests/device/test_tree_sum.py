"""`tree_sum_into` and `host_tree_sum`: the canonical tree sum of `gpukv.canonical`, bit for
bit, on the host (blocked and threaded, or whole) and on GPUs (one kernel per dtype pair,
sources read where they lie or copied to the GPU first)."""
from __future__ import annotations

import numpy as np
import pytest

from gpukv.canonical.tree import leaves_sum
from gpukv.device import host_device
from gpukv.device import host_sum as host_sum_mod
from gpukv.device.host_sum import host_tree_sum

from ..gpu_gate import hardware_missing

COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33)


def _values(k: int, n: int, dtype=np.float32, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(dtype)
            for _ in range(k)]


def _reference(arrays, out_dtype) -> np.ndarray:
    """leaves_sum in the accumulation dtype (float32 for 16-bit floats), rounded once."""
    acc = np.float32 if np.dtype(out_dtype).itemsize == 2 else out_dtype
    return leaves_sum([a.astype(acc) for a in arrays], np.add).astype(out_dtype)


@pytest.mark.parametrize("n", [1000, 300_000], ids=["whole", "blocked"])
@pytest.mark.parametrize("k", COUNTS)
def test_host_tree_sum_is_the_tree(k, n):
    """float32 arrays, small (one block) or large (blocks over threads): the bits of
    `leaves_sum`."""
    values = _values(k, n)
    out = np.empty(n, np.float32)
    host_tree_sum(out, values)
    assert out.tobytes() == _reference(values, np.float32).tobytes()


def test_host_tree_sum_uses_many_blocks_and_threads(monkeypatch):
    """With small blocks and chunks the blocked path cuts an array in many pieces and
    still gives the tree's bits."""
    monkeypatch.setattr(host_sum_mod, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(host_sum_mod, "THREAD_BYTES", 64 << 10)
    monkeypatch.setattr(host_sum_mod, "THREADS", 3)
    values = _values(11, 300_001)
    out = np.empty(300_001, np.float32)
    host_tree_sum(out, values)
    assert out.tobytes() == _reference(values, np.float32).tobytes()


@pytest.mark.parametrize(("source", "out"), [("float16", "float16"), ("float16", "float32"),
                                             ("float64", "float64"), ("int32", "int32")])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_host_tree_sum_accumulates_in_the_outs_accumulation_dtype(source, out, k):
    """Leaves of another dtype are summed in out's accumulation dtype and rounded once;
    one leaf is a copy with a cast."""
    values = [v.astype(source) if source != "int32" else (v * 100).astype(source)
              for v in _values(k, 5000)]
    target = np.empty(5000, out)
    host_tree_sum(target, values)
    assert target.tobytes() == _reference(values, np.dtype(out)).tobytes()


def test_host_tree_sum_takes_strided_arrays():
    """Transposed (non-contiguous) leaves and out give the tree's bits."""
    values = [v.reshape(50, 40).T for v in _values(6, 2000)]
    out = np.empty((50, 40), np.float32).T
    host_tree_sum(out, values)
    assert np.ascontiguousarray(out).tobytes() == \
        np.ascontiguousarray(leaves_sum(values, np.add)).tobytes()


def test_host_device_tree_sum_into():
    """The host device's verb: every job its tree sum; no arrays: zeros."""
    values = _values(5, 100)
    out, empty = np.empty(100, np.float32), np.ones(7, np.float32)
    host_device(0).tree_sum_into([(out, values), (empty, [])])
    assert out.tobytes() == _reference(values, np.float32).tobytes()
    assert not empty.any()


# -------------------------------------------------------------------------- GPUs
@pytest.fixture
def gpus():
    from gpukv.device.cuda.device import cuda_device, gpu_count
    if gpu_count() < 2:
        hardware_missing("the test needs two physical GPUs")
    return [cuda_device(i) for i in range(gpu_count())]


def _place(cp, devices, values, where):
    """Each value on the device `where[i]` names (an index of `devices`, or 'host')."""
    out = []
    for v, w in zip(values, where):
        if w == "host":
            out.append(v)
        else:
            with devices[w].cuda_device:
                out.append(cp.asarray(v))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("k", COUNTS)
def test_gpu_tree_sum_is_the_tree(gpus, k):
    """Leaves on this GPU, a peer GPU, a GPU without peer access and the host: the bits
    of `leaves_sum` (and of the host's tree sum)."""
    import cupy as cp
    home = gpus[0]
    values = _values(k, 3001, seed=k)
    cycle = [0, 1, "host", len(gpus) - 1]
    arrays = _place(cp, gpus, values, [cycle[i % len(cycle)] for i in range(k)])
    for d in gpus[1:]:
        home.wait_for(d)
    with home.cuda_device:
        out = cp.empty(3001, np.float32)
    home.tree_sum_into([(out, arrays)])
    assert cp.asnumpy(out).tobytes() == _reference(values, np.float32).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize(("source", "out"), [("float16", "float16"), ("float16", "float32"),
                                             ("float32", "float32"), ("int32", "int32")])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_gpu_tree_sum_accumulates_in_the_outs_accumulation_dtype(gpus, source, out, k):
    """As on the host: leaves of another dtype summed in out's accumulation dtype and
    rounded once; one leaf a copy with a cast (a bit copy for one dtype)."""
    import cupy as cp
    home = gpus[0]
    values = [v.astype(source) if source != "int32" else (v * 100).astype(source)
              for v in _values(k, 4000)]
    with home.cuda_device:
        arrays = [cp.asarray(v) for v in values]
        target = cp.empty(4000, out)
    home.tree_sum_into([(target, arrays)])
    assert cp.asnumpy(target).tobytes() == _reference(values, np.dtype(out)).tobytes()


@pytest.mark.gpu
def test_gpu_tree_sum_of_mixed_leaf_dtypes_and_many_keys(gpus):
    """Several jobs in one call, one with leaves of two dtypes and one with none: each
    the host's tree sum (zeros for none)."""
    import cupy as cp
    home = gpus[0]
    mixed = [v.astype(np.float16 if i % 2 else np.float32)
             for i, v in enumerate(_values(5, 700, seed=3))]
    plain = _values(3, 9000, seed=4)
    with home.cuda_device:
        outs = [cp.empty(700, np.float32), cp.empty(9000, np.float32),
                cp.ones(5, np.float32)]
        jobs = [(outs[0], [cp.asarray(v) for v in mixed]),
                (outs[1], [cp.asarray(v) for v in plain]), (outs[2], [])]
    home.tree_sum_into(jobs)
    want = [np.empty(700, np.float32), np.empty(9000, np.float32)]
    host_tree_sum(want[0], mixed)
    host_tree_sum(want[1], plain)
    assert cp.asnumpy(outs[0]).tobytes() == want[0].tobytes()
    assert cp.asnumpy(outs[1]).tobytes() == want[1].tobytes()
    assert not cp.asnumpy(outs[2]).any()


@pytest.mark.gpu
def test_gpu_tree_sum_keeps_subnormals(gpus):
    """float32 subnormal leaves and partial sums are kept, as NumPy keeps them (explicit
    PTX adds, which -ftz=true does not flush)."""
    import cupy as cp
    home = gpus[0]
    tiny = np.finfo(np.float32).tiny
    values = [(v * tiny / 1000).astype(np.float32) for v in _values(5, 2000, seed=9)]
    with home.cuda_device:
        arrays = [cp.asarray(v) for v in values]
        out = cp.empty(2000, np.float32)
    home.tree_sum_into([(out, arrays)])
    want = _reference(values, np.float32)
    assert np.count_nonzero(want) > 1000
    assert cp.asnumpy(out).tobytes() == want.tobytes()


def _about_float32_subnormals(k: int, n: int, seed: int) -> list:
    """k float64 arrays of values from 2**-149 to 2**-118 (all 53 bits, both signs):
    float32 subnormals, and small normals, once converted."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-148, -118, n) for _ in range(k)]


def _subnormals(a) -> int:
    return int(np.count_nonzero((a != 0) & (np.abs(a) < np.finfo(a.dtype).tiny)))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 5])
def test_gpu_tree_sum_of_float64_leaves_keeps_float32_subnormals(gpus, k):
    """float64 leaves into a float32 out (deterministic=True's sum): each leaf read as
    float32 keeping its subnormals (explicit PTX; -ftz=true's conversion would flush
    them), then the tree's adds: the host's bits."""
    import cupy as cp
    home = gpus[0]
    values = _about_float32_subnormals(k, 3000, seed=k)
    with home.cuda_device:
        arrays = [cp.asarray(v) for v in values]
        out = cp.empty(3000, np.float32)
    home.tree_sum_into([(out, arrays)])
    want = _reference(values, np.float32)
    assert _subnormals(want) > 500
    assert cp.asnumpy(out).tobytes() == want.tobytes()


@pytest.mark.gpu
def test_gpu_tree_sum_of_mixed_leaves_keeps_float32_subnormals(gpus):
    """Leaves of float64 and float32 into float32: the float64 ones converted by the copy
    kernel first, keeping float32 subnormals as the host's conversion does."""
    import cupy as cp
    home = gpus[0]
    values = [v.astype(np.float32) if i % 2 else v
              for i, v in enumerate(_about_float32_subnormals(5, 3000, seed=7))]
    with home.cuda_device:
        arrays = [cp.asarray(v) for v in values]
        out = cp.empty(3000, np.float32)
    home.tree_sum_into([(out, arrays)])
    want = np.empty(3000, np.float32)
    host_tree_sum(want, values)
    assert _subnormals(want) > 500
    assert cp.asnumpy(out).tobytes() == want.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_tree_sum_of_float32_leaves_into_float64_keeps_subnormals(gpus, k):
    """float32 subnormal leaves into a float64 out are widened exactly, as NumPy widens
    them (explicit PTX; -ftz=true's conversion would make them zeros)."""
    import cupy as cp
    home = gpus[0]
    values = [v.astype(np.float32) for v in _about_float32_subnormals(k, 3000, seed=11)]
    assert _subnormals(values[0]) > 1000
    with home.cuda_device:
        arrays = [cp.asarray(v) for v in values]
        out = cp.empty(3000, np.float64)
    home.tree_sum_into([(out, arrays)])
    assert cp.asnumpy(out).tobytes() == _reference(values, np.float64).tobytes()


@pytest.mark.gpu
def test_gpu_tree_sum_of_one_float64_leaf_into_float16_rounds_once(gpus):
    """One float64 leaf into a float16 out is NumPy's cast, rounded once: values a hair
    off the midpoints between float16 values, which rounding through float32 would
    round to even instead."""
    import cupy as cp
    home = gpus[0]
    grid = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mid = (grid[:-1] + grid[1:]) / 2
    sign = np.random.default_rng(4).choice([-1.0, 1.0], mid.size)
    value = (mid + mid * 2.0 ** -40 * sign) * np.resize([1.0, -1.0, -1.0], mid.size)
    want = value.astype(np.float16)
    assert np.count_nonzero(value.astype(np.float32).astype(np.float16) != want) > 10000
    with home.cuda_device:
        leaf = cp.asarray(value)
        out = cp.empty(value.size, np.float16)
    home.tree_sum_into([(out, [leaf])])
    assert cp.asnumpy(out).tobytes() == want.tobytes()
    host = np.empty(value.size, np.float16)
    host_tree_sum(host, [value])
    assert host.tobytes() == want.tobytes()
