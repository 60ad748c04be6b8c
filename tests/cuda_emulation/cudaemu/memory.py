"""Emulated device memory: host memory at real addresses, one registry of live allocations.

Every allocation is its own anonymous mapping. In guard mode (the default) its bytes end
exactly where an inaccessible page begins, another such page lies before it, and it
starts filled with all-ones bytes (NaN in every float type, -1 in every signed integer),
so a kernel that reads or writes past the end crashes at once (turned into an
illegal-address error by the kernel launcher) and a read of memory nobody wrote shows up
as NaN. The registry maps any address back to its allocation: CUDA array interface
adoption, NCCL buffers and fault messages all use it.

The classes mirror `cupy.cuda.memory`: `Memory`, `UnownedMemory`, `MemoryPointer`,
`PinnedMemory`, `PinnedMemoryPointer`.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import threading
import weakref

import numpy as np

from . import machine
from .errors import INVALID_VALUE, CUDARuntimeError

PAGE = mmap.PAGESIZE
POISON = 0xFF
ALIGN = 256  # cudaMalloc's alignment, used when guard pages are off

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0  # (the mmap module names only PROT_READ, PROT_WRITE and PROT_EXEC)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ------------------------------------------------------------------- the registry
# Allocations are unmapped by finalizers, which may run inside any allocation (garbage
# collection), even while this module holds its lock: so a finalizer only notes the
# free in `_dead`, and the registry takes note under its lock the next time it is used.
_lock = threading.Lock()
_starts: list = []          # sorted start addresses of live allocations
_live: dict = {}            # start address -> weakref to its Memory
_dead = collections.deque()  # (address, size, place) unmapped, not yet out of the registry
_freed = collections.deque(maxlen=256)  # (address, size, place) of recent frees
_used: collections.Counter = collections.Counter()  # place -> live bytes


def _forget_dead() -> None:
    """Take the allocations freed since the last call out of the registry (lock held)."""
    while _dead:
        ptr, size, place = _dead.popleft()
        ref = _live.get(ptr)
        if ref is not None and ref() is None:  # not a new allocation at the same address
            i = bisect.bisect_left(_starts, ptr)
            if i < len(_starts) and _starts[i] == ptr:
                del _starts[i]
            del _live[ptr]
        _used[place] -= size
        _freed.append((ptr, size, place))


def _register(mem) -> None:
    with _lock:
        _forget_dead()
        if mem.ptr not in _live:
            bisect.insort(_starts, mem.ptr)
        _live[mem.ptr] = weakref.ref(mem)
        _used[mem.place] += mem.size


def _live_memories() -> list:
    """Every live allocation (a snapshot)."""
    with _lock:
        _forget_dead()
        refs = list(_live.values())
    return [m for m in (ref() for ref in refs) if m is not None]


def find(ptr: int):
    """The live Memory whose bytes contain address `ptr`, or None."""
    with _lock:
        _forget_dead()
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        mem = _live[_starts[i]]()
    if mem is not None and mem.ptr <= ptr < mem.ptr + mem.size:
        return mem
    return None


def used_bytes(place) -> int:
    """Live bytes allocated on `place` (a GPU id, or "pinned")."""
    with _lock:
        _forget_dead()
        return _used[place]


def _where(place) -> str:
    return "pinned host memory" if place == "pinned" else f"GPU {place}"


def describe(ptr: int) -> str:
    """Where address `ptr` lies relative to the allocations, for fault messages: inside or
    near a live allocation, else inside or near a recently freed one."""
    spans = [(m.ptr, m.size, m.place) for m in _live_memories()]
    for state, candidates in (("", spans), ("freed ", list(_freed))):
        best = None
        for start, size, place in candidates:
            end = start + size
            if start <= ptr < end:
                return (f"0x{ptr:x}: byte {ptr - start} of a {state}{size}-byte allocation "
                        f"at 0x{start:x} on {_where(place)}")
            gap = ptr - end if ptr >= end else start - ptr
            if best is None or gap < best[0]:
                where = (f"byte {ptr - start} of" if ptr >= end
                         else f"{start - ptr} byte(s) before the start of")
                best = (gap, f"0x{ptr:x}: {where} a {state}{size}-byte allocation at "
                             f"0x{start:x} on {_where(place)} (out of bounds)")
        if best is not None and best[0] < PAGE:
            return best[1]
    return f"0x{ptr:x}: in no allocation"


def check_range(ptr: int, nbytes: int, what: str, place=None):
    """The Memory holding [ptr, ptr + nbytes) (on `place`, when given); CUDARuntimeError
    (invalid value) when no single live allocation holds it."""
    mem = find(ptr)
    if mem is None or ptr + nbytes > mem.ptr + mem.size:
        raise CUDARuntimeError(INVALID_VALUE, f"{what}: {nbytes} bytes at {describe(ptr)}")
    if place is not None and mem.place != place:
        raise CUDARuntimeError(INVALID_VALUE, f"{what}: memory of {_where(mem.place)}, "
                                              f"expected {_where(place)}")
    return mem


def check_host_range(ptr: int, nbytes: int, what: str) -> None:
    """A host address range must not be device memory (a host/device mix-up)."""
    mem = find(ptr)
    if mem is not None and mem.place != "pinned":
        raise CUDARuntimeError(INVALID_VALUE, f"{what}: a host pointer was expected, got "
                                              f"device memory at {describe(ptr)}")


# ---------------------------------------------------------------- allocations
def _map(length: int) -> int:
    base = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        raise CUDARuntimeError(2, f"mmap of {length} bytes failed "
                                  f"(errno {ctypes.get_errno()})")
    return base


#: allocations the host let go of, not yet unmapped: (base, length, ptr, size, place,
#: info); streams.settle_frees unmaps them in stream order
frees: collections.deque = collections.deque()


def _release(base: int, length: int, ptr: int, size: int, place, info: dict) -> None:
    frees.append((base, length, ptr, size, place, info))  # (a finalizer takes no lock)


def unmap(base: int, length: int, ptr: int, size: int, place) -> None:
    _libc.munmap(base, length)
    _dead.append((ptr, size, place))  # the registry forgets it at its next use


class BaseMemory:
    """Memory at `ptr` of `size` bytes on GPU `device_id` (CuPy's BaseMemory)."""

    ptr: int
    size: int
    device_id: int

    @property
    def place(self):
        return self.device_id

    def __int__(self):
        return self.ptr


class AccessDomain:
    """What grants other GPUs access to some memory: a stream-ordered pool
    (cudaMemPoolSetAccess) or a virtual-memory mapping (cuMemSetAccess). Plain
    allocations have none: peer access between the GPUs is what counts for them."""

    def __init__(self, kind: str):
        self.kind = kind
        self.readers: set = set()

    def grant(self, reader: int) -> None:
        self.readers.add(int(reader))


class Memory(BaseMemory):
    """One allocation of `size` bytes on GPU `device_id` (pinned host memory when
    `device_id` is None): guarded and poisoned in guard mode. `domain` is the pool or
    mapping it belongs to, if any."""

    def __init__(self, size: int, device_id: int | None, domain: AccessDomain | None = None):
        self.size = int(size)
        self.device_id = device_id
        self.domain = domain
        self.ptr = 0
        self.pages = (0, 0)  # the pages holding its bytes: (start, length)
        # what the race checker keeps (races.py), and the stream whose pool it returns to
        self.info: dict = {"ptr": 0, "size": self.size, "place": self.place,
                           "accesses": [], "lane": None}
        if self.size == 0:  # CuPy hands out a null pointer for empty arrays
            return
        if machine.MACHINE.guard:
            body = _round_up(self.size, PAGE)
            length = body + 2 * PAGE
            base = _map(length)
            _libc.mprotect(base, PAGE, _PROT_NONE)
            _libc.mprotect(base + PAGE + body, PAGE, _PROT_NONE)
            ctypes.memset(base + PAGE, POISON, body)
            self.ptr = base + PAGE + body - self.size
            self.pages = (base + PAGE, body)
        else:
            length = _round_up(self.size, PAGE)
            base = _map(length)
            self.ptr = base
            self.pages = (base, length)
        self.info["ptr"] = self.ptr
        _register(self)
        weakref.finalize(self, _release, base, length, self.ptr, self.size, self.place,
                         self.info)

    @property
    def place(self):
        return "pinned" if self.device_id is None else self.device_id


class UnownedMemory(BaseMemory):
    """Memory someone else owns (CuPy's UnownedMemory); `owner` is kept alive."""

    def __init__(self, ptr: int, size: int, owner, device_id: int | None = None):
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        if device_id is None:
            mem = find(self.ptr)
            if mem is None or mem.device_id is None:
                raise CUDARuntimeError(INVALID_VALUE, f"UnownedMemory: {describe(self.ptr)}")
            device_id = mem.device_id
        self.device_id = device_id


def host_bytes(ptr: int, nbytes: int, keep) -> np.ndarray:
    """A writable uint8 view of `nbytes` at `ptr` that keeps `keep` alive."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    buffer = (ctypes.c_char * nbytes).from_address(ptr)
    buffer.owner = keep  # the view -> buffer -> owner chain keeps the memory mapped
    return np.frombuffer(buffer, np.uint8)


class MemoryPointer:
    """A pointer into device memory: `mem` plus a byte `offset` (CuPy's MemoryPointer)."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem: BaseMemory, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + int(offset)
        self.device_id = mem.device_id

    def __int__(self):
        return self.ptr

    def __add__(self, offset: int):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    def __sub__(self, offset: int):
        return self + (-int(offset))

    def __bool__(self):
        return self.ptr != 0

    @property
    def device(self):
        from .runtime import Device
        return Device(self.device_id)

    # Copies are queued on their stream (the current one when None); a synchronous one
    # then waits for it. Host memory is read or written when the copy runs when it is
    # pinned, at once when it is pageable (the driver stages pageable memory).
    def copy_from_device_async(self, src, size: int, stream=None) -> None:
        size = int(size)
        if size <= 0:
            return
        source = _device_address(src)
        dst, src_mem = self.ptr, check_range(source, size, "memcpy source")
        dst_mem = check_range(dst, size, "memcpy destination")
        _queue(stream, lambda: ctypes.memmove(dst, source, size), "memcpy device to device",
               ((source, size, False), (dst, size, True)), (dst_mem, src_mem))

    def copy_from_device(self, src, size: int) -> None:
        self.copy_from_device_async(src, size)
        _wait_current()

    def copy_from_host_async(self, mem, size: int, stream=None) -> None:
        size = int(size)
        if size <= 0:
            return
        source = _host_address(mem)
        dst, dst_mem = self.ptr, check_range(self.ptr, size, "memcpy destination")
        check_host_range(source, size, "memcpy source")
        pinned = find(source)
        if pinned is None:
            data = ctypes.string_at(source, size)
            _queue(stream, lambda: ctypes.memmove(dst, data, size), "memcpy host to device",
                   ((dst, size, True),), dst_mem)
            return
        issued = ctypes.string_at(source, size) if size <= SHADOW_BYTES else None
        if issued is not None:  # what the race checker reads a pointer table from
            shadow[dst] = issued
        from . import races
        where = races.site() if issued is not None and races.ENABLED else ""
        written = pinned.info.get("device_writes", 0)  # copies from a GPU into it so far

        def run():
            ctypes.memmove(dst, source, size)
            if issued is not None and shadow.get(dst) is issued:
                del shadow[dst]
            if (where and pinned.info.get("device_writes", 0) == written
                    and ctypes.string_at(dst, size) != issued):
                races.host_overwrote(pinned.info, source, size, where)

        _queue(stream, run, "memcpy host to device",
               ((source, size, False), (dst, size, True)), (dst_mem, pinned))

    def copy_from_host(self, mem, size: int) -> None:
        self.copy_from_host_async(mem, size)
        _wait_current()

    def copy_to_host_async(self, mem, size: int, stream=None) -> None:
        size = int(size)
        if size <= 0:
            return
        target = _host_address(mem)
        src, src_mem = self.ptr, check_range(self.ptr, size, "memcpy source")
        check_host_range(target, size, "memcpy destination")
        pinned = find(target)

        def run():
            ctypes.memmove(target, src, size)
            if pinned is not None:
                device_wrote(pinned)

        _queue(stream, run, "memcpy device to host",
               ((src, size, False), (target, size, True)), (src_mem, pinned),
               wait=pinned is None)

    def copy_to_host(self, mem, size: int) -> None:
        self.copy_to_host_async(mem, size)
        _wait_current()

    def copy_from_async(self, mem, size: int, stream=None) -> None:
        if isinstance(mem, MemoryPointer):
            self.copy_from_device_async(mem, size, stream)
        else:
            self.copy_from_host_async(mem, size, stream)

    def copy_from(self, mem, size: int) -> None:
        self.copy_from_async(mem, size)
        _wait_current()

    def memset_async(self, value: int, size: int, stream=None) -> None:
        size = int(size)
        if size > 0:
            dst, mem = self.ptr, check_range(self.ptr, size, "memset")
            value = int(value)
            _queue(stream, lambda: ctypes.memset(dst, value, size), "memset",
                   ((dst, size, True),), mem)

    def memset(self, value: int, size: int) -> None:
        self.memset_async(value, size)
        _wait_current()


#: device address -> the bytes a queued copy from pinned memory will write there (small
#: copies only: pointer tables), for kernel_access to read a table before the copy runs
shadow: dict = {}
SHADOW_BYTES = 1 << 20


def device_wrote(pinned) -> None:
    """A copy from a GPU wrote into `pinned` (so its bytes changed, not by the host)."""
    pinned.info["device_writes"] = pinned.info.get("device_writes", 0) + 1


def _queue(stream, fn, label: str, ranges, keep, *, wait: bool = False) -> None:
    """Queue `fn` on `stream` (None: the current stream), touching `ranges` [(ptr,
    nbytes, write)]; `wait`: the host waits for it (a copy into pageable memory)."""
    from . import runtime, streams
    lane = runtime.lane_of(stream)
    accesses = [(lane, p, n, w, find(p)) for p, n, w in ranges]
    streams.issue(lane, fn, label, accesses=accesses, keep=keep)
    if wait:
        streams.synchronize(lane)


def _wait_current() -> None:
    """A synchronous copy: the host waits for the current stream."""
    from . import runtime, streams
    streams.synchronize(runtime.lane_of())


def _device_address(src) -> int:
    """A device source as CuPy takes one: a MemoryPointer only."""
    if not isinstance(src, MemoryPointer):
        raise TypeError(f"Argument 'src' has incorrect type (expected cupy.cuda.memory."
                        f"MemoryPointer, got {type(src).__name__})")
    return src.ptr


def _host_address(mem) -> int:
    """A host address as CuPy takes one: a Python int, or an object with `.value` (a
    ctypes pointer); NumPy arrays, MemoryPointers and pinned pointers are refused."""
    if type(mem) is int:
        return mem
    if not hasattr(mem, "value"):
        raise AttributeError(f"'{type(mem).__name__}' object has no attribute 'value'")
    return int(mem.value or 0)


def alloc(size: int, device_id: int) -> MemoryPointer:
    """`size` bytes on GPU `device_id`, from the allocator set by `set_allocator` if any
    (it allocates on the current device, which the caller has made `device_id`)."""
    allocator = _allocator.get("malloc")
    if allocator is not None:
        return allocator(size)
    return MemoryPointer(Memory(size, device_id), 0)


_allocator: dict = {}


def set_allocator(allocator=None) -> None:
    """`cupy.cuda.set_allocator`: `allocator(size) -> MemoryPointer`, or None for the
    default one."""
    if allocator is None:
        _allocator.pop("malloc", None)
    else:
        _allocator["malloc"] = allocator


class using_allocator:  # noqa: N801 - CuPy's name
    """`cupy.cuda.using_allocator(allocator)`: the allocator of this block, then the
    previous one again."""

    def __init__(self, allocator=None):
        self.allocator = allocator

    def __enter__(self):
        self.previous = _allocator.get("malloc")
        set_allocator(self.allocator)

    def __exit__(self, *exc):
        set_allocator(self.previous)
        return False


def get_allocator():
    return _allocator.get("malloc") or (lambda size: alloc(size, _current_device()))


def _current_device() -> int:
    from .runtime import current_device
    return current_device()


class MemoryPool:
    """`cupy.cuda.MemoryPool` (the default pool): nothing is pooled here, every block is
    its own guarded mapping, and the byte counts are the live ones."""

    def __init__(self, allocator=None, *, pinned: bool = False):
        self._place = "pinned" if pinned else None

    def used_bytes(self) -> int:
        return used_bytes(self._place or _current_device())

    total_bytes = used_bytes

    def free_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        pass

    def n_free_blocks(self) -> int:
        return 0

    def set_limit(self, size=None, fraction=None) -> None:
        pass

    def get_limit(self) -> int:
        return 0


class MemoryAsyncPool(MemoryPool):
    """`cupy.cuda.MemoryAsyncPool`: stream-ordered allocations (cudaMallocAsync), from one
    pool per GPU whose memory other GPUs reach only once the pool grants them access."""

    def __init__(self, pool_handles="current"):
        super().__init__()
        self.pools: dict = {}  # GPU -> its AccessDomain

    def pool(self, device_id: int) -> AccessDomain:
        return self.pools.setdefault(device_id, AccessDomain("pool"))

    def malloc(self, size: int) -> MemoryPointer:
        device = _current_device()
        return MemoryPointer(MemoryAsync(size, device, self.pool(device)), 0)


class MemoryAsync(Memory):
    """An allocation of a stream-ordered pool (CuPy's class of that name)."""


def mapped_alloc(size: int, device_id: int) -> MemoryPointer:
    """`size` bytes of a virtual-memory mapping on GPU `device_id` (as cuMemCreate and
    cuMemMap make them, e.g. PyTorch's expandable segments), as CuPy sees such memory:
    an UnownedMemory. Other GPUs reach it only once the mapping grants access
    (`mapping_of(memptr).grant(reader)`)."""
    mapping = Memory(size, device_id, AccessDomain("mapping"))
    return MemoryPointer(UnownedMemory(mapping.ptr, size, mapping, device_id), 0)


def mapping_of(memptr: MemoryPointer) -> AccessDomain:
    """The pool or mapping the memory at `memptr` belongs to (None: plain memory)."""
    return getattr(find(memptr.ptr), "domain", None)


#: `CUmemAccess_flags`
ACCESS_NONE, ACCESS_READWRITE = 0, 3


def access_flags(reader: int, mem: BaseMemory) -> int:
    """The access GPU `reader` has to `mem`, as cuPointerGetAttribute(ACCESS_FLAGS) says."""
    owner = mem.device_id
    if owner is None or owner == reader:
        return ACCESS_READWRITE
    domain = getattr(find(mem.ptr) or mem, "domain", None)  # an UnownedMemory: its owner's
    if domain is not None:
        return ACCESS_READWRITE if reader in domain.readers else ACCESS_NONE
    from .runtime import peer_enabled
    return ACCESS_READWRITE if peer_enabled(reader, owner) else ACCESS_NONE


class kernel_access:  # noqa: N801 - used as a context manager
    """Around a kernel launched on the current GPU: the pages of pool and mapping memory
    that GPU may not access are made inaccessible, so a kernel reading them faults as it
    would on the GPU (plain memory keeps its pages: checking peer access for every
    allocation at every launch would cost too much)."""

    def __enter__(self):
        reader = _current_device()
        self.hidden = [m.pages for m in _live_memories() if m.size
                       and getattr(m, "domain", None) is not None
                       and access_flags(reader, m) == ACCESS_NONE]
        for start, length in self.hidden:
            _libc.mprotect(start, length, _PROT_NONE)
        return self

    def __exit__(self, *exc):
        for start, length in self.hidden:
            _libc.mprotect(start, length, mmap.PROT_READ | mmap.PROT_WRITE)
        return False


# ------------------------------------------------------------------ pinned memory
class PinnedMemory(Memory):
    """Page-locked host memory (emulated: a guarded host mapping)."""

    def __init__(self, size: int):
        super().__init__(size, None)


_EMPTY = PinnedMemory(1)  # what a zero-byte pinned pointer points at


def _pinned_pointer(mem: PinnedMemory):
    """CuPy's PinnedMemoryPointer: `ptr`, `size`, `mem`, and the buffer protocol (so
    `numpy.ndarray(shape, dtype, buffer=p)` works), here a ctypes array at the address."""
    pointer = (ctypes.c_char * max(mem.size, 1)).from_address(mem.ptr or _EMPTY.ptr)
    pointer.mem, pointer.ptr = mem, mem.ptr
    pointer.size = lambda: mem.size  # a method in CuPy
    return pointer


def alloc_pinned_memory(size: int):
    """`size` bytes of (emulated) page-locked host memory."""
    return _pinned_pointer(PinnedMemory(size))
