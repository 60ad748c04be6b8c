"""The front end of `dist_sync`, `dist_async` and `dist_device_sync`: the same calls as
`KVStore`, across the processes of an MPI job.

Each process keeps two local stores: `_grads`, where the values its devices push are summed
(on the host, or on its GPUs for `dist_device_sync`), and `_values`, its copy of every key,
which pulls read. Between them sits the engine of `gpukv.distributed`: a sharded sync round when
every process serves (`num_servers=0`), or requests to dedicated server processes. Every
call is checked here, whole, before any message leaves the process.
"""
from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import secrets
import sys
import traceback
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .. import timeline
from .._env import positive_int, refuse_malformed, restart_note
from .._errors import (
    ArgumentError,
    ArgumentKindError,
    BackendError,
    CheckpointError,
    GpukvError,
    PeerError,
)
from ..canonical.tree import rank_nodes
from ..device import host_device
from ..device.host_sum import accumulate_dtype, share_cpus
from ..encoding.compressors import compresses_key
from ..store import check
from ..store import settings as store_settings
from ..store.base import KVStore
from ..store.local import LocalStore, deterministic_option
from ..store.pipeline import cast_to_keys
from .call_lock import CallLock
from .engines.protocol import Leaves, Partials
from .mpi import job_exit
from .mpi.chunks import chosen_chunk_bytes
from .parts import SavedState, Shard, leaf_values, node_sums, pinned_store, share_of
from .snapshots_at_exit import ExitPrune

if TYPE_CHECKING:
    from ..optim import Optimizer
    from . import Engine

log = logging.getLogger("gpukv")

#: seconds a process waits for the others before it calls them stalled
DEFAULT_TIMEOUT = 120.0


#: message tags of the agreements of `create` (away from those of the stores' own calls)
_CREATE_TAGS = 1000


class _ThisProcess:
    """What every dist store of this process must know of the others: facts of the MPI
    job, which outlives any store (its ranks, and the servers a job runs only once)."""

    def __init__(self) -> None:
        self.made = 0              # dist stores made (every process makes each, in order)
        self.served: str | None = None  # the store whose dedicated servers the job runs


_PROCESS = _ThisProcess()


def _serve_or_client(transport, servers: int, bound: int, name: str,
                     deterministic: bool) -> Engine:
    """On a server rank: serve the workers, then end the process (as MXNet's servers do;
    a failure of the server itself aborts the job rather than run the program on). On a
    worker: its end of the servers."""
    from .engines.client import ServerClient
    from .engines.server import serve
    asynchronous = name == "dist_async"
    if transport.rank < servers:
        try:
            serve(transport, servers, Shard(deterministic), asynchronous=asynchronous)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            transport.comm.Abort(1)
        sys.exit(0)
    return ServerClient(transport, servers, bound, deterministic=deterministic,
                        asynchronous=asynchronous)


def _refuse_together(world, name: str, refused: GpukvError) -> NoReturn:
    """This process refused its options (a malformed environment variable of its own):
    the others hear it at once, in the agreement on the store they wait in, each with a
    PeerMismatchError naming the refusal, rather than after their timeout; then raise
    `refused` here (every process refusing alike: each its own error)."""
    from .mpi.agree import Agreement, Setting
    from .mpi.transport import Transport
    if _PROCESS.served is not None:  # the job's servers serve: they make no more stores
        raise refused
    transport = Transport(world, DEFAULT_TIMEOUT)
    try:
        with transport.caused_by(refused):  # (the launcher names `refused`, the cause)
            Agreement(transport, tags=_CREATE_TAGS, collective=False).check(
                ("create", (Setting("type", name),
                            Setting("refused", f"{type(refused).__name__}: {refused}"))),
                f"gpukv.create({name!r})")
    except PeerError:
        pass
    raise refused


def _nccl_gpu(name: str, servers: int, nccl: bool | None, local_rank: int):
    """The GPU a dist_device_sync store with num_servers=0 joins NCCL with: None for the
    host path (another store, nccl=False, or no GPU or NCCL when nccl is None)."""
    if nccl is False or name != "dist_device_sync" or servers:
        if nccl:
            raise ArgumentError(f"nccl=True: NCCL carries a dist_device_sync store's data "
                                f"between processes with num_servers=0; this is {name!r} "
                                f"with num_servers={servers}")
        return None
    from .engines.nccl_rounds import nccl_device
    gpu = nccl_device(local_rank)
    if gpu is None and nccl:
        raise BackendError("nccl=True: this process sees no GPU, or CuPy finds no NCCL "
                           "(pip install 'nvidia-nccl-cu12>=2.18', or nvidia-nccl-cu13 "
                           "with cupy-cuda13x)")
    return gpu


def _first_rank_of(MPI, local_comm, comm) -> int:
    """The rank in `comm` of `local_comm`'s first process (no message: a lookup)."""
    local_group, group = local_comm.Get_group(), comm.Get_group()
    try:
        return int(MPI.Group.Translate_ranks(local_group, [0], group)[0])
    finally:
        local_group.Free()
        group.Free()


def _free_communicator(MPI, comm, transport) -> None:
    """Free a dropped store's communicator, unless the job's end waits on it (the first
    store's), its transport failed (the job aborts at exit) or MPI is done. Freeing is
    local to the process: the others free theirs when they drop their store."""
    if transport.failure is not None or job_exit.waits_on(comm) or MPI.Is_finalized():
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass  # a peer gone meanwhile: MPI_Finalize, or the abort, takes it


#: bytes of a PCI bus id in `_own_gpu`'s records ("0000:3b:00.0" needs 12)
_BUS_BYTES = 64


def _own_gpu(agreement, machine: int, gpu, nccl: bool | None, name: str):
    """`gpu` where no other process of this machine joins NCCL with the same one, else
    None (the host path): NCCL refuses two ranks on one GPU. Every process of the store
    says which machine it is on (`machine`: the job rank of that machine's first process)
    and its GPU's PCI bus id, in one collective checked and bounded like the store's
    others (a process that does not come is named on every rank)."""
    t = agreement.t
    bus = gpu.cuda_device.pci_bus_id if gpu is not None else ""
    record = np.zeros(8 + _BUS_BYTES, np.uint8)
    record[:8].view(np.int64)[0] = machine
    encoded = bus.encode()[:_BUS_BYTES]
    record[8:8 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    everyone = np.empty((t.size, record.size), np.uint8)
    what = f"gpukv.create({name!r}): the GPUs of each machine's processes"
    requests = agreement.check(("gpus", _BUS_BYTES), what,
                               alongside=lambda: [t.comm.Iallgather(record, everyone)])
    agreement.wait(requests, what)
    sharing = sum(1 for row in everyone
                  if row[:8].view(np.int64)[0] == machine and bytes(row[8:]) == bytes(record[8:]))
    if gpu is None or sharing == 1:
        return gpu
    if nccl:
        raise BackendError(f"nccl=True: {sharing} processes of this machine would "
                           f"join NCCL on its GPU {bus}, which NCCL refuses: start at most "
                           f"one process per GPU, or leave nccl unset (the host path)")
    return None


def _options(name: str, num_servers, timeout, bigarray_bound, size: int) -> tuple:
    """(servers, timeout, bound, chunk bytes or None) from the options or their
    environment variables, each checked (as is everything `create` is given) before any
    message is sent."""
    from ..layout.pieces import DEFAULT_BIGARRAY_BOUND
    servers_from_env = num_servers is None
    if servers_from_env:
        num_servers = env_num_servers() or 0
    if isinstance(num_servers, (bool, np.bool_)) or not isinstance(num_servers,
                                                                   numbers.Integral):
        raise ArgumentKindError(f"num_servers: expected an int, got "
                                f"{type(num_servers).__name__}")
    num_servers = int(num_servers)
    if not 0 <= num_servers < size:
        given = (f"GPUKV_NUM_SERVERS='{num_servers}'" if servers_from_env
                 else f"num_servers={num_servers}")
        raise ArgumentError(f"{given}: expected 0 (every process serves) up to "
                            f"{size - 1}, so that a worker is left among the {size} "
                            f"processes of this MPI job")
    if name == "dist_async" and num_servers == 0:
        raise ArgumentError("dist_async applies each push as it arrives, which needs "
                            "dedicated servers: pass num_servers >= 1 (or set "
                            "GPUKV_NUM_SERVERS)")
    if timeout is None:
        timeout = env_timeout() or DEFAULT_TIMEOUT
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real):
        raise ArgumentKindError(f"timeout: expected seconds (a number), got "
                                f"{type(timeout).__name__}")
    timeout = float(timeout)
    if not 0 < timeout < math.inf:  # every wait is bounded: by a finite time
        raise ArgumentError(f"timeout={timeout!r}: expected finite seconds > 0")
    if bigarray_bound is None:
        bigarray_bound = env_bigarray_bound() or DEFAULT_BIGARRAY_BOUND
    if isinstance(bigarray_bound, (bool, np.bool_)) or not isinstance(bigarray_bound,
                                                                      numbers.Integral):
        raise ArgumentKindError(f"bigarray_bound: expected an int (elements), got "
                                f"{type(bigarray_bound).__name__}")
    if bigarray_bound < 1:
        raise ArgumentError(f"bigarray_bound={int(bigarray_bound)}: expected a positive int "
                            f"(elements)")
    return num_servers, timeout, int(bigarray_bound), chosen_chunk_bytes()


def env_num_servers() -> int | None:
    """GPUKV_NUM_SERVERS as an int >= 0, None when unset or blank (whether the job has
    enough processes for it is checked by `create`)."""
    raw = os.environ.get("GPUKV_NUM_SERVERS", "").strip()
    try:
        servers = int(raw) if raw else None
    except ValueError:
        servers = -1
    if servers is not None and servers < 0:
        raise ArgumentError(f"GPUKV_NUM_SERVERS={raw!r}: expected an integer >= 0")
    return servers


def env_timeout() -> float | None:
    """GPUKV_DIST_TIMEOUT as finite seconds > 0, None when unset or blank."""
    raw = os.environ.get("GPUKV_DIST_TIMEOUT", "").strip()
    if not raw:
        return None
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < math.inf:
        raise ArgumentError(f"GPUKV_DIST_TIMEOUT={raw!r}: expected finite seconds > 0")
    return timeout


def env_bigarray_bound() -> int | None:
    """GPUKV_BIGARRAY_BOUND as a positive int (elements), else MXNet's
    MXNET_KVSTORE_BIGARRAY_BOUND; None when neither is set."""
    return (positive_int("GPUKV_BIGARRAY_BOUND")
            or positive_int("MXNET_KVSTORE_BIGARRAY_BOUND"))


#: the `create` option that wins over each variable: given, the variable is not read
OPTIONS = {"GPUKV_NUM_SERVERS": "num_servers", "GPUKV_DIST_TIMEOUT": "timeout",
           "GPUKV_BIGARRAY_BOUND": "bigarray_bound"}


def setting_checks(given: Collection[str] = ()) -> dict[str, Callable[[], object]]:
    """{variable: a call that reads it, raising its typed error when it is malformed}: the
    settings of a dist store beyond every store's (gpukv.store.settings), less those
    whose option (OPTIONS) is among the `given` options of `create`."""
    checks: dict[str, Callable[[], object]] = {
        "GPUKV_NUM_SERVERS": env_num_servers, "GPUKV_DIST_TIMEOUT": env_timeout,
        "GPUKV_BIGARRAY_BOUND": env_bigarray_bound,
        "GPUKV_DIST_CHUNK_BYTES": chosen_chunk_bytes}
    return {name: check for name, check in checks.items() if OPTIONS.get(name) not in given}


def _sum_buffer(value) -> np.ndarray:
    """What a key's sums over one process's devices start from: zeros of its shape, in
    the dtype its sums are made in (on the host: the store copies it where it sums)."""
    return np.zeros(value.shape, accumulate_dtype(value.dtype))


def _attempt(action, keep: bool = False):
    """Run `action()`: its CheckpointError (to share with the other workers), else None
    (or, with `keep`, what it returned)."""
    try:
        result = action()
    except CheckpointError as exc:
        return exc
    return result if keep else None


def _checked(found, check):
    """`found` (a snapshot or None), once `check(found)` passed."""
    if found is not None and check is not None:
        check(found)
    return found


def _raise(outcome):
    """Raise a shared CheckpointError again, here; otherwise return `outcome`."""
    if isinstance(outcome, CheckpointError):
        raise CheckpointError(str(outcome))
    return outcome


class DistKVStore(KVStore):
    """A store shared by the processes of an MPI job (see `gpukv.create`).

    A `KVStore`, as the one-process `LocalStore` is, and none of its machinery: its keys
    live in two one-process stores (this process's copies of the values, and its local
    sums), driven through LocalStore's surface for it, and in its `Engine`.
    """

    def __init__(self, name: str, *, num_servers: int | None = None,
                 timeout: float | None = None, bigarray_bound: int | None = None,
                 nccl: bool | None = None, deterministic: bool | None = None,
                 **local_options):
        from .mpi.agree import Agreement, Setting
        from .mpi.transport import TAG_EXIT, Transport, mpi
        MPI = mpi()
        world = MPI.COMM_WORLD
        try:
            given = store_settings.given({
                **local_options, "num_servers": num_servers, "timeout": timeout,
                "bigarray_bound": bigarray_bound, "deterministic": deterministic})
            on_gpu = name == "dist_device_sync"  # (whose keys a 'device' store holds)
            tree = (store_settings.tree_checks(local_options.get("strategy"), given)
                    if on_gpu else {})
            refuse_malformed({**store_settings.setting_checks(given, on_gpu), **tree,
                              **setting_checks(given)})
            servers, timeout, bound, chunk = _options(name, num_servers, timeout,
                                                      bigarray_bound, world.Get_size())
            if nccl is not None and not isinstance(nccl, bool):
                raise ArgumentKindError(f"nccl: expected True, False or None, got "
                                        f"{type(nccl).__name__}")
            deterministic = deterministic_option(deterministic)
            if deterministic and nccl:
                raise ArgumentError("nccl=True with deterministic=True: NCCL's sums have "
                                    "no fixed order; a deterministic store sums between "
                                    "processes through MPI (leave nccl unset)")
            if servers and _PROCESS.served is not None:
                raise ArgumentError(f"{name!r} with num_servers={servers}: the servers of "
                                    f"this job serve one store, made already; make one "
                                    f"store with dedicated servers per job (num_servers=0 "
                                    f"allows several)")
        except GpukvError as exc:
            _refuse_together(world, name, exc)
        # Every process makes the same store, or each hears who did not, before any
        # collective call that would wait for them without a bound.
        Agreement(Transport(world, timeout), tags=_CREATE_TAGS, collective=False).check(
            ("create", (Setting("type", name), Setting("num_servers", servers),
                        Setting("bigarray_bound", bound), Setting("timeout", timeout),
                        Setting("deterministic", deterministic),
                        Setting("stores made before", _PROCESS.made),
                        Setting("GPUKV_DIST_CHUNK_BYTES", "unset" if chunk is None else chunk))),
            f"gpukv.create({name!r})")
        _PROCESS.made += 1
        comm = world.Dup()  # its own messages: the program's MPI traffic stays apart
        job_exit.end_together(comm, TAG_EXIT, timeout)
        local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_size, local_rank = local_comm.Get_size(), local_comm.Get_rank()
        machine = _first_rank_of(MPI, local_comm, comm)
        local_comm.Free()
        # The ranks on this machine share its CPUs: each sums and copies with its share.
        share_cpus(local_size)
        transport = Transport(comm, timeout, local_size, chunk)
        if not servers:  # a store dropped gives its communicator back (MPI has a few
            # thousand); dedicated servers (one store per job) are stopped on it at exit
            weakref.finalize(self, _free_communicator, MPI, comm, transport).atexit = False
        agreement = Agreement(transport, tags=_CREATE_TAGS)
        gpu = None if deterministic else _nccl_gpu(name, servers, nccl, local_rank)
        gpu = _own_gpu(agreement, machine, gpu, nccl, name)
        agreement.check(("engine", ("nccl" if gpu is not None else "host",)),
                        f"gpukv.create({name!r}): the path across processes")
        local = "device" if name == "dist_device_sync" else "local"
        self._type = name
        self._num_servers = servers
        self._lock = CallLock()
        #: where the engine reads the sums and writes the values: the host, or this
        #: process's GPU with NCCL (every key then lives there)
        self._engine_device = gpu if gpu is not None else host_device(0)
        self._engine: Engine
        if servers == 0:  # NCCL's rounds when `gpu` is one
            from .engines import sharded
            shard = Shard(deterministic)
            shard.run_optimizers_for(self)  # (the optimizer it runs is this store's)
            self._engine = sharded.ShardedRounds(
                transport, shard, bound, deterministic=deterministic, device=gpu)
        else:
            _PROCESS.served = name
            self._engine = _serve_or_client(transport, servers, bound, name, deterministic)
        self._values = pinned_store(local, gpu, deterministic=deterministic, **local_options)
        self._grads = pinned_store(local, gpu, deterministic=deterministic, **local_options)
        self._values.speak_as(name)  # (what the parts have to say is the dist store's)
        self._grads.speak_as(None)
        #: the canonical order (gpukv.canonical) for every sum, here and between processes
        self._deterministic = deterministic
        self._partials: dict = {}  # key -> this process's node sums (deterministic)
        self._leaves: dict = {}  # key -> its values as float32 leaves (compressed, too)
        #: whether the engine works in `_values`' own arrays (else in host copies)
        self._in_place = local == "local" or gpu is not None
        self._host: dict = {}  # key -> this process's host copy of its value
        self._has_optimizer = False  # whether set_optimizer was called
        self._has_updater = False  # whether set_updater was called
        self._optimizer_followed: Any = None  # the optimizer set_optimizer was given
        self._checker: Any = None  # an OptimizerUpdater of it, to check pushes with
        self._stale: list = []  # keys whose device copies wait for rank 0's value
        self._writer: Any = None  # writes this worker's snapshot files, once made
        self._tag: str | None = None  # the folder tag of this store's snapshots
        self._runs: dict = {}  # root -> the run this store's snapshots there count as
        self._last_step = 0  # the step of its last snapshot, or of the one it resumed from
        self._replicated: list = []  # the stores snapshot(replicated=) wrote shares of
        #: the folders of the snapshots taken since the last finish_snapshots, to prune
        self._pruning = ExitPrune(self._engine.control, timeout)
        engine = type(self._engine).__name__
        if gpu is not None:
            engine += " (NCCL)"
        note = restart_note()
        log.info("gpukv %r store made: worker %d of %d, %d server(s), engine %s%s%s",
                 name, self.rank, self.num_workers, servers, engine,
                 ", deterministic" if deterministic else "", f", {note}" if note else "")

    # ----------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        """This worker's index among the workers (servers excluded), as in MXNet."""
        return self._engine.control.rank

    @property
    def num_workers(self) -> int:
        return self._engine.control.num_workers

    @property
    def num_servers(self) -> int:
        """Dedicated server processes (0: every process serves a shard)."""
        return self._num_servers

    @property
    def strategy(self) -> str:
        return self._values.strategy

    @property
    def deterministic(self) -> bool:
        """Whether every sum follows the canonical order: the same bits for any strategy,
        split of devices over processes, number of servers or bucketing."""
        return self._deterministic

    @property
    def nccl(self) -> bool:
        """Whether GPU data crosses processes through NCCL (dist_device_sync with
        num_servers=0 on GPUs); else it goes through host buffers and MPI."""
        return self._engine_device is not host_device(0)

    def is_capable(self, capability: str) -> bool:
        return self._values.is_capable(capability) or (
            isinstance(capability, str) and capability.lower() == "gradient_compression")

    def keys(self) -> list:
        return self._values.keys()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key) -> bool:
        return key in self._values

    @timeline.traced("barrier")
    def barrier(self) -> None:
        """Wait for every worker; a PeerError names those that did not come in time."""
        with self._lock:
            self._engine.control.barrier()
            self._refresh()

    def workers_max(self, values, what: str) -> np.ndarray:
        """The elementwise maximum of `values` (ints or bools, one shape on every worker)
        over every worker, as an int64 array; each calls it at the same point, or every
        one gets a PeerError naming `what`."""
        mine = check.worker_values(values, what)
        with self._lock:
            return self._engine.control.workers_max(mine, what)

    # ------------------------------------------------------------------ the API
    @timeline.traced("init")
    def init(self, key, value) -> None:
        """Create key(s) on every worker; every worker must init the same keys (in any
        order) before its next call that talks to the others, and rank 0's value wins.
        An init refused on one worker alone is named on every worker (with
        num_servers=0, at that next call: see `_makes_keys`)."""
        with self._lock:
            with self._makes_keys("init"):
                groups = check.init_group(key, value)
                self._engine.control.check()
                check.init_values(groups, self._values.entries(), self._values.key_kind)
                if groups.keys and groups.sparse:
                    raise ArgumentKindError(f"key {groups.keys[0]!r}: a dist store is "
                                            f"initialised with dense values")
                self._engine.check_new_keys(groups.keys, [a[0] for a in groups.arrays])
            if not groups.keys:
                return
            self._values.init_checked(groups._replace(arrays=[[a[0]] for a in groups.arrays]))
            replicas = [self._new_replica(k) for k in groups.keys]
            self._engine.init(groups.keys, replicas)
            if not self._in_place:  # the device copies follow once rank 0's values came
                self._stale.extend(groups.keys)

    def _new_replica(self, key) -> np.ndarray:
        """The array the engine writes a new `key`'s value into: the store's own, or a
        host copy of it kept for the engine."""
        entry = self._values.entries()[key]
        if self._in_place:
            return entry.value
        host = entry.home.to_host(entry.value)  # a GPU value's is a new array already
        self._host[key] = host if host is not entry.value else host.copy()
        return self._host[key]

    def _replica(self, key) -> np.ndarray:
        return (self._values.entries()[key].value if self._in_place else self._host[key])

    @timeline.traced("push")
    def push(self, key, value, priority: int = 0) -> None:
        """Push every worker's value(s) of each key; see `KVStore.push`. In dist_sync a
        server (or the owner, with num_servers=0) applies the updater once per key per
        round, to the sum over every worker; in dist_async on every push."""
        with self._lock:
            with self.refusals_agreed("push"):
                if type(priority) is not int:
                    check.check_priority(key, priority)
                groups = check.group(key, value, "value")
                entries = self._checked_push(groups, "push")
            self._push(groups, entries)

    def settle_before_calls(self, wait, background) -> None:
        """Make every call of this store from a thread for which `background()` is
        False first `wait()` for the work a layer above handed to its own threads (the
        Trainer's reductions started from backward push from such a thread): the pushes
        started before a call come first in every process alike. Both are bound methods,
        held weakly."""
        super().settle_before_calls(wait, background)  # (checks them)
        self._lock.settle_before_calls(wait, background)

    def refusals_agreed(self, op: str, collective: bool = False
                        ) -> contextlib.AbstractContextManager[None]:
        """A push's checks (the store's own, or a layer's above it: gpukv.jax's): an
        error of theirs (not a peer's) is made known to the engine before it is raised,
        so that workers refusing unlike fail together (the others with a
        PeerMismatchError naming the refusal; this worker with its own error, which says
        why). `collective=True`: told as a settings call's refusals are."""
        if collective:
            return self._settings_agreed(op)
        return self._refusal_told(op, self._engine.refused)

    def _settings_agreed(self, op: str) -> contextlib.AbstractContextManager[None]:
        """A settings call's own checks (`set_gradient_compression`'s options, ...): as
        a push's, but agreed on where pushes are not collective too (servers), since
        the call itself is: a worker refusing alone makes the others raise a
        PeerMismatchError naming it at once, rather than wait for it in the call's
        agreement. Refused alike everywhere, the call changes nothing."""
        return self._refusal_told(op, lambda op, exc: self._engine.control.collective(
            f"{op} refused ({type(exc).__name__})", note=str(exc)))

    def _makes_keys(self, op: str, settles: bool = False
                    ) -> contextlib.AbstractContextManager[None]:
        """The checks of a call that makes keys (an init; a broadcast, which then pulls
        them). With num_servers=0 the keys a worker makes are agreed on at its next
        collective call, and so is a refusal (`Engine.refused_keys`), in their
        place: refused alike everywhere, nothing is made and the store goes on; refused
        by one worker alone, every worker raises there a PeerMismatchError naming the
        refusal (that worker its own error at once). `settles`: the call makes that
        agreement itself (a broadcast's pull), and so does its refusal, so that the
        others, in it, hear of the refusal at once. With servers nothing is told: the
        inits go to the servers, which name a worker's that never came once the timeout
        has passed (docs/limits.md)."""
        def tell(op: str, error: Exception) -> None:
            if self._engine.refused_keys(op, error) and settles:
                self._fetch([])
        return self._refusal_told(op, tell)

    def _pull_refused(self, op: str) -> contextlib.AbstractContextManager[None]:
        """The checks of a pull: a pull moves nothing between workers but the keys made
        before it (agreed on first, with num_servers=0; answered by their servers
        otherwise), so a refusal makes that step alone, as the others' pulls do, and is
        raised here only: the others' pulls go on, refused alike or not. (With nothing
        made since the last agreement, the step is none: a pull is then local.)"""
        return self._refusal_told(op, lambda op, exc: self._fetch([]))

    @contextlib.contextmanager
    def _refusal_told(self, op: str, tell: Callable[[str, Exception], None]) -> Iterator[None]:
        """Raise what the checks inside raise; a gpukv error of theirs (not a peer's) is
        first told to the others with `tell(op, error)`."""
        try:
            yield
        except PeerError:
            raise
        except GpukvError as exc:
            with self._lock:
                try:
                    tell(op, exc)
                except PeerError:
                    pass
            raise

    def _checked_push(self, groups, op: str) -> list:
        self._engine.control.check()
        entries = self._values.lookup(groups, op)
        check.all_sources(groups, entries, op)
        if not groups.keys:
            return entries
        if groups.sparse:
            raise ArgumentKindError(f"key {groups.keys[0]!r}: a dist store takes dense "
                                    f"pushes; push the rows as a dense gradient")
        if self._type == "dist_async" and not (self._has_optimizer or self._has_updater):
            raise ArgumentError(f"key {groups.keys[0]!r}: dist_async applies every push as "
                                f"it comes with the store's optimizer; call set_optimizer "
                                f"(or set_updater) first")
        if self._checker is not None:  # what the optimizer refuses, refused here first
            self._checker.check(groups.keys, [e.value for e in entries])
        return entries

    def _push(self, groups, entries) -> None:
        if not groups.keys:
            return
        if self._has_optimizer:
            self._engine.follow(self._optimizer_followed)
        # the canonical sums read the values as one process sums them: each converted to
        # its key's dtype first (the sums of `_local_sums` convert as they go)
        with timeline.span("sum here"):
            grads = (self._node_sums(cast_to_keys(groups, entries), entries)
                     if self._deterministic else self._local_sums(groups, entries))
        replicas = [self._replica(k) for k in groups.keys]
        with timeline.span("round", "mpi"):
            self._engine.push(groups.keys, grads, replicas)
        if self._engine.round_updates_replicas:
            self._to_devices(groups.keys, replicas)
        self._refresh()

    def _refresh(self) -> None:
        """Host path of dist_device_sync: the device copies of new keys take rank 0's
        value once the engine has agreed on them (any call of the engine may do that)."""
        if self._stale and not self._engine.pending:
            keys, self._stale = self._stale, []
            self._to_devices(keys, [self._host[k] for k in keys])

    def _local_sums(self, groups, entries) -> list:
        """Each key's sum over this process's devices, in the dtype sums of the key's are
        made in (float32 for 16-bit floats, which the engines send: rounding it to the
        key's would overflow where the sum over every process does not), where the
        engine reads it (the host, or the NCCL GPU); a lone array of the key's dtype
        already there is used as it is (read, never kept)."""
        sums: list = [None] * len(groups.keys)
        rest = []
        engine_device = self._engine_device
        for i, (arrays, entry) in enumerate(zip(groups.arrays, entries)):
            a = arrays[0]
            if (len(arrays) == 1 and engine_device.owns(a) and a.dtype == entry.value.dtype
                    and a.flags.c_contiguous):
                sums[i] = a
            else:
                rest.append(i)
        if rest:
            sub = check.Groups([groups.keys[i] for i in rest], [groups.arrays[i] for i in rest],
                               groups.all_host, groups.key_kind)
            grads = self._grads
            summed = grads.entries()
            new = [k for k in sub.keys if k not in summed]
            if new:  # a key's first push that needs a sum here: its buffer, made now
                values = self._values.entries()
                grads.init(new, [_sum_buffer(values[k].value) for k in new])
            grads.push_checked(sub, [summed[k] for k in sub.keys])
            for i in rest:
                entry = summed[groups.keys[i]]
                sums[i] = (entry.value if self._in_place
                           else entry.home.to_host(entry.value))
        return sums

    def _node_sums(self, groups, entries) -> list:
        """Each key's `Partials`: the sums of the canonical tree's nodes this worker holds
        (its values are leaves rank * n .. rank * n + n - 1 of the key's tree), in the
        key's wire dtype, on the host; a lone host array of the wire dtype is used as it
        is. A key the engine compresses gets `Leaves` instead: each value on its own."""
        rank, workers = self.rank, self.num_workers
        comp = self._engine.compressor
        out: list = []
        for key, arrays, entry in zip(groups.keys, groups.arrays, entries):
            if compresses_key(comp, entry.value.dtype, entry.value.shape):
                out.append(self._leaves_of(key, arrays, entry.value))
                continue
            wire = accumulate_dtype(entry.value.dtype)
            size = entry.value.size
            a = arrays[0]
            if (len(arrays) == 1 and isinstance(a, np.ndarray) and a.dtype == wire
                    and a.flags.c_contiguous):
                out.append(Partials(a.reshape(1, size), 1))
                continue
            ranges = rank_nodes(rank, len(arrays), workers)
            buffer = self._partials.get(key)
            if buffer is None or buffer.shape[0] != len(ranges):
                buffer = self._partials[key] = np.empty((len(ranges), size), wire)
            node_sums(key, arrays, groups.all_host, ranges, rank * len(arrays),
                      buffer, entry.value.shape)
            out.append(Partials(buffer, len(arrays)))
        return out

    def _leaves_of(self, key, arrays, value) -> Leaves:
        """A compressed key's `Leaves`: its values as the one-process compressor reads
        them (cast to the key's dtype, then to float32), a row each; a lone float32 host
        array of a float32 key is used as it is."""
        a = arrays[0]
        if (len(arrays) == 1 and isinstance(a, np.ndarray) and a.dtype == np.float32
                and value.dtype == np.float32 and a.flags.c_contiguous):
            return Leaves(a.reshape(1, value.size), 1)
        buffer = self._leaves.get(key)
        if buffer is None or buffer.shape[0] != len(arrays):
            buffer = self._leaves[key] = np.empty((len(arrays), value.size), np.float32)
        leaf_values(arrays, value.dtype, buffer)
        return Leaves(buffer, len(arrays))

    def _to_devices(self, keys, replicas) -> None:
        """After the engine wrote new values into host copies: onto the devices."""
        if self._in_place:
            return
        for key, host in zip(keys, replicas):
            entry = self._values.entries()[key]
            entry.home.copy(entry.value, host)

    @timeline.traced("pull")
    def pull(self, key, out=None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy each key's value into `out`; in dist_sync a pull returns the value after
        every push of this worker that came before it, summed with the other workers'."""
        with self._lock:
            with self._pull_refused("pull"):
                groups = check.pull_outs(key, out, priority, ignore_sparse)
                self._engine.control.check()
                entries = self._values.lookup(groups, "pull")
                check.all_outs(groups, entries)
            self._fetch(groups.keys)
            self._values.pull_checked(groups, entries, ignore_sparse)

    def _fetch(self, keys) -> None:
        """Bring `keys` into this process's copies (and their devices); with no keys, the
        first step of every pull alone (the keys made before it agreed on)."""
        replicas = [self._replica(k) for k in keys]
        self._engine.pull(keys, replicas)
        if not self._engine.round_updates_replicas:
            self._to_devices(keys, replicas)
        self._refresh()

    @timeline.traced("pushpull")
    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Push then pull (into `value` itself when `out` is None); both checked first."""
        with self._lock:
            with self.refusals_agreed("pushpull"):
                groups, out_groups = check.pushpull_groups(key, value, out, priority)
                entries = self._checked_push(groups, "pushpull")
                out_entries = (entries if out is None
                               else self._values.lookup(out_groups, "pushpull"))
                check.all_outs(out_groups, out_entries)
                if out_groups.sparse:
                    check.refuse_sparse_outs(out_groups, out is None)
            self._push(groups, entries)
            self._fetch(out_groups.keys)
            self._values.pull_checked(out_groups, out_entries)

    @timeline.traced("broadcast")
    def broadcast(self, key, value, out, priority: int = 0) -> None:
        """init (rank 0's value wins) then pull into `out`; the outs are checked against
        the values first, so that a refused call initialises nothing (refused on one
        worker alone, with num_servers=0, it is a PeerMismatchError naming the refusal
        on every other worker at once: see `_makes_keys`)."""
        with self._lock:
            with self._makes_keys("broadcast", settles=True):
                if type(priority) is not int:
                    check.check_priority(key, priority)
                groups = check.init_group(key, value)
                out_groups = check.group(key, out, "out", written=True)
                self._engine.control.check()
                check.broadcast_args(groups, out_groups, self._values.entries(),
                                     self._values.key_kind)
            self.init(key, value)
            entries = self._values.lookup(out_groups, "broadcast")
            check.all_outs(out_groups, entries)
            self._fetch(out_groups.keys)
            self._values.pull_checked(out_groups, entries)

    @timeline.traced("row_sparse_pull")
    def row_sparse_pull(self, key, out=None, row_ids=None, priority: int = 0) -> None:
        """The rows `row_ids` of each key into RowSparse `out`(s) (see KVStore's)."""
        with self._lock:
            with self._pull_refused("row_sparse_pull"):
                if type(priority) is not int:
                    check.check_priority(key, priority, check.ROW_SPARSE_ORDER)
                pairs = check.row_sparse_pairs(key, out, row_ids)
                self._engine.control.check()
                check.row_sparse_pulls(pairs, self._values.entries(),
                                       self._values.key_kind)
            self._fetch(list(dict.fromkeys(k for k, _, _ in pairs)))
            self._values.row_sparse_pull(key, out, row_ids)

    # ---------------------------------------------------- updaters, compression
    def set_updater(self, updater) -> None:
        """Run `updater(key, merged, stored)` where the keys are served: on this process's
        shard (num_servers=0), or on the servers (which receive it pickled: a function
        defined at module level). Pieces of split keys are updated piece by piece, as
        MXNet's servers do. An exception it raises ends the store (the others get a
        PeerError carrying it, and so do later calls); a call of this store from inside
        it is an ArgumentError (the calls are collective)."""
        with self._settings_agreed("set_updater"):
            if not callable(updater):
                raise ArgumentKindError(
                    f"updater: expected a callable, got {type(updater).__name__}")
        if not self._num_servers:  # (servers run it in processes of their own)
            updater = _Guarded(updater, self._lock)
        with self._lock:
            self._engine.set_updater(updater)
            self._has_updater = True
            self._has_optimizer, self._checker = False, None  # the function replaces it
            self._let_go_of_optimizer(None)
            self._refresh()

    def _run_in(self, root: str) -> int:
        """The run this store's snapshots under `root` count as: worker 0's
        `snapshots.next_run` at the first one, on every worker (each calls this at the
        same snapshot)."""
        from ..checkpoints import snapshots
        run = self._runs.get(root)
        if run is None:
            found: int | str = 0
            if self.rank == 0:
                try:
                    found = snapshots.next_run(root)
                except CheckpointError as exc:
                    found = str(exc)
            found = self._engine.control.share(found, "snapshot: its run")
            if isinstance(found, str):
                raise CheckpointError(found)
            run = self._runs[root] = found
        return run

    @property
    def has_updater(self) -> bool:
        return self._has_optimizer or self._has_updater

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run `optimizer` where the keys are served. Every worker calls it, with
        optimizers of the same kind and options (else PeerMismatchError). Later changes
        of its options (the learning rate, rescale_grad, multipliers) count, as in one
        process: made on every worker with num_servers=0 (each runs its own on its
        shard), on worker 0's optimizer with dedicated servers (it is sent to them).
        Each worker's optimizer object is this store's alone (`gpukv.optim.claims`): an
        optimizer another live store of the process runs is an ArgumentError, agreed on
        as the call's other refusals are."""
        from ..optim import Optimizer
        from ..optim import claims as optimizer_claims
        with self._settings_agreed("set_optimizer"):
            if not isinstance(optimizer, Optimizer):
                raise ArgumentKindError(
                    f"optimizer: expected a gpukv.optim.Optimizer (e.g. "
                    f"gpukv.optim.create('sgd')), got {type(optimizer).__name__}")
            optimizer.check_rule()  # (before any worker's engine takes it)
            held = optimizer_claims.holder(optimizer, self)
            if held is not None:
                raise optimizer_claims.refusal(optimizer, held)
            del held
        from ..optim import OptimizerUpdater
        with self._lock:
            before = optimizer_claims.claim(optimizer, self)
            try:
                self._engine.set_optimizer(optimizer)
            except BaseException:
                optimizer_claims.give_back(optimizer, self, before)
                raise
            self._let_go_of_optimizer(optimizer)
            self._has_optimizer = True
            self._optimizer_followed = optimizer
            self._checker = OptimizerUpdater(optimizer)  # checks here what the shards take
            self._refresh()

    def _let_go_of_optimizer(self, successor) -> None:
        """The optimizer set before, unless it is `successor`, is free for other stores."""
        before = self._optimizer_followed
        if before is not None and before is not successor:
            from ..optim import claims as optimizer_claims
            optimizer_claims.release(before, self)
            self._optimizer_followed = None

    def set_gradient_compression(self, compression_params: dict | None) -> None:
        """Compress what each worker sends (see `KVStore.set_gradient_compression`)."""
        from ..encoding.compressors import make_compressor
        with self._settings_agreed("set_gradient_compression"):
            compressor = make_compressor(compression_params)
        params = None if compressor is None else compressor.params()
        with self._lock:
            # every worker sets the same, together: workers that differ are named on each
            self._engine.control.collective(f"set_gradient_compression({params})")
            self._engine.set_compression(compressor)

    @property
    def gradient_compression(self) -> dict | None:
        comp = self._engine.compressor
        return None if comp is None else comp.params()

    # ------------------------------------------------------------- checkpoints
    # Every worker calls these (optimizer state is spread over the shards), with the same
    # path; worker 0 reads or writes the file, the same format a one-process store uses,
    # and tells the others how it went: a failure raises the same CheckpointError on
    # every worker.
    def _checkpoint_call(self, op: str, path, optimizer: bool = False, note: str = "",
                         check_options: Callable[[], Any] | None = None) -> str:
        """Begin checkpoint call `op` of `path` on every worker; `path` as a str. It is
        checked first (with `optimizer`, so is the store's optimizer; then
        `check_options()`, the call's own), each refusal told as a settings call's is;
        then the call is agreed on with the path (and `note`, its options in words),
        before anything moves: worker 0 alone writes or reads a file, so workers that
        name different paths (one each, or each its own snapshot) or options would go
        on unlike, and get a PeerMismatchError naming the call and the paths instead."""
        from ..checkpoints.checkpoint import checkpoint_path
        with self._settings_agreed(op):
            self._engine.control.check()
            text = checkpoint_path(path)
            if optimizer:
                self._need_optimizer(op)
            if check_options is not None:
                check_options()
        self._engine.control.collective(f"{op} of {text!r}" + (f", {note}" if note else ""))
        return text

    @timeline.traced("save")
    def save(self, path: str | os.PathLike) -> None:
        """Write every key's value and the optimizer's state (see `KVStore.save`) to
        `path`, which every worker gives alike (worker 0 writes it; see
        `_checkpoint_call`)."""
        from ..checkpoints import checkpoint
        with self._lock:
            path = self._checkpoint_call("save", path)  # agreed before anything moves
            keys = self._values.keys()
            self._fetch(keys)  # every worker: with num_servers=0, queued keys are agreed on
            state = self._engine.optimizer_state(dump=True) if self._has_optimizer else None
            error = None
            if self.rank == 0:
                entries = [(k, self._engine_device.to_host(self._replica(k)),
                            self._values.entries()[k].home.kind) for k in keys]
                snapshot = checkpoint.StoreSnapshot(
                    self._type, self._values.key_kind, entries,
                    None if state is None else SavedState(state))
                error = _attempt(lambda: checkpoint.save_store(snapshot, path))
            _raise(self._engine.control.share(error, "save"))

    @timeline.traced("load")
    def load(self, path: str | os.PathLike) -> None:
        """Read a file `save` wrote, or a snapshot's folder (here or in any store, with
        any number of processes or servers): keys missing from the store are created,
        the others take the saved values, and the optimizer's state is restored when an
        optimizer is set. Every worker gives the same `path` (worker 0 reads a file;
        every worker the snapshot's folder it names): workers that give different ones
        get a PeerMismatchError naming them, before anything is read. Checked whole
        first; a failure changes nothing and raises CheckpointError everywhere."""
        from ..checkpoints import checkpoint
        with self._lock:
            path = self._checkpoint_call("load", path)  # agreed before anything moves
            contents = self._read(path)
            # The optimizer's state is checked whole, against the keys as they will be,
            # before any key is made (the shards check their parts again).
            snapshot = checkpoint.StoreSnapshot(self._type, self._values.key_kind,
                                                [(k, e.value, e.home.kind) for k, e in
                                                 self._values.entries().items()],
                                                self._checker)
            plan = checkpoint.plan_load(contents, snapshot)
            if plan.creates:
                self.init([k for k, _, _ in plan.creates], [v for _, v, _ in plan.creates])
            state = contents.optimizer if self._has_optimizer else None
            values = dict(plan.updates)
            self._engine.restore(values, state)
            if self._engine.round_updates_replicas:
                keys = list(values)
                for key in keys:
                    self._engine_device.copy(self._replica(key), values[key])
                self._to_devices(keys, [self._replica(k) for k in keys])
            self._refresh()

    def _read(self, path: str):
        """What `path` (the same on every worker: agreed on) holds, on every worker: a
        snapshot's folder (which every process sees, as they all wrote it) is read by
        every worker; a file by worker 0, which sends it to the others. A failure raises
        CheckpointError on every worker."""
        from ..checkpoints import snapshots
        folder = self._engine.control.share(self.rank == 0 and snapshots.is_snapshot(path), "load")
        if not folder:
            contents = None
            if self.rank == 0:
                contents = _attempt(lambda: snapshots.read_any(path), keep=True)
            return _raise(self._engine.control.share(contents, "load"))
        mine = _attempt(lambda: snapshots.read_store(path), keep=True)
        failed = isinstance(mine, CheckpointError)
        if self._engine.control.workers_max(np.array([failed], np.int8), "load: reading")[0]:
            first = self._engine.control.share(str(mine) if failed else None, "load")
            raise CheckpointError(first or f"{path}: another worker could not read this "
                                           f"snapshot")
        return mine

    @timeline.traced("snapshot")
    def snapshot(self, root: str | os.PathLike, step: int | None = None,
                 user_state: dict | None = None,
                 keep: int | None = 2, replicated: KVStore | None = None) -> str:
        """Start a numbered snapshot (see `KVStore.snapshot`); every worker calls it at
        the same step. Each shard (a process with num_servers=0, else a server) writes
        the pieces it serves and each worker its `user_state`, in the background: `root`
        must be a folder every process sees (a shared file system). `replicated`: a
        one-process store that every worker holds alike (the Trainer's with
        update_on_kvstore=False), saved instead of this store's keys, each worker writing
        every num_workers-th of its keys."""
        from ..checkpoints import claims, snapshots
        with self._lock:  # (the step after the last snapshot's, whichever thread took it)
            with self._settings_agreed("snapshot"):  # (one worker refusing alone is named)
                root, step, keep = snapshots.checked(root, step, keep, self._last_step)
                if replicated is not None and not isinstance(replicated, LocalStore):
                    raise ArgumentKindError(f"replicated: expected a one-process "
                                            f"gpukv.KVStore, got {replicated!r}")
                held_before = claims.claim(root, self)
            self._engine.control.check()
            self._engine.control.collective("snapshot")  # agreed before anything moves
            if self._tag is None:
                self._tag = self._engine.control.share(secrets.token_hex(4), "snapshot")
            folder = os.path.join(root, snapshots.folder_name(step, self._tag,
                                                              self._run_in(root)))
            try:
                worker = snapshots.worker_files(folder, step, self.rank, self.num_workers,
                                                user_state)
                problem = None
            except (ArgumentError, ArgumentKindError) as exc:
                worker, problem = None, exc
            if self._engine.control.workers_max(np.array([problem is not None], np.int8),
                                                "snapshot: checking user_state")[0]:
                claims.give_back(root, self, held_before)  # (a refused snapshot takes nothing)
                raise problem or ArgumentError(
                    "snapshot: another worker's user_state cannot be saved; nothing was")
            if replicated is None:
                entries = self._values.entries()
                error = self._engine.write_snapshot({
                    "folder": folder, "step": step, "store_type": self._type,
                    "keys": {k: (e.home.kind, i) for i, (k, e) in enumerate(entries.items())}})
                mine = None
            else:
                if replicated not in self._replicated:
                    self._replicated.append(replicated)
                error = None
                mine = share_of(replicated, folder, step, self.rank, self.num_workers)
            if self._writer is None:
                self._writer = snapshots.PartWriter()
            try:
                turn, staging = self._writer.stage()
            except CheckpointError as exc:
                mine = mine or str(exc)
            else:
                state = self._engine.worker_compression() if replicated is None else None
                if state is not None and worker is not None:  # its residuals, staged
                    path, header, arrays = worker
                    params, items = state
                    section, more = snapshots.compression_section(params, items, staging)
                    staging.copy()
                    worker = (path, dict(header, compression=section), {**arrays, **more})
                # Worker 0 prunes once its own file is written, counting only complete
                # snapshots (never removing one of the `keep` newest complete): this one
                # and the one before may not be complete yet (other processes' files
                # land later), so more than `keep` may stay until a later prune;
                # finish_snapshots prunes once every snapshot is known complete, and so
                # does a normal exit without it (`snapshots_at_exit`).
                then = (lambda: snapshots.prune(root, keep)) if (
                    self.rank == 0 and keep is not None) else None
                self._writer.submit(turn, [worker], then)
                if keep is not None:
                    self._pruning.note(root, keep, folder)
            error = self._agreed_error(mine, "snapshot") or error
            if error is not None:
                raise CheckpointError(error)
            self._last_step = step
        return folder

    def _agreed_error(self, mine: str | None, what: str) -> str | None:
        """An error some worker met (`mine`: this worker's), the same on every worker."""
        if not self._engine.control.workers_max(np.array([mine is not None], np.int8), what)[0]:
            return None
        first = self._engine.control.share(mine, what)
        return first or mine or f"{what}: another worker's snapshot files could not be written"

    @timeline.traced("resume")
    def resume(self, root: str | os.PathLike, check=None, into: list | None = None):
        """Load the newest complete snapshot under `root` (see `KVStore.resume`): worker 0
        picks it (and runs `check`), so every worker loads the same one, into this store
        or into the one-process stores `into` (each worker's own). Every worker calls it."""
        from ..checkpoints import snapshots
        with self._lock:
            self._engine.control.check()
            self._engine.control.collective("resume")
            found = None
            if self.rank == 0:
                found = _attempt(lambda: _checked(snapshots.latest_snapshot(root), check),
                                 keep=True)
            found = _raise(self._engine.control.share(found, "resume"))
            if found is None:
                log.info("gpukv: worker %d: no complete snapshot under %s to resume from",
                         self.rank, os.fspath(root))
                return None
            self._last_step = found.step
            if into is None:
                self.load(found)
                changed = self._engine.restore_compression(found, self._replica)
                self._to_devices(changed, [self._replica(k) for k in changed])
            else:
                mine = None
                for store in into:
                    try:
                        store.load(found)
                    except CheckpointError as exc:
                        mine = mine or str(exc)
                error = self._agreed_error(mine, "resume")
                if error is not None:
                    raise CheckpointError(error)
            log.info("gpukv: worker %d resumed from snapshot %s (step %d)", self.rank,
                     found.path, found.step)
            return found

    @timeline.traced("finish_snapshots")
    def finish_snapshots(self) -> None:
        """Wait until every snapshot started is written, by every shard; CheckpointError
        on every worker if one failed; then only the `keep` newest complete snapshots
        are left. Every worker calls it."""
        from ..checkpoints import snapshots
        with self._lock:
            self._engine.control.check()
            self._engine.control.collective("finish_snapshots")
            mine = None
            for store in self._replicated:
                try:
                    store.finish_snapshots()
                except CheckpointError as exc:
                    mine = mine or str(exc)
            if self._writer is not None:
                try:
                    self._writer.finish()
                except CheckpointError as exc:
                    mine = mine or str(exc)
            error = self._engine.finish_snapshots()
            # every worker's own files are written (or failed) before any worker returns
            error = self._agreed_error(mine, "finishing the snapshots") or error
            if error is not None:
                raise CheckpointError(error)
            # Only here is every snapshot taken known complete, on every worker and
            # shard: the prune that leaves exactly `keep` of them (see snapshot()).
            pruning = self._pruning.take()
            if pruning:
                mine = None
                if self.rank == 0:
                    try:
                        for root, keep in pruning.items():
                            snapshots.prune(root, keep)
                    except CheckpointError as exc:
                        mine = str(exc)
                error = self._agreed_error(mine, "pruning the snapshots")
                if error is not None:
                    raise CheckpointError(error)

    def save_optimizer_states(self, fname: str | os.PathLike,
                              dump_optimizer: bool = False) -> None:
        """Write the optimizer's state, gathered from every shard, to `fname`, which every
        worker gives alike (worker 0 writes it; see `_checkpoint_call`)."""
        from ..checkpoints.checkpoint import write_archive
        with self._lock:
            path = self._checkpoint_call("save_optimizer_states", fname, optimizer=True)
            state = self._engine.optimizer_state(dump=bool(dump_optimizer))
            error = None
            if self.rank == 0:
                error = _attempt(lambda: write_archive(path, *state))
            _raise(self._engine.control.share(error, "save_optimizer_states"))

    def load_optimizer_states(self, fname: str | os.PathLike,
                              update_counts: str = "saved") -> None:
        """Restore what `save_optimizer_states` wrote (by any store) onto every shard;
        every worker gives the same `fname` (worker 0 reads it; see `_checkpoint_call`)
        and the same `update_counts` ('saved' or 'restart': see
        `KVStore.load_optimizer_states`)."""
        from ..checkpoints.checkpoint import read_archive
        from ..layout.state import restarted
        with self._lock:
            path = self._checkpoint_call("load_optimizer_states", fname, optimizer=True,
                                         note=("" if update_counts == "saved" else
                                               f"update_counts={update_counts!r}"),
                                         check_options=lambda: check.update_counts(
                                             update_counts))
            state = _attempt(lambda: read_archive(path), keep=True) if self.rank == 0 \
                else None
            state = _raise(self._engine.control.share(state, "load_optimizer_states"))
            if update_counts == "restart":
                state = restarted(state, self._optimizer_followed.begin_num_update)
            try:
                self._engine.restore({}, state)
            except CheckpointError as exc:  # (each shard checks its part: name the file)
                if str(path) in str(exc):
                    raise
                raise CheckpointError(f"{path}: {exc}") from exc

    def _need_optimizer(self, op: str) -> None:
        if not self._has_optimizer:
            raise ArgumentError(f"{op}: this store has no optimizer; call set_optimizer first")

    def __repr__(self):
        return (f"<gpukv.DistKVStore type={self._type!r} rank={self.rank} "
                f"workers={self.num_workers} servers={self._num_servers} "
                f"keys={len(self._values)}>")


class _Guarded:
    """The program's updater, run with its store's calls refused (`CallLock`)."""

    def __init__(self, updater, lock: CallLock) -> None:
        self.updater, self._lock = updater, lock

    def __call__(self, key, merged, stored):
        with self._lock.running_updater():
            return self.updater(key, merged, stored)

    def __repr__(self) -> str:
        return repr(self.updater)
