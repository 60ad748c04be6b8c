"""Checkpoints well-formed on the wire but wrong inside: every section is checked before
anything is applied, so such a file raises CheckpointError and changes nothing (values,
optimizer options, multipliers, schedule, states, counts), and the store's next push gives
what it would have given; and a load that succeeds leaves a store whose pushes work."""
from __future__ import annotations

import copy
import io
import zipfile

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv.checkpoints.checkpoint import read_archive, write_archive

KEYS = [1, 2, 3]
SHAPES = [(2, 3), (4,), (5,)]
DTYPES = [np.float32, np.float16, np.float32]  # key 2 keeps a float32 master copy


def _grads(step):
    rng = np.random.default_rng(step)
    return [rng.standard_normal(s).astype(d) for s, d in zip(SHAPES, DTYPES)]


def _store(opt=None, steps=3, values=None):
    """A store trained `steps` pushes by Adam with a schedule and per-key multipliers
    (or by `opt`), starting from `values` (default: fixed ones)."""
    kv = gpukv.create("local")
    if values is None:
        values = [np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d)
                  for s, d in zip(SHAPES, DTYPES)]
    kv.init(KEYS, values)
    if opt is None:
        opt = optim.Adam(learning_rate=0.05, wd=1e-3,
                         lr_scheduler=optim.FactorScheduler(step=2, factor=0.5))
        opt.set_lr_mult({1: 0.5})
        opt.set_wd_mult({3: 2.0})
    kv.set_optimizer(opt)
    for step in range(steps):
        kv.push(KEYS, _grads(step))
    return kv


def _values(kv):
    outs = [np.empty(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    return outs


def _fingerprint(kv):
    """Everything a load may change: values, and the optimizer's options, multipliers,
    schedule, states and update counts (its whole export)."""
    header, arrays = kv._updater.export_state(dump_optimizer=True)
    return ([v.tobytes() for v in _values(kv)], header,
            {k: (a.dtype.str, a.shape, a.tobytes()) for k, a in arrays.items()})


class _Optimizer:
    """The optimizer part of a checkpoint being crafted: its header and its arrays."""

    def __init__(self, header, arrays, prefix, names):
        self.header, self.arrays, self.prefix, self.names = header, arrays, prefix, names

    def __getitem__(self, name):
        return self.arrays[self.prefix + name]

    def __setitem__(self, name, array):
        if self.names is not None and name not in self.names:
            self.names.append(name)
        self.arrays[self.prefix + name] = array


@pytest.fixture(params=["optimizer_states", "store"])
def door(request, tmp_path):
    """(a file from a trained store, load(kv, path), craft(edit) -> path of an edited copy).

    'optimizer_states': save_optimizer_states(dump_optimizer=True) / load_optimizer_states.
    'store': save / load, the file's optimizer section given the options, multipliers and
    schedule a dump holds (a whole-store save leaves them out; a load applies them).
    """
    kv = _store()
    path = tmp_path / "source.npz"
    if request.param == "optimizer_states":
        kv.save_optimizer_states(path, dump_optimizer=True)

        def load(store, p):
            store.load_optimizer_states(p)

        def parts(header, arrays):
            return _Optimizer(header, arrays, "", None)
    else:
        kv.save(path)
        dumped = kv._updater.export_state(dump_optimizer=True)[0]
        header, arrays = read_archive(path)
        for name in ("options", "lr_mult", "wd_mult", "lr_scheduler"):
            header["optimizer"]["header"][name] = dumped[name]
        write_archive(path, header, arrays)

        def load(store, p):
            store.load(p)

        def parts(header, arrays):
            section = header["optimizer"]
            return _Optimizer(section["header"], arrays, "optimizer/", section["arrays"])
    count = iter(range(1000))

    def craft(edit):
        header, arrays = read_archive(path)
        edit(parts(header, arrays))
        out = tmp_path / f"crafted{next(count)}.npz"
        write_archive(out, header, arrays)
        return out

    return path, load, craft


def _set(*where_value):
    """An edit setting header[...][...] = value along a path of keys and indexes."""
    *where, value = where_value

    def edit(o):
        node = o.header
        for step in where[:-1]:
            node = node[step]
        node[where[-1]] = value
    return edit


def _delete(*where):
    def edit(o):
        node = o.header
        for step in where[:-1]:
            node = node[step]
        del node[where[-1]]
    return edit


def _array(state, make, master=False):
    """An edit replacing `state` of the last key (`master`: of the key with a master copy)
    by `make(array)`."""
    def edit(o):
        entries = o.header["keys"]
        i = next(i for i in reversed(range(len(entries)))
                 if not master or entries[i]["master"])
        o[f"state/{i}/{state}"] = make(o[f"state/{i}/{state}"])
    return edit


def _duplicate_first_key(o):
    o.header["keys"].append(copy.deepcopy(o.header["keys"][0]))
    last = len(o.header["keys"]) - 1
    for state in ("mean", "var"):
        o[f"state/{last}/{state}"] = o[f"state/0/{state}"].copy()


CRAFTED = {
    # per-key multipliers that are not numbers >= 0
    "lr_mult_text": _set("lr_mult", 0, "mult", "0.5"),
    "lr_mult_null": _set("lr_mult", 0, "mult", None),
    "lr_mult_negative": _set("lr_mult", 0, "mult", -1.0),
    "lr_mult_bool": _set("lr_mult", 0, "mult", True),
    "lr_mult_not_a_list": _set("lr_mult", {"1": 0.5}),
    "wd_mult_text": _set("wd_mult", 0, "mult", "2"),
    "wd_mult_key_kind": _set("wd_mult", 0, "key_kind", "float"),
    # schedules with missing, unknown or wrong-typed attributes
    "schedule_missing_count": _delete("lr_scheduler", "attrs", "count"),
    "schedule_missing_base_lr": _delete("lr_scheduler", "attrs", "base_lr"),
    "schedule_step_text": _set("lr_scheduler", "attrs", "step", "2"),
    "schedule_step_zero": _set("lr_scheduler", "attrs", "step", 0),
    "schedule_factor_above_one": _set("lr_scheduler", "attrs", "factor", 2.0),
    "schedule_base_lr_list": _set("lr_scheduler", "attrs", "base_lr", [0.1]),
    "schedule_mode": _set("lr_scheduler", "attrs", "warmup_mode", "cubic"),
    "schedule_unknown_attr": _set("lr_scheduler", "attrs", "surprise", 1),
    "schedule_unknown_class": _set("lr_scheduler", "class", "StepScheduler"),
    "schedule_count_far_behind": _set("num_update", 10 ** 12),
    "schedule_not_a_dict": _set("lr_scheduler", ["FactorScheduler"]),
    # optimizer options
    "option_unknown": _set("options", "momentum", 0.9),
    "option_text": _set("options", "beta1", "0.9"),
    "option_out_of_range": _set("options", "beta2", 1.5),
    "options_not_a_dict": _set("options", [0.05]),
    # counts
    "num_update_text": _set("num_update", "3"),
    "num_update_negative": _set("num_update", -1),
    "count_float": _set("keys", 2, "count", 2.5),
    "counts_null": _set("counts", 0, "count", None),
    "counts_not_a_list": _set("counts", {"1": 3}),
    # per-key states (the last key: an early key applied first would show)
    "state_shape": _array("mean", lambda a: np.zeros(7, a.dtype)),
    "state_dtype": _array("var", lambda a: a.astype(np.float64)),
    "master_shape": _array("master", lambda a: a[:-1], master=True),
    "master_dtype": _array("master", lambda a: a.astype(np.float16), master=True),
    "master_flag_text": _set("keys", 1, "master", "yes"),
    "state_names": _set("keys", 2, "states", ["mean"]),
    "key_not_in_store": _set("keys", 2, "key", 99),
    "key_kind": _set("keys", 2, "key_kind", "str"),
    "key_twice": _duplicate_first_key,
    "keys_not_a_list": _set("keys", {"key": 1}),
}


@pytest.mark.parametrize("crafted", CRAFTED)
def test_crafted_file_changes_nothing(door, crafted):
    """A file wrong inside raises CheckpointError; the store is exactly as before and its
    next push gives what an untouched twin's push gives."""
    path, load, craft = door
    bad = craft(CRAFTED[crafted])
    kv, twin = _store(), _store()
    optimizer = kv._optimizer
    before = _fingerprint(kv)
    with pytest.raises(gpukv.CheckpointError):
        load(kv, bad)
    assert kv._optimizer is optimizer
    assert _fingerprint(kv) == before
    for step in (3, 4):
        kv.push(KEYS, _grads(step))
        twin.push(KEYS, _grads(step))
    assert _fingerprint(kv) == _fingerprint(twin)


def test_unedited_file_loads_and_resumes(door):
    """The control: the file the crafted ones start from loads into a fresh store, which
    then pushes exactly as the store that saved it."""
    path, load, craft = door
    same = craft(lambda o: None)
    kv = _store()
    fresh = _store(optim.Adam(), steps=0, values=_values(kv))  # as if loaded before
    load(fresh, same)
    assert _fingerprint(fresh) == _fingerprint(kv)
    for step in (3, 4):
        kv.push(KEYS, _grads(step))
        fresh.push(KEYS, _grads(step))
    assert _fingerprint(fresh) == _fingerprint(kv)


def test_dumped_options_decide_the_states_a_load_expects(tmp_path):
    """A file saved with dump_optimizer=True by SGD with momentum loads into a store whose
    SGD has none: the file's options (momentum) are checked and applied with its states,
    and the store then pushes as the one that saved it."""
    src = _store(optim.SGD(learning_rate=0.1, momentum=0.9))
    src.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    kv = _store(optim.SGD(learning_rate=0.1), steps=0, values=_values(src))
    kv.load_optimizer_states(tmp_path / "s")
    assert kv._optimizer.momentum == 0.9
    for step in (3, 4):
        src.push(KEYS, _grads(step))
        kv.push(KEYS, _grads(step))
    assert _fingerprint(kv) == _fingerprint(src)


def test_options_that_drop_a_state_the_file_holds(tmp_path):
    """Options saying momentum 0 beside momentum states in the file are refused: applied,
    they would leave states no update uses (or, the other way round, none it needs)."""
    src = _store(optim.SGD(learning_rate=0.1, momentum=0.9))
    src.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    header, arrays = read_archive(tmp_path / "s")
    header["options"]["momentum"] = 0.0
    write_archive(tmp_path / "t", header, arrays)
    kv = _store(optim.SGD(learning_rate=0.1, momentum=0.9))
    before = _fingerprint(kv)
    with pytest.raises(gpukv.CheckpointError, match="mom"):
        kv.load_optimizer_states(tmp_path / "t")
    assert _fingerprint(kv) == before


@pytest.mark.parametrize("schedule", [
    optim.FactorScheduler(step=2, factor=0.5, warmup_steps=2, warmup_begin_lr=0.01),
    optim.MultiFactorScheduler(step=[2, 4], factor=0.5),
    optim.PolyScheduler(max_update=10, pwr=2, final_lr=0.001),
    optim.CosineScheduler(max_update=10, warmup_steps=2, warmup_mode="constant")],
    ids=lambda s: type(s).__name__)
def test_every_schedule_round_trips(tmp_path, schedule):
    """Each schedule gpukv restores passes the checks and resumes the learning rates."""
    opt = optim.Adam(learning_rate=0.05, lr_scheduler=copy.deepcopy(schedule))
    src = _store(opt)
    src.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    kv = _store(optim.Adam(), steps=0, values=_values(src))
    kv.load_optimizer_states(tmp_path / "s")
    assert type(kv._optimizer.lr_scheduler) is type(schedule)
    for step in range(3, 9):
        src.push(KEYS, _grads(step))
        kv.push(KEYS, _grads(step))
        assert kv._optimizer.learning_rate == src._optimizer.learning_rate
    assert _fingerprint(kv) == _fingerprint(src)


# ---------------------------------------------------------------- int keys in headers
def _rewrite_json(src, out, change):
    """A copy of archive `src` whose JSON header text is `change(text)` (other members
    as they are): for numbers json.dumps would refuse to write."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "__gpukv__.npy":
                text = np.lib.format.read_array(io.BytesIO(data)).tobytes().decode()
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.frombuffer(change(text).encode(), np.uint8))
                data = buf.getvalue()
            zout.writestr(info, data)
    return out


def _store_file(tmp_path, keys):
    """A store checkpoint whose header lists `keys` (texts) for int keys."""
    write_archive(tmp_path / "keys.npz",
                  {"kind": "gpukv.api.store", "version": 1, "key_kind": "int", "keys": keys,
                   "homes": ["cpu"] * len(keys), "optimizer": None},
                  {f"value/{i}": np.zeros(2, np.float32) for i in range(len(keys))})
    return tmp_path / "keys.npz"


@pytest.mark.parametrize("text", ["9" * 5000, "-" + "1" * 4301, "1_000", " 7", "+3", "07",
                                  "-0", "\u0663", "0x10", "1e3", ""],
                         ids=["5000-digits", "4301-digits", "underscore", "space", "plus",
                              "leading-zero", "minus-zero", "arabic-digit", "hex", "exp",
                              "empty"])
def test_int_keys_of_a_file_are_plain_decimals(tmp_path, text):
    """An int key in a store header is a plain decimal Python can read back (no huge,
    padded, signed, underscored or non-ASCII forms): anything else is a CheckpointError
    (never a bare ValueError) and the store is left as it was."""
    path = _store_file(tmp_path, ["5", text])
    kv = gpukv.create("local")
    kv.init(5, np.ones(2, np.float32))
    with pytest.raises(gpukv.CheckpointError, match="int key"):
        kv.load(path)
    out = np.zeros(2, np.float32)
    kv.pull(5, out=out)
    assert out.tolist() == [1.0, 1.0]
    with pytest.raises(gpukv.UnknownKeyError):
        kv.pull(7, out=out)


@pytest.mark.parametrize("door", ["optimizer_states", "store"])
def test_huge_int_key_in_optimizer_header(tmp_path, door):
    """A key of 5000 digits in an optimizer-state header (a JSON number Python will not
    read) is a CheckpointError, not a ValueError."""
    kv = _store(steps=1)
    if door == "store":
        kv.save(tmp_path / "s")
    else:
        kv.save_optimizer_states(tmp_path / "s")
    bad = _rewrite_json(tmp_path / "s", tmp_path / "t",
                        lambda text: text.replace('"key":3,', '"key":' + "3" * 5000 + ",", 1))
    assert b"3" * 5000 in bad.read_bytes()
    load = kv.load if door == "store" else kv.load_optimizer_states
    with pytest.raises(gpukv.CheckpointError):
        load(bad)


def test_saving_a_key_too_long_to_write(tmp_path):
    """A key Python cannot write in decimal is a CheckpointError before any file exists."""
    from gpukv.checkpoints.checkpoint import StoreSnapshot, save_store

    snapshot = StoreSnapshot("local", int, [(10 ** 5000, np.zeros(2), "cpu")], None)
    with pytest.raises(gpukv.CheckpointError, match="too many digits"):
        save_store(snapshot, tmp_path / "ck.npz")
    assert list(tmp_path.iterdir()) == []
