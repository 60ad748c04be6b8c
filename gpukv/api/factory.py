"""`create`: the store a name asks for, one process's or one shared by an MPI job."""
from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from .._env import first_process, name_unknown, restart_note, unknown_settings
from .._errors import ArgumentError, ArgumentKindError
from ..comm.registry import all_strategy_options
from ..device import host_jit
from ..store.base import KVStore
from ..store.local import _TYPES, LocalStore

log = logging.getLogger("gpukv")

# Several processes (gpukv.distributed.store, imported when asked for: it needs MPI).
_DIST_TYPES = frozenset(["dist_sync", "dist_async", "dist_device_sync"])
_UNKNOWN_SAID: set[str] = set()  # the unknown GPUKV_* variables warned of in this process
_UNKNOWN_LOCK = threading.Lock()  # (stores made by several threads at once say each once)


def create(name: str = "local", **options: Any) -> KVStore:
    """A new store. `name`: 'local', 'device', 'nccl' or one of MXNet's aliases in one
    process; 'dist_sync', 'dist_async' or 'dist_device_sync' across the processes of an
    MPI job (every process calls `create` alike):

        kv = gpukv.create('device', strategy='tree')
        kv = gpukv.create('dist_sync', num_servers=1)   # under mpiexec -n N

    Options: `strategy`, a name ('auto', 'home', 'tree', 'ring', 'cpu', 'nccl'; the
    environment variable GPUKV_STRATEGY gives the default of GPU stores) or a
    `gpukv.comm.Strategy` instance; and the keyword options of the strategy the name picks
    (e.g. `array_bound=` for 'tree'), passed to its constructor; `deterministic`: True
    sums every key in one canonical order (`gpukv.canonical`: a fixed tree over the
    values in the order they are given), so the result is the same bits whatever the
    strategy, the devices the values lie on or the slicing of a key; None (the default)
    reads the environment variable GPUKV_DETERMINISTIC ('1' on, '0' off; unset: off),
    and `kv.deterministic` says which.

    Dist stores also take: `num_servers`, an int from 0 (the default: every process is a
    worker that also serves a shard of the keys) to N - 1 (that many dedicated server
    processes, which serve inside `create` and then end; 'dist_async' needs at least 1);
    `timeout`, the seconds every wait on another process is bounded by (default 120)
    before a PeerError names the ranks that did not answer; `bigarray_bound`, the
    elements from which a key is split over the servers (default 1,000,000); `nccl`,
    for 'dist_device_sync' with num_servers=0: True to carry GPU data between processes
    with NCCL (a BackendError without it), False for the host path, None (the default)
    NCCL where the process has a GPU of its own and CuPy finds NCCL, else the host path.
    Their environment variables (GPUKV_NUM_SERVERS, GPUKV_DIST_TIMEOUT,
    GPUKV_BIGARRAY_BOUND) give the defaults.
    """
    if not isinstance(name, str):
        raise ArgumentKindError(f"store name: expected a str, got {type(name).__name__}")
    lowered = name.lower()
    _warn_of_unknown_settings()
    if lowered in _DIST_TYPES:  # (which checks the settings with the other processes)
        from ..distributed.store import DistKVStore
        accepted = _store_options() | _own_options(DistKVStore)
        _check_options(options, accepted)
        return DistKVStore(lowered, **options)
    if lowered not in _TYPES:
        valid = sorted(_TYPES) + sorted(_DIST_TYPES)
        raise ArgumentError(f"store name {name!r}: unknown; valid names are {', '.join(valid)}")
    _check_options(options, _store_options())
    host_jit.check_setting()  # read by the host's float16 sums as well as by compression
    store = LocalStore(lowered, **options)
    # Said here, not by LocalStore: dist stores keep their keys in LocalStores of their own.
    # Its devices are not named: a key's home is chosen when the key is made.
    note = restart_note()
    log.info("gpukv %r store made: one process, strategy %s%s%s", store.type, store.strategy,
             ", deterministic" if store.deterministic else "", f", {note}" if note else "")
    return store


def _warn_of_unknown_settings() -> None:
    """One warning for each GPUKV_* variable gpukv does not read (a misspelled setting
    would otherwise be without effect, unsaid), by a job's rank 0 alone: the ranks of a
    job share an environment."""
    if not first_process():
        return
    with _UNKNOWN_LOCK:
        unknown = {name: close for name, close in unknown_settings().items()
                   if name not in _UNKNOWN_SAID}
        _UNKNOWN_SAID.update(unknown)
    if unknown:
        log.warning("gpukv reads no such setting, so it has no effect: %s (the "
                    "Settings page lists those it reads)", name_unknown(unknown))


def _check_options(options: dict, accepted: set) -> None:
    for option in options:
        if option not in accepted:
            raise ArgumentKindError(f"store option {option!r}: unknown; valid options are "
                                    f"{', '.join(sorted(accepted)) or 'none'}")


def _own_options(cls) -> set:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind == p.KEYWORD_ONLY}


def _store_options() -> set:
    """The keyword options a LocalStore takes: its own, and every strategy's (each checked
    against the strategy the store ends up with when it is made)."""
    return _own_options(LocalStore) | all_strategy_options()
