"""Faults in emulated kernels: an access past an allocation's guard page is an
IllegalAddressError naming the kernel, block, thread and address, and the process, its
signal handlers and later launches are unharmed."""
from __future__ import annotations

import ctypes
import signal

import numpy as np
import pytest

from .support import DeviceArray, GuardedBuffer, device, kernels

_OFF_BY_ONE = r"""
extern "C" __global__ void fill(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;  /* one too many */
}
"""

_SYNCED_OFF_BY_ONE = r"""
extern "C" __global__ void fill_synced(const float* in, float* out, int n) {
    __shared__ float tile[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = in[i];
    __syncthreads();
    out[i + 1] = tile[threadIdx.x];  /* the last thread writes past the end */
}
"""


@pytest.fixture(scope="module")
def fill():
    return kernels.RawKernel(_OFF_BY_ONE, "fill")


def test_writing_past_an_allocation_is_an_illegal_address(fill, address_describer):
    """The first element past a buffer that ends at a PROT_NONE page: block 1, thread 0
    writes it, and the error says so with the address."""
    address_describer(None)
    guarded = GuardedBuffer(1024)
    out = guarded.array(np.float32)
    with pytest.raises(kernels.IllegalAddressError) as info:
        fill((2,), (256,), (DeviceArray(out), np.int32(256)))
    error = info.value
    assert error.status == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert (error.kernel, error.block, error.thread) == ("fill", (1, 0, 0), (0, 0, 0))
    assert error.address == guarded.guard
    assert error.access == "writing"
    assert f"writing address 0x{guarded.guard:x}" in str(error)
    assert "kernel fill, block (1, 0, 0), thread (0, 0, 0)" in str(error)
    assert (out == 1.0).all()  # the threads before it ran


def test_the_address_describer_words_the_faulting_address(fill, address_describer):
    """The hook's words for the address take the place of its hex in the message."""
    guarded = GuardedBuffer(512)
    seen = []

    def describe(address):
        seen.append(address)
        return f"0x{address:x}, {address - guarded.start - guarded.nbytes} bytes past the " \
               f"end of a {guarded.nbytes}-byte allocation on GPU 0"

    address_describer(describe)
    with pytest.raises(kernels.IllegalAddressError,
                       match=f"writing 0x{guarded.guard:x}, 0 bytes past the end of a "
                             f"512-byte allocation on GPU 0$"):
        fill((1,), (256,), (DeviceArray(guarded.array(np.float32)), np.int32(128)))
    assert seen == [guarded.guard]


def test_a_failing_describer_does_not_hide_the_fault(fill, address_describer):
    """An exception in the hook is reported inside the IllegalAddressError."""
    def broken(address):
        raise LookupError("no such allocation")

    address_describer(broken)
    guarded = GuardedBuffer(64)
    with pytest.raises(kernels.IllegalAddressError, match="LookupError: no such allocation"):
        fill((1,), (32,), (DeviceArray(guarded.array(np.float32)), np.int32(16)))


def test_a_fault_inside_a_synchronising_kernel_is_reported_and_later_launches_work(fill):
    """A thread run as a fiber faults: the error names it, and both kinds of launch (plain
    and fibers) run correctly afterwards."""
    kernel = kernels.RawKernel(_SYNCED_OFF_BY_ONE, "fill_synced")
    guarded = GuardedBuffer(256 * 4)
    source = device(np.arange(256, dtype=np.float32))
    with pytest.raises(kernels.IllegalAddressError) as info:
        kernel((1,), (256,), (source, DeviceArray(guarded.array(np.float32)), np.int32(256)))
    assert info.value.thread == (255, 0, 0)
    roomy = device(np.zeros(257, np.float32))
    kernel((1,), (256,), (source, roomy, np.int32(256)))
    assert (roomy.host[1:] == np.arange(256)).all()
    out = device(np.zeros(300, np.float32))
    fill((2,), (256,), (out, np.int32(299)))
    assert (out.host == 1.0).all()


def test_reading_through_a_null_pointer_is_an_illegal_address(address_describer):
    """None passes a null pointer; reading through it faults at address 0."""
    address_describer(None)
    kernel = kernels.RawKernel(
        'extern "C" __global__ void read(const int* p, int* out) { out[0] = p[3]; }', "read")
    with pytest.raises(kernels.IllegalAddressError, match="reading address 0xc") as info:
        kernel((1,), (1,), (None, device(np.zeros(1, np.int32))))
    assert info.value.address == 12


def test_integer_division_by_zero_fails_the_launch():
    """On the CPU it traps: a KernelFaultError, not a dead process."""
    kernel = kernels.RawKernel(
        'extern "C" __global__ void divide(int* out, int d) { out[0] = 100 / d; }', "divide")
    with pytest.raises(kernels.KernelFaultError, match="division by zero"):
        kernel((1,), (1,), (device(np.zeros(1, np.int32)), np.int32(0)))


def test_a_failed_assert_fails_the_launch_with_its_text():
    """assert() in a kernel: CUDA_ERROR_ASSERT naming the condition and the thread."""
    kernel = kernels.RawKernel(
        'extern "C" __global__ void check(const int* x) { assert(x[threadIdx.x] > 0); }',
        "check")
    with pytest.raises(kernels.KernelFaultError, match=r"thread \(2, 0, 0\).*x\[threadIdx.x\] > 0"
                       ) as info:
        kernel((1,), (4,), (device([1, 1, 0, 1], np.int32),))
    assert info.value.status == "CUDA_ERROR_ASSERT"


_libc = ctypes.CDLL(None)


def _handler_of(signo: int) -> int:
    buf = ctypes.create_string_buffer(256)  # glibc's struct sigaction starts with the handler
    assert _libc.sigaction(signo, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value or 0


def _altstack() -> tuple:
    buf = ctypes.create_string_buffer(64)  # stack_t: ss_sp, ss_flags, ss_size
    assert _libc.sigaltstack(None, buf) == 0
    return bytes(buf.raw[:24])


def test_the_process_signal_handlers_are_restored_after_launches(fill):
    """Python's own SIGSEGV/SIGBUS/SIGFPE handlers (faulthandler's) and alternate stack are
    back after a launch, clean or faulted."""
    signals = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
    before = [_handler_of(s) for s in signals], _altstack()
    fill((1,), (32,), (device(np.zeros(33, np.float32)), np.int32(32)))
    with pytest.raises(kernels.IllegalAddressError):
        fill((1,), (32,), (DeviceArray(GuardedBuffer(16).array(np.float32)), np.int32(4)))
    assert ([_handler_of(s) for s in signals], _altstack()) == before


_DEEP = r"""
__device__ int deep(int n) {
    volatile char frame[20000];  /* bigger than a guard page: probed page by page */
    frame[0] = (char)n;
    return n ? deep(n - 1) + frame[0] : 0;
}
extern "C" __global__ void recurse(int* out, int depth) {
    __syncthreads();
    out[threadIdx.x] = deep(depth);
}
"""


def test_a_fiber_running_out_of_stack_fails_the_launch_cleanly():
    """A thread run as a fiber has 64 KiB of stack: past it, a KernelFaultError saying so,
    and the next launch of the same kernel, within bounds, works."""
    kernel = kernels.RawKernel(_DEEP, "recurse")
    out = device(np.zeros(4, np.int32))
    with pytest.raises(kernels.KernelFaultError, match="stack overflow") as info:
        kernel((1,), (4,), (out, np.int32(10)))
    assert info.value.thread == (0, 0, 0)
    kernel((1,), (4,), (out, np.int32(1)))
    assert out.host.tolist() == [1, 1, 1, 1]
