"""What a worker asks of a server: one small dataclass per command (`Command`, as MXNet's
`CommandType`), pickled as (worker, request); the raw arrays a request announces follow
it as messages of their own (`client.in_chunks`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np


class Command(enum.Enum):
    INIT = "init"
    PUSH = "push"
    PULL = "pull"
    FLUSH = "flush"
    SETTINGS = "settings"
    SET_OPTIMIZER = "set_optimizer"
    SET_UPDATER = "set_updater"
    OPTIMIZER_STATE = "optimizer_state"
    WRITE_SNAPSHOT = "write_snapshot"
    FINISH_SNAPSHOTS = "finish_snapshots"
    CHECK_STATE = "check_state"
    RESTORE = "restore"
    RESTORE_COMPRESSION = "restore_compression"
    RESET_COMPRESSION = "reset_compression"
    STOP = "stop"


class InitPiece(NamedTuple):
    """A key's piece a server is to make: elements [start, stop) of a key of `shape`."""
    key: Any
    start: int
    stop: int
    shape: tuple
    dtype: np.dtype


class PushPiece(NamedTuple):
    """A key's piece a push carries: `elements` of `dtype` per row, and its rows: one (a
    sum), or one per node partial or per leaf payload of `pushed` values; or, `share`,
    this worker's share of the round's whole sum, which every worker holds (a low-rank
    sum, PowerSGD's): the piece's elements cut over the workers in worker order."""
    key: Any
    dtype: np.dtype
    elements: int
    comp: tuple | None = None  # (compressor params, elements) of a compressed payload
    pushed: int | None = None  # the values of a push of node partials or leaves, else None
    share: bool = False
    #: the num_update the key's update takes, as the worker counted the push's keys (in
    #: sync mode with an optimizer: see `update_order`), else None
    num_update: int | None = None


@dataclass(frozen=True)
class Init:
    """Make these pieces once every worker asked; worker 0 sends their values (as bytes,
    `nbytes` each), the others none; answered on `tag` when every worker's keys exist."""
    command: ClassVar[Command] = Command.INIT
    tag: int
    pieces: list
    nbytes: list = field(default_factory=list)


@dataclass(frozen=True)
class Push:
    """Sum these pieces (their data follows, in chunks) into the next round of each key."""
    command: ClassVar[Command] = Command.PUSH
    pieces: list  # PushPiece


@dataclass(frozen=True)
class Pull:
    """Send each key's piece on `tag` once it has reached the version given: the value
    in chunks, or (where `changes` says so) the payload that moved it on from the
    version before, which the worker holds (compressed pulls)."""
    command: ClassVar[Command] = Command.PULL
    tag: int
    wanted: list  # (key, version): the worker's pushes of the key so far
    changes: list = field(default_factory=list)  # per wanted: send the payload


@dataclass(frozen=True)
class Flush:
    """Answer on `tag` once this worker's earlier requests are handled."""
    command: ClassVar[Command] = Command.FLUSH
    tag: int


@dataclass(frozen=True)
class Settings:
    """Worker 0's optimizer options changed: apply them."""
    command: ClassVar[Command] = Command.SETTINGS
    settings: tuple


@dataclass(frozen=True)
class SetOptimizer:
    command: ClassVar[Command] = Command.SET_OPTIMIZER
    optimizer: bytes  # pickled


@dataclass(frozen=True)
class SetUpdater:
    command: ClassVar[Command] = Command.SET_UPDATER
    updater: bytes  # pickled


@dataclass(frozen=True)
class OptimizerState:
    """Answer with this server's optimizer state (`dump`: with the optimizer itself)."""
    command: ClassVar[Command] = Command.OPTIMIZER_STATE
    dump: bool


@dataclass(frozen=True)
class WriteSnapshot:
    """Stage this server's pieces for a snapshot and write them in the background
    (`part`: `Shard.write_part`'s request); answer with an earlier write's error."""
    command: ClassVar[Command] = Command.WRITE_SNAPSHOT
    part: dict


@dataclass(frozen=True)
class FinishSnapshots:
    command: ClassVar[Command] = Command.FINISH_SNAPSHOTS


@dataclass(frozen=True)
class CheckState:
    """Check this server's part of a loaded optimizer state (None: none); answer with
    the error, or None."""
    command: ClassVar[Command] = Command.CHECK_STATE
    state: Any


@dataclass(frozen=True)
class Restore:
    """Assign these values ({key: piece}) and install the state `CheckState` checked."""
    command: ClassVar[Command] = Command.RESTORE
    values: dict


@dataclass(frozen=True)
class RestoreCompression:
    """Put back what this server keeps of compressed pulls (`params`: the compressor's,
    sorted items) from its file of the snapshot at `path` (shard `index` of `count`),
    which every worker checked; answer with an error, or None."""
    command: ClassVar[Command] = Command.RESTORE_COMPRESSION
    path: str
    index: int
    count: int
    params: tuple


@dataclass(frozen=True)
class ResetCompression:
    """The workers set their compression (again, maybe the same): every key's pulls
    start afresh, as a worker's store does, its served value what workers hold and its
    pull residual gone; answer "ok"."""
    command: ClassVar[Command] = Command.RESET_COMPRESSION


@dataclass(frozen=True)
class Stop:
    """This worker is done."""
    command: ClassVar[Command] = Command.STOP
