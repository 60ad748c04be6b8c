"""The declared surfaces between a dist store and its engines: every engine has every
member of `Engine`, every engine's control every member of `Control`, the sharded
engine's data paths what it calls on them, and the store's shard every member of
`Shard`, with the protocol's parameters."""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.distributed import Engine, Shard
from gpukv.distributed.engines.client import ServerClient
from gpukv.distributed.engines.control import WorkerControl
from gpukv.distributed.engines.mpi_rounds import MpiRounds
from gpukv.distributed.engines.nccl_rounds import NcclRounds
from gpukv.distributed.engines.protocol import Control, RoundState
from gpukv.distributed.engines.sharded import ShardedRounds
from gpukv.distributed.parts import Shard as StoreShard

ENGINES = [ShardedRounds, ServerClient]
DATA_PATHS = [MpiRounds, NcclRounds]
PACKAGE = Path(gpukv.__file__).resolve().parent


def _protocols(protocol) -> list:
    """`protocol` and the protocols it is made of."""
    return [c for c in protocol.__mro__ if getattr(c, "_is_protocol", False)
            and c is not typing.Protocol]


def _declared(protocol, name: str):
    """The declaration of `name` in `protocol` or the protocols it is made of (None for
    an attribute only annotated)."""
    return next((vars(c)[name] for c in _protocols(protocol) if name in vars(c)), None)


def _members(protocol) -> list[str]:
    """The public names a protocol declares: its methods, properties and annotations."""
    names: set = set()
    for c in _protocols(protocol):
        names |= set(vars(c).get("__annotations__", {})) | {n for n in vars(c)
                                                            if not n.startswith("_")}
    return sorted(names)


def _has(cls, name: str) -> bool:
    """Whether `cls` defines `name`, as a class attribute or an annotated instance one."""
    return hasattr(cls, name) or any(name in vars(c).get("__annotations__", {})
                                     for c in cls.__mro__)


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()][1:]


def _methods(protocol) -> list[str]:
    return [n for n in _members(protocol) if inspect.isfunction(_declared(protocol, n))]


def _used(path: Path, *owner: str) -> set[str]:
    """The names the code of `path` reads from `self.<owner>` (`self.a.b` for ("a", "b"))."""
    tree = ast.parse(path.read_text())

    def reads(node, names) -> bool:
        if not names:
            return isinstance(node, ast.Name) and node.id == "self"
        return (isinstance(node, ast.Attribute) and node.attr == names[-1]
                and reads(node.value, names[:-1]))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and reads(node.value, owner)}


def test_the_protocols_declare_what_the_store_and_the_engines_use():
    """Engine declares every call the dist store makes on its engine, and Shard every call
    an engine makes back on its shard: nothing passes between them undeclared."""
    store = PACKAGE / "distributed" / "store.py"
    store_uses = _used(store, "_engine")
    control_uses = _used(store, "_engine", "control")
    engines = list((PACKAGE / "distributed" / "engines").glob("*.py"))
    engines_use = set().union(*(_used(p, "shard") for p in engines))
    engines_use |= set().union(*(_used(p, "state", "shard") for p in engines))
    paths_use = set().union(*(_used(p, "state") for p in engines))
    assert {"push", "pull", "control"} <= store_uses
    assert {"collective", "barrier", "share"} <= control_uses
    assert {"update", "stored"} <= engines_use
    assert {"layouts", "assigns", "update"} <= paths_use
    assert not store_uses - set(_members(Engine)), store_uses - set(_members(Engine))
    assert not control_uses - set(_members(Control)), control_uses - set(_members(Control))
    assert not engines_use - set(_members(Shard)), engines_use - set(_members(Shard))
    assert not paths_use - set(_members(RoundState)), paths_use - set(_members(RoundState))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("member", _members(Engine))
def test_every_engine_has_every_engine_member(engine, member):
    """Each engine class defines each member of Engine (an instance attribute annotated)."""
    assert _has(engine, member), f"{engine.__name__} lacks Engine.{member}"


@pytest.mark.parametrize("engine", ENGINES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", _methods(Engine))
def test_every_engine_method_takes_the_protocols_parameters(engine, method):
    """Each engine's method takes the parameters Engine declares, by the same names."""
    assert _parameters(getattr(engine, method)) == _parameters(_declared(Engine, method))


@pytest.mark.parametrize("member", _members(Control))
def test_the_workers_control_has_every_control_member(member):
    """WorkerControl, every engine's control, defines each member of Control with the
    protocol's parameters."""
    assert _has(WorkerControl, member), f"WorkerControl lacks Control.{member}"
    if member in _methods(Control):
        assert (_parameters(getattr(WorkerControl, member))
                == _parameters(_declared(Control, member)))


@pytest.mark.parametrize("member", _members(RoundState))
def test_the_sharded_engine_is_the_state_of_its_data_paths(member):
    """ShardedRounds has each member of RoundState, which its data paths read."""
    assert _has(ShardedRounds, member), f"ShardedRounds lacks RoundState.{member}"


@pytest.mark.parametrize("path", DATA_PATHS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["share_values", "round", "forget", "refuse"])
def test_every_data_path_has_what_the_sharded_engine_calls(path, method):
    """Both data paths take the calls ShardedRounds makes on `self.rounds`, alike."""
    used = _used(PACKAGE / "distributed" / "engines" / "sharded.py", "rounds")
    assert method in used
    assert _parameters(getattr(path, method)) == _parameters(getattr(MpiRounds, method))


@pytest.mark.parametrize("method", _methods(Shard))
def test_the_stores_shard_takes_the_protocols_parameters(method):
    """The store's shard has each method of Shard, with the parameters Shard declares."""
    assert _parameters(getattr(StoreShard, method)) == _parameters(vars(Shard)[method])


def test_the_stores_shard_is_a_shard_and_no_engine():
    """An instance of the store's shard passes the runtime check of Shard (not of Engine)."""
    shard = StoreShard()
    assert isinstance(shard, Shard) and not isinstance(shard, Engine)


def test_every_server_command_has_one_request_and_a_handler():
    """Each Command is the command of exactly one request dataclass, and the server
    handles every command (STOP in `handle` itself) with a method of its own."""
    import dataclasses
    from types import SimpleNamespace

    from gpukv.distributed.engines import requests
    from gpukv.distributed.engines.server import _Server

    made = [c for c in vars(requests).values() if dataclasses.is_dataclass(c)]
    by_command: dict = {}
    for cls in made:
        by_command.setdefault(cls.command, []).append(cls.__name__)
    assert {c: len(names) for c, names in by_command.items()} == {
        c: 1 for c in requests.Command}
    server = _Server(SimpleNamespace(size=3, local_size=3), 1, StoreShard(),
                     asynchronous=False)
    assert set(server.handlers) == set(requests.Command) - {requests.Command.STOP}
    assert all(h.__self__ is server for h in server.handlers.values())


@pytest.mark.parametrize("summed", [0, 1, 2, 3, 7])
def test_a_pull_mid_round_gets_only_summed_elements_of_a_16_bit_key(summed):
    """A pull waiting for a round of a float16 key (its pushes cross as float32, in
    chunks of half the elements of the value's) is sent the value's chunks that end
    within the elements summed so far, not as many chunks as were summed."""
    from types import SimpleNamespace

    from gpukv.distributed.engines.server import _Key, _Pull, _Server
    from gpukv.distributed.mpi.chunks import chunk_ranges

    server = _Server(SimpleNamespace(size=3, local_size=3), 1, StoreShard(),
                     asynchronous=False)
    server.chunk = 64 << 10
    n = 100_000
    server.shard.init("h", np.zeros(n, np.float16))
    state = server.keys["h"] = _Key(server.workers)
    state.initialised = True
    pushed = chunk_ranges(n, 4, server.chunk)  # the float32 pushes' chunks
    state.summed = summed
    state.summed_to = pushed[summed - 1][1] if summed else 0
    sent = []
    server.t.send_array = lambda array, dest, tag: (dest, array.size)
    server.send = lambda request, buffer: sent.append(request)
    whole = server.send_ready(_Pull(worker=0, tag=5, wanted=[("h", 1)], changes=[]))
    assert whole == (state.summed_to == n)
    served = chunk_ranges(n, 2, server.chunk)
    ends = [hi for _, hi in served[:len(sent)]]
    assert all(end <= state.summed_to for end in ends), (sent, state.summed_to)
    assert len(sent) == sum(hi <= state.summed_to for _, hi in served)


@pytest.mark.parametrize("size,servers", [(1500, 3), (1_000_000, 7), (4096, 16), (511, 2)])
def test_split_keys_are_cut_at_multiples_of_the_codecs_block(size, servers):
    """Pieces of 256 values or more start at multiples of 256 (sign's blocks then fall
    where they fall in the whole key); every element is in exactly one piece."""
    from gpukv.layout.pieces import PIECE_ALIGN, pieces
    cut = pieces("k", size, servers, 1)
    assert [p.start for p in cut] == sorted(p.start for p in cut)
    assert cut[0].start == 0 and cut[-1].stop == size
    assert all(a.stop == b.start for a, b in zip(cut, cut[1:]))
    assert all(p.start % PIECE_ALIGN == 0 for p in cut)
    assert len({p.server for p in cut}) == len(cut) > 1


def test_short_shares_are_cut_at_the_codecs_longest_block():
    """Shares under 256 values are rounded up to 128 (ternary's block, two of sign's): a
    key of 300 values on 3 processes is 128, 128 and 44; one of 165 on 2 is 128 and 37;
    a key of 4 values on 4 processes is one piece."""
    from gpukv.layout.pieces import pieces
    for size, servers, want in ((300, 3, [(0, 128), (128, 256), (256, 300)]),
                                (165, 2, [(0, 128), (128, 165)]), (4, 4, [(0, 4)])):
        assert [(p.start, p.stop) for p in pieces("k", size, servers, 1)] == want


def _plan_cache(layouts: dict) -> MpiRounds:
    """An MpiRounds with only what its plan cache needs (no communicator)."""
    from gpukv.distributed.engines.layout import KeyLayout
    rounds = MpiRounds.__new__(MpiRounds)
    rounds._plans, rounds._plan_bytes, rounds._plan_limit = {}, {}, None
    rounds.state = typing.cast(RoundState, type("State", (), {"layouts": {
        key: KeyLayout.of(key, shape, np.float32, 2, 1 << 30)
        for key, shape in layouts.items()}})())
    return rounds


def test_a_job_pushing_ever_other_key_sets_keeps_a_bounded_number_of_plans(monkeypatch):
    """Each set of keys a round pushes gets a plan (with its packed buffers); a job whose
    rounds push ever other sets (the keys that had gradients) keeps at most
    `_PLANS_KEPT`, and a plan is reused while it is kept."""
    from gpukv.distributed.engines import mpi_rounds
    monkeypatch.setattr(mpi_rounds, "_PLANS_KEPT", 3)
    rounds = _plan_cache({"a": (1000,)})
    made = []

    def plan_of(name):
        return rounds._planned(name, lambda: made.append(name) or (name,))
    first = plan_of(("a",))
    assert plan_of(("a",)) is first and made == [("a",)]
    for i in range(10):
        plan_of((f"k{i}",))
        assert len(rounds._plans) <= 3
    assert len(made) == 11


def test_the_plans_kept_hold_a_few_times_the_bytes_of_the_keys():
    """Plans whose buffers would hold more than 8x the bytes of every key of the store
    go, the oldest first; a loop over every key, a plan per bucket, keeps them all."""
    rounds = _plan_cache({k: (250,) for k in "abcd"})  # 4 keys of 1000 bytes
    buckets = [np.empty(2 * 250, np.float32) for _ in range(4)]  # 2x each key's bytes
    for _ in range(3):  # a loop over its buckets: every plan stays, made once
        plans = [rounds._planned((i,), lambda i=i: [buckets[i]]) for i in range(4)]
        assert [p[0] for p in plans] == buckets
    assert list(rounds._plans) == [(0,), (1,), (2,), (3,)]
    for i in range(4, 20):  # ever other sets: at most 32,000 bytes of plans
        rounds._planned((i,), lambda: [np.empty(4 * 250, np.float32)])
        assert sum(rounds._plan_bytes.values()) <= 8 * 4000
    assert (3,) not in rounds._plans and (19,) in rounds._plans
