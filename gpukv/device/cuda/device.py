"""The CUDA backend: CuPy arrays on GPUs. CuPy is imported on first use only.

Streams and events: every logical device owns the stream its work is queued on
(slot 0: CuPy's current stream of the GPU; a virtual GPU: its own non-blocking
stream). Work on two devices is ordered by recording an event on one stream and
making the other wait for it; nothing here synchronises the host, except `keep_alive`
when too many page-locked bytes wait for their copies.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import threading

import numpy as np

from ..._errors import DeviceError
from ..base import Device, virtual_gpus
from . import kernels as _kernels
from . import optim_kernels as _optim_kernels
from . import sums as _sums
from .driver import CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE, pointer_access
from .runtime import cupy_module, gpu_count, ordering_event  # noqa: F401 (re-exported)

log = logging.getLogger("gpukv")


class CudaDevice(Device):
    """One GPU, or one virtual GPU (`slot`) sharing a physical one, with its own stream."""

    kind = "gpu"
    asynchronous = True
    peer_links = True
    supports_nccl = True

    def __init__(self, physical: int, slot: int = 0):
        count = gpu_count()
        if not 0 <= physical < count:
            raise DeviceError(f"GPU {physical} does not exist: {count} GPU(s) are visible")
        super().__init__(physical, slot)
        self._cp = cupy_module()
        self._cuda_device = self._cp.cuda.Device(physical)
        self._stream = None
        self._stream_lock = threading.Lock()  # devices are shared by every thread
        self._used = None  # slot 0: the current stream its last work was queued on

    @property
    def xp(self):
        return self._cp

    @property
    def cuda_device(self):
        return self._cuda_device

    @property
    def stream(self):
        """The stream this device's work is queued on.

        Slot 0 uses CuPy's current stream on the GPU, so results are ordered with the
        caller's own work; other slots (virtual GPUs) each own a non-blocking stream.
        When the current stream is another than the one slot 0's work last went to (the
        caller switched streams, or another thread calls with its own), the new one
        first waits for everything queued on the old one: the store's arrays on this GPU
        are read and written in call order, whatever stream each call comes from.
        """
        if self.slot == 0:
            current = self._cp.cuda.get_current_stream(self.physical)
            used = self._used
            if used is not current:
                if used is not None and used.ptr != current.ptr:
                    with self._cuda_device:
                        current.wait_event(ordering_event(used))
                self._used = current
            return current
        if self._stream is None:
            with self._stream_lock:  # one stream, whichever thread asks first
                if self._stream is None:
                    with self._cuda_device:
                        self._stream = self._cp.cuda.Stream(non_blocking=True)
        return self._stream

    @contextlib.contextmanager
    def activate(self):
        """Make this GPU and this device's stream current inside the `with` block."""
        with self._cuda_device, self.stream:
            yield

    def record(self):
        """An event recorded now on this device's stream."""
        stream = self.stream
        with self._cuda_device:
            return ordering_event(stream)

    def wait_for(self, other: Device) -> None:
        """Order this device's stream after the work queued so far on `other`'s stream."""
        if not isinstance(other, CudaDevice):
            return
        mine = self.stream
        theirs = other.stream  # (ordered after the work `other` queued on an earlier one)
        # One stream object may stand for a stream of every GPU: CuPy's default
        # `Stream.null` (and `Stream.ptds`) is a single object for all devices, so the
        # same object on two GPUs is two streams.
        if theirs is not mine or other.physical != self.physical:
            event = other.record()
            with self._cuda_device:
                mine.wait_event(event)

    def wait_event(self, event) -> None:
        """Order this device's stream after `event` (None: nothing to wait for)."""
        if event is None:
            return
        with self._cuda_device:
            self.stream.wait_event(event)

    @property
    def on_current_stream(self) -> bool:
        """Slot 0 queues its work on CuPy's current stream of the GPU."""
        return self.slot == 0

    def enter(self, marks: dict | None = None) -> None:
        """Order this device's stream after the caller's work on CuPy's current stream
        (slot 0's stream is that stream). `marks`: the events of the current streams
        recorded so far for one call, by GPU, which the virtual GPUs of a GPU share."""
        if not self.slot:
            return
        with self._cuda_device:
            event = marks.get(self.physical) if marks is not None else None
            if event is None:
                event = ordering_event(self._cp.cuda.get_current_stream(self.physical))
                if marks is not None:
                    marks[self.physical] = event
            self.stream.wait_event(event)

    def leave(self) -> None:
        """Make CuPy's current stream of this GPU wait for the work queued here (slot 0's
        work is queued there already, once `stream` has made a current stream other than
        the one it last used wait for that one)."""
        if not self.slot:
            self.stream  # noqa: B018 (the property orders a new current stream)
            return
        event = self.record()
        current = self._cp.cuda.get_current_stream(self.physical)
        with self._cuda_device:
            current.wait_event(event)

    def empty(self, shape, dtype):
        # Allocated under this device's stream: CuPy's pool gives a freed block back
        # to the stream it was allocated on, so reuse stays ordered on that stream.
        with self._cuda_device, self.stream:
            return self._cp.empty(shape, dtype)

    def zeros(self, shape, dtype):
        with self._cuda_device, self.stream:
            out = self._cp.empty(shape, dtype)
            out.fill(0)
        return out

    def fill0(self, out) -> None:
        with self._cuda_device, self.stream:
            out.fill(0)

    def owns(self, array) -> bool:
        return isinstance(array, self._cp.ndarray) and array.device.id == self.physical

    def readable(self, array) -> bool:
        """Whether a kernel on this GPU can read `array` where it lies (never host memory:
        that is staged)."""
        if isinstance(array, np.ndarray):
            return False
        return peer_readable(self.physical, array)

    def to_host(self, array) -> np.ndarray:
        """`array` (NumPy, or a CuPy array) as a NumPy array: copied synchronously by its
        own GPU, on this device's stream when it lives here, else on CuPy's current
        stream of its GPU."""
        return to_numpy(array, self)

    @property
    def primary(self) -> CudaDevice:
        return cuda_device(self.physical, 0)

    # ------------------------------------------------------------------ work
    def sum_into(self, jobs) -> None:
        _sums.sum_into(self, jobs)

    def tree_sum_into(self, jobs) -> None:
        _sums.tree_sum_into(self, jobs)

    def copy_many(self, pairs) -> None:
        _sums.copy_many(self, pairs)

    def segment_sum(self, data, bounds):
        with self._cuda_device, self.stream:
            return _kernels.segment_sum_gpu(data, bounds)

    def optimizer_step(self, optimizer, items, hp: dict, body: str | None = None) -> None:
        """Update every key of `items` [(stored, grad, master, states, scalars)], all on
        this GPU with C-contiguous arrays and grads in the compute dtype, with one
        multi-tensor launch (LAMB: two) on this device's stream. `body`: the rule's CUDA
        body to run instead of its `cuda_body` (e.g. its row-sparse form)."""
        with self._cuda_device, self.stream:
            _optim_kernels.step(optimizer, self, items, hp, body=body)

    # ------------------------------------------------------ staging in main memory
    def host_buffer(self, shape, dtype) -> np.ndarray:
        """A page-locked NumPy array (host buffers of earlier copies that have completed
        are let go first)."""
        release_done()
        return empty_pinned(shape, dtype)

    def to_host_async(self, array) -> np.ndarray:
        """A pinned NumPy copy of `array` (on this GPU), queued on this device's stream."""
        host = self.host_buffer(array.shape, array.dtype)
        with self._cuda_device, self.stream:
            src = array if array.flags.c_contiguous else array.copy()
            src.get(stream=self.stream, out=host, blocking=False)
        return host

    def from_host_async(self, dst, host) -> None:
        """Copy pinned `host` into `dst` on this device's stream; `host` is kept alive
        until the copy has run."""
        with self._cuda_device:
            if dst.flags.c_contiguous and dst.dtype == host.dtype:
                dst.set(host, stream=self.stream)
            else:
                self.copy(dst, host)
        keep_alive(host, self.record())

    def copy(self, dst, src) -> None:
        cp = self._cp
        packed = None
        if (not isinstance(src, np.ndarray) and src.device.id != self.physical
                and not src.flags.c_contiguous):
            # A strided array on another GPU: packed there, by its own GPU, so that only
            # one contiguous peer memcpy crosses the link (no kernel here reads peer memory).
            src = packed = self._pack_on_owner(src)
        with self._cuda_device, self.stream:
            if isinstance(src, np.ndarray):
                if src.dtype == dst.dtype and src.flags.c_contiguous and dst.flags.c_contiguous:
                    dst.set(src, stream=self.stream)
                else:
                    dst[...] = cp.asarray(src).astype(dst.dtype, copy=False)
                return
            if (src.dtype == dst.dtype and src.flags.c_contiguous
                    and dst.flags.c_contiguous):
                # Peer or local: one async memcpy on this device's stream (UVA).
                if src.nbytes:
                    dst.data.copy_from_device_async(src.data, src.nbytes, self.stream)
            else:
                if src.device.id != self.physical:
                    staged = cp.empty(src.shape, src.dtype)
                    if src.nbytes:
                        staged.data.copy_from_device_async(src.data, src.nbytes, self.stream)
                    src = staged
                cp.copyto(dst, src, casting="unsafe")
            if packed is not None:
                # The packed copy was allocated on its GPU's stream: it goes back to that
                # stream's pool only after this device's memcpy has read it.
                keep_alive(packed, ordering_event(self.stream))

    def _pack_on_owner(self, src):
        """A C-contiguous copy of `src` made by its own GPU on that GPU's current stream,
        ordered after the work this device is ordered after, with this device's stream
        ordered after the copy."""
        cp = self._cp
        owner = src.device.id
        with self._cuda_device:
            ready = ordering_event(self.stream)  # whatever wrote src, this stream waited for
        stream = cp.cuda.get_current_stream(owner)
        with cp.cuda.Device(owner):
            stream.wait_event(ready)
            with stream:
                packed = cp.ascontiguousarray(src)
            done = ordering_event(stream)
        with self._cuda_device:
            self.stream.wait_event(done)
        return packed

    def synchronize(self) -> None:
        # Under this GPU: the default stream (handle 0) means the current device's one.
        with self._cuda_device:
            self.stream.synchronize()


@functools.cache
def cuda_device(physical: int, slot: int = 0) -> CudaDevice:
    """The shared CudaDevice for (physical, slot): one stream per virtual GPU."""
    return CudaDevice(physical, slot)


def gpu_devices() -> list[CudaDevice]:
    """The logical GPUs of this process: every visible GPU, or `GPUKV_VIRTUAL_GPUS` of them.

    With `GPUKV_VIRTUAL_GPUS=N`, N logical devices are dealt round-robin onto the
    physical GPUs, each with its own stream, so multi-device code runs on one GPU.
    """
    count = gpu_count()
    if count == 0:
        return []
    n = virtual_gpus() or count
    return [cuda_device(i % count, i // count) for i in range(n)]


def to_numpy(array, device=None) -> np.ndarray:
    """`array` (a CuPy array) copied into a new NumPy array, synchronously, by its own GPU.

    The copy runs on `device`'s stream when `device` is the logical GPU the array
    belongs to, else on CuPy's current stream of the array's GPU (not the current GPU's).
    """
    if isinstance(array, np.ndarray):
        return array
    if isinstance(device, CudaDevice) and device.physical == array.device.id:
        stream = device.stream
        with device.cuda_device:
            return array.get(stream=stream)
    cp = cupy_module()
    gpu = array.device.id
    with cp.cuda.Device(gpu):
        return array.get(stream=cp.cuda.get_current_stream(gpu))


def empty_pinned(shape, dtype) -> np.ndarray:
    """A new NumPy array in page-locked host memory (for asynchronous GPU copies)."""
    cupy_module()  # BackendError (how to install CuPy) when it is missing
    import cupyx
    return cupyx.empty_pinned(shape, dtype)


# ------------------------------------------------------------------ peer access
_peer_lock = threading.Lock()
_peer: dict = {}  # (reader, owner) physical ids -> whether reader can read owner's memory
_peer_logged: set = set()


def can_access_peer(reader: int, owner: int) -> bool:
    """Whether a kernel on GPU `reader` can read GPU `owner`'s memory (enabling it once).

    The same GPU always can. For two GPUs, peer access is asked of CUDA and enabled
    the first time a pair is seen; pairs without it are logged once, together.
    """
    if reader == owner:
        return True
    pair = (reader, owner)
    known = _peer.get(pair)
    if known is not None:
        return known
    with _peer_lock:
        known = _peer.get(pair)
        if known is not None:
            return known
        cp = cupy_module()
        runtime = cp.cuda.runtime
        ok = bool(runtime.deviceCanAccessPeer(reader, owner))
        if ok:
            try:
                with cp.cuda.Device(reader):
                    runtime.deviceEnablePeerAccess(owner)
            except runtime.CUDARuntimeError as exc:
                # cudaErrorPeerAccessAlreadyEnabled (704): CuPy or the caller did it first.
                if getattr(exc, "status", None) != 704:
                    log.warning("gpukv: enabling peer access GPU %d -> GPU %d failed: %s",
                                reader, owner, exc)
                    ok = False
        _peer[pair] = ok
        if not ok:
            _log_missing_peers()
        return ok


#: memory classes of CuPy's own cudaMalloc allocations (its default pool, or no pool),
#: which peer access alone makes readable from another GPU
_PLAIN_MEMORY = frozenset(["PooledMemory", "Memory"])


def peer_readable(reader: int, array) -> bool:
    """Whether a kernel on GPU `reader` can read the CuPy array `array` where it lies.

    Another GPU's memory needs peer access between the two GPUs. That is all CuPy's own
    cudaMalloc memory needs; other memory (a stream-ordered pool's, CuPy's
    MemoryAsyncPool; or adopted from another library, maybe a virtual-memory mapping such
    as PyTorch's expandable segments) also needs access granted by its pool or mapping,
    which the driver is asked about (`cuda_driver.pointer_access`). Without access the
    caller stages the data through a copy (cudaMemcpyPeer), which needs none.
    """
    owner = array.device.id
    if reader == owner:
        return True
    if not can_access_peer(reader, owner):
        return False
    if type(array.data.mem).__name__ in _PLAIN_MEMORY:
        return True
    with cupy_module().cuda.Device(reader):  # the driver answers for the current GPU
        flags = pointer_access(array.data.ptr)
    # No driver (None): nothing better to go on than peer access.
    return flags is None or flags != CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE


def _log_missing_peers() -> None:
    missing = sorted(p for p, ok in _peer.items() if not ok and p not in _peer_logged)
    if missing:
        _peer_logged.update(missing)
        pairs = ", ".join(f"{a}->{b}" for a, b in missing)
        log.info("gpukv: no peer access for GPU pairs %s; their data is copied through "
                 "a staging buffer on the reading GPU", pairs)


def enable_peer_access(physical_ids) -> dict:
    """Enable peer access among `physical_ids` once; {(reader, owner): bool} for every pair."""
    ids = sorted(set(physical_ids))
    return {(a, b): can_access_peer(a, b) for a, b in itertools.permutations(ids, 2)}


# ------------------------------------------------------------- deferred frees
#: page-locked host bytes kept for copies still in flight; past it, the host waits for
#: the oldest copies (a few large keys must not pin tens of GB)
PINNED_CAP = 256 << 20

_alive_lock = threading.Lock()
_alive: collections.deque = collections.deque()  # (event, buffer), oldest first
_held: dict = {}  # id of a kept host buffer -> [entries holding it]; counted once
_held_bytes = [0]  # bytes of the host buffers in `_held`


def keep_alive(obj, event) -> None:
    """Keep `obj` (a buffer) referenced until `event` has completed on the GPU.

    Buffers whose copies are done are let go at every call (oldest first); host buffers
    still in flight are capped at PINNED_CAP bytes (a buffer kept for several copies is
    counted once), past which the host waits for the oldest copies, outside the lock.
    """
    with _alive_lock:
        _alive.append((event, obj))
        _hold(obj)
        _release_done()
        waiting = []
        while len(_alive) > 1 and _held_bytes[0] > PINNED_CAP:
            waiting.append(_alive.popleft())
            _let_go(waiting[-1][1])
    for oldest, _ in waiting:  # the buffers stay referenced here until their copies ran
        oldest.synchronize()


def release_done() -> None:
    """Let go of the kept buffers whose copies have completed (oldest first)."""
    with _alive_lock:
        _release_done()


def _release_done() -> None:
    while _alive and _alive[0][0].done:
        _let_go(_alive.popleft()[1])


def _hold(obj) -> None:
    if isinstance(obj, np.ndarray):
        entry = _held.setdefault(id(obj), [obj, 0])
        if entry[1] == 0:
            _held_bytes[0] += obj.nbytes
        entry[1] += 1


def _let_go(obj) -> None:
    entry = _held.get(id(obj)) if isinstance(obj, np.ndarray) else None
    if entry is not None:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[id(obj)]
            _held_bytes[0] -= obj.nbytes
