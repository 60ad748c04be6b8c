"""The emulated CuPy keeps CuPy 14's rules where code written against NumPy would slip,
and its memory, streams, DLPack and NCCL check what a GPU would check."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

from .. import gpu_env
from ..bfloat16 import needs_bfloat16

pytestmark = pytest.mark.skipif(not gpu_env.EMULATED, reason="tests of the CUDA emulation")


@pytest.fixture
def cp():
    import cupy
    return cupy


# ------------------------------------------------------------------ arrays and NumPy
def test_arrays_are_not_numpy_arrays_and_refuse_implicit_conversion(cp):
    """An emulated array is no numpy.ndarray; np.asarray on it raises CuPy's TypeError."""
    a = cp.arange(4, dtype=cp.float32)
    assert not isinstance(a, np.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(a)


@pytest.mark.parametrize("operation", [
    lambda a, h: a + h, lambda a, h: h + a, lambda a, h: a.__iadd__(h),
    lambda a, h: np.add(a, h), lambda a, h: a < h])
def test_numpy_operands_are_refused(cp, operation):
    """A NumPy array in an operation on device arrays is a TypeError, as in CuPy."""
    with pytest.raises(TypeError, match="Unsupported type"):
        operation(cp.ones(3), np.ones(3))


def test_setitem_and_copyto_refuse_host_arrays_but_take_scalars(cp):
    """x[...] = numpy_array and copyto(x, numpy_array) are ValueErrors; scalars and 0-d
    host arrays are fine."""
    a = cp.zeros(3)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        a[...] = np.ones(3)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        cp.copyto(a, np.ones(3))
    a[...] = np.float64(2.0)
    cp.copyto(a, np.array([3.0]))
    assert a.get().tolist() == [3.0, 3.0, 3.0]


def test_reductions_and_elements_are_0d_device_arrays(cp):
    """sum() and x[0] give 0-d device arrays; int() of a 1-element 1-D array is refused."""
    a = cp.arange(5)
    assert isinstance(a.sum(), cp.ndarray) and a.sum().shape == ()
    assert isinstance(a[0], cp.ndarray) and int(a[0]) == 0
    with pytest.raises(TypeError):
        int(a[:1])


def test_fresh_allocations_are_poisoned(cp):
    """An array nobody wrote reads as all-ones bytes: NaN for floats, -1 for ints."""
    assert np.isnan(cp.empty(8, cp.float32).get()).all()
    assert (cp.empty(8, cp.int32).get() == -1).all()


def test_asarray_copies_only_where_needed(cp):
    """asarray keeps the array, copies another GPU's to this one, and refuses a cast
    when told not to copy."""
    a = cp.ones(3, cp.float32)
    cp.cuda.Device(0).synchronize()  # GPU 1 copies it on a stream of its own
    assert cp.asarray(a) is a
    with pytest.raises(ValueError, match="avoid copy"):
        cp.asarray(a, dtype=cp.float64, copy=False)
    with cp.cuda.Device(1):
        moved = cp.asarray(a)
    assert moved.device.id == 1 and moved.get().tolist() == [1, 1, 1]


# --------------------------------------------------------------------------- devices
def test_reading_another_gpu_needs_peer_access(cp):
    """An operation reading another GPU's array warns with peer access and fails
    without it (the emulated ring has 0-1 but not 0-3)."""
    with cp.cuda.Device(1):
        near = cp.ones(3)
    with cp.cuda.Device(3):
        far = cp.ones(3)
    cp.cuda.Device(1).synchronize()  # GPU 0 reads it on a stream of its own
    with pytest.warns(cp._util.PerformanceWarning, match="Peer access has been activated"):
        near + 1
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        far + 1
    cp.cuda.Device(0).synchronize()  # GPU 0's read, before `near` returns to GPU 1's pool


def test_stream_event_and_launch_stay_on_their_gpu(cp):
    """A stream entered, an event recorded or a kernel launched under another GPU fail."""
    with cp.cuda.Device(1):
        stream = cp.cuda.Stream()
    with pytest.raises(RuntimeError, match="does not match"):
        with stream:
            pass
    event = cp.cuda.Event(disable_timing=True)  # on GPU 0
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="GPU 1"):
        event.record(stream)
    kernel = cp.RawKernel('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "k")
    with pytest.raises(RuntimeError, match="stream of GPU 1"):
        kernel((1,), (1,), (cp.zeros(1, cp.float32),), stream=stream)


def test_kernel_grid_must_be_a_tuple(cp):
    """A kernel's grid and block are tuples, as CuPy requires."""
    kernel = cp.RawKernel('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "k")
    with pytest.raises(TypeError, match="grid"):
        kernel(1, (1,), (cp.zeros(1, cp.float32),))


# -------------------------------------------------------------------------- memory
def test_copies_outside_an_allocation_are_refused(cp):
    """A device copy reading past its source, or a host address that is device memory,
    is a CUDA error naming where the address lies."""
    src, dst = cp.ones(4, cp.float32), cp.zeros(8, cp.float32)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="32 bytes .*16-byte alloc"):
        dst.data.copy_from_device_async(src.data, dst.nbytes)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="host pointer"):
        dst.data.copy_from_host_async(src.data.ptr, src.nbytes)


def test_out_of_bounds_kernel_names_the_allocation(cp):
    """A kernel writing one element past an array fails with an illegal address that says
    which allocation it ran off."""
    kernel = cp.RawKernel('extern "C" __global__ void k(float* x, int n) '
                          '{ x[threadIdx.x] = 1.0f; (void)n; }', "k")
    from cudaemu import kernels
    with pytest.raises(kernels.IllegalAddressError, match="byte 12 of a 12-byte allocation"):
        kernel((1,), (4,), (cp.zeros(3, cp.float32), np.int32(3)))


def test_pool_memory_is_hidden_from_gpus_it_does_not_grant(cp):
    """A kernel on GPU 0 reading stream-ordered pool memory of GPU 1 faults until the
    pool grants GPU 0 access, peer access or not."""
    from cudaemu import kernels, memory
    pool = cp.cuda.MemoryAsyncPool()
    with cp.cuda.Device(1), cp.cuda.using_allocator(pool.malloc):
        source = cp.full(4, 2.0, cp.float32)
    cp.cuda.Device(1).synchronize()  # GPU 0 reads it on a stream of its own
    copy = cp.RawKernel('extern "C" __global__ void k(const float* s, float* d) '
                        '{ d[threadIdx.x] = s[threadIdx.x]; }', "k")
    out = cp.zeros(4, cp.float32)
    with pytest.raises(kernels.IllegalAddressError):
        copy((1,), (4,), (source, out))
    memory.mapping_of(source.data).grant(0)
    copy((1,), (4,), (source, out))
    assert out.get().tolist() == [2.0] * 4


def test_the_registry_forgets_freed_memory(cp):
    """Freed arrays leave the registry (their bytes no longer count as in use)."""
    from cudaemu import memory
    gc.collect()
    cp.cuda.Device(0).synchronize()  # (an earlier test's frees come back first)
    before = memory.used_bytes(0)
    arrays = [cp.empty(1000, cp.float32) for _ in range(10)]
    assert memory.used_bytes(0) == before + 40000
    del arrays
    gc.collect()
    cp.cuda.Device(0).synchronize()  # freed blocks go back in their stream's order
    assert memory.used_bytes(0) == before


# -------------------------------------------------------------------------- DLPack
@needs_bfloat16
def test_dlpack_round_trip_keeps_bfloat16_and_memory(cp):
    """A DLPack capsule carries bfloat16 as bfloat16 and the same memory; the CUDA array
    interface publishes it as raw 2-byte voids, as CuPy does."""
    import ml_dtypes
    a = cp.ones(3, ml_dtypes.bfloat16)
    b = cp.from_dlpack(a)
    assert b.dtype == a.dtype and b.data.ptr == a.data.ptr
    assert a.__cuda_array_interface__["typestr"] == "<V2"
    with pytest.raises(TypeError, match="CPU arrays"):
        cp.from_dlpack(np.ones(3))


# ---------------------------------------------------------------------------- NCCL
def _comms(cp, n=2):
    from cupy.cuda import nccl
    return nccl, nccl.NcclCommunicator.initAll(list(range(n)))


def test_nccl_all_reduce_in_a_group(cp):
    """Every rank's allReduce, in one group, sums the buffers of every GPU."""
    nccl, comms = _comms(cp)
    bufs = []
    for rank in range(2):
        with cp.cuda.Device(rank):
            bufs.append(cp.full(5, rank + 1.0, cp.float32))
    nccl.groupStart()
    for rank, (comm, buf) in enumerate(zip(comms, bufs)):
        with cp.cuda.Device(rank):
            comm.allReduce(buf.data.ptr, buf.data.ptr, 5, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cp.cuda.get_current_stream().ptr)
    nccl.groupEnd()
    assert all(b.get().tolist() == [3.0] * 5 for b in bufs)


def test_nccl_refuses_what_would_hang_or_misread(cp):
    """A call outside a group, a rank that never joins, disagreeing counts and a buffer
    too small for its count and data type are all NcclErrors."""
    nccl, comms = _comms(cp)
    bufs = []
    for rank in range(2):
        with cp.cuda.Device(rank):
            bufs.append(cp.ones(4, cp.float32))
    stream = cp.cuda.Stream.null.ptr
    with pytest.raises(nccl.NcclError, match="would hang"):
        comms[0].allReduce(bufs[0].data.ptr, bufs[0].data.ptr, 4, nccl.NCCL_FLOAT32, 0, stream)
    nccl.groupStart()
    comms[0].allReduce(bufs[0].data.ptr, bufs[0].data.ptr, 4, nccl.NCCL_FLOAT32, 0, stream)
    with pytest.raises(nccl.NcclError, match="never joined"):
        nccl.groupEnd()
    with cp.cuda.Device(1):
        with pytest.raises(nccl.NcclError, match="32 bytes .*16-byte allocation"):
            comms[1].allReduce(bufs[1].data.ptr, bufs[1].data.ptr, 4, nccl.NCCL_FLOAT64, 0,
                               stream)
    nccl.groupStart()
    comms[0].allReduce(bufs[0].data.ptr, bufs[0].data.ptr, 4, nccl.NCCL_FLOAT32, 0, stream)
    with cp.cuda.Device(1):
        comms[1].allReduce(bufs[1].data.ptr, bufs[1].data.ptr, 2, nccl.NCCL_FLOAT32, 0,
                           stream)
    with pytest.raises(nccl.NcclError, match="count=2"):
        nccl.groupEnd()


def test_no_floating_point_warnings_from_device_arithmetic(cp):
    """Overflow and division by zero on device arrays are silent, as on a GPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (cp.full(2, 60000, cp.float16) * 2) / cp.zeros(2, cp.float16)
