"""An NCCL link's group of collectives on a GPU with its own stream (a virtual GPU),
within one process: ordered after the caller's work on CuPy's current stream, and the
caller's later work after it."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def transport():
    """A transport of one rank (MPI's COMM_SELF), whose waits give up after 5 s and whose
    failures stay with it (the test process is not aborted at exit)."""
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from gpukv.distributed.mpi.transport import Transport

    class OneRank(Transport):
        def fail(self, error):
            self.failure = error
            return error

    return OneRank(MPI.COMM_SELF, timeout=5.0)


@pytest.mark.gpu
def test_a_link_on_a_virtual_gpu_orders_the_callers_work(transport):
    """An all-reduce run by a link on a virtual GPU's stream reads what the caller wrote
    on CuPy's current stream just before, and the caller then reads its result."""
    import cupy

    from gpukv.device.cuda.device import cuda_device
    from gpukv.distributed.engines.nccl_rounds import NcclLink, all_reduce
    device = cuda_device(0, 1)
    link = NcclLink(transport, device)
    with device.cuda_device:
        send = cupy.full(1 << 12, 3.0, cupy.float32)
        recv = cupy.zeros(1 << 12, cupy.float32)
        link.run([all_reduce(send, recv)], "an all-reduce")
        np.testing.assert_array_equal(recv.get(), np.full(1 << 12, 3.0, np.float32))


@pytest.mark.gpu
def test_a_collective_that_never_completes_times_out_and_aborts(transport):
    """A group whose collectives never complete (a peer that never joins, emulated) is a
    PeerError after the transport's timeout, and the communicator is aborted."""
    from .. import gpu_env
    if not gpu_env.EMULATED:
        pytest.skip("a hung collective is made by the CUDA emulation")
    import cupy
    from cudaemu.nccl import stall
    from cupy.cuda import nccl

    from gpukv import PeerError
    from gpukv.device.cuda.device import cuda_device
    from gpukv.distributed.engines.nccl_rounds import NcclLink, all_reduce
    transport.timeout = 0.2
    device = cuda_device(0, 1)
    link = NcclLink(transport, device)
    stall(link.comm)
    with device.cuda_device:
        buf = cupy.ones(16, cupy.float32)
        with pytest.raises(PeerError, match="NCCL did not finish within 0.2 s"):
            link.run([all_reduce(buf, buf)], "a stalled all-reduce")
    with pytest.raises(nccl.NcclError, match="destroyed"):  # aborted: no more collectives
        link.run([all_reduce(buf, buf)], "after the abort")
