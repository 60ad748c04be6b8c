"""A model-based test: random init/push/pull/pushpull/broadcast/set_updater sequences on a store,
with 2bit-compressed and row-sparse pushes and failing calls among them, never diverge from a
plain dict of NumPy arrays; a failing call changes nothing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import gpukv

from ..strategies import DTYPES, SHAPES, device_values, keys_of, small_ints

UPDATERS = {
    "sum": (lambda key, merged, stored: stored.__iadd__(merged), lambda s, m: s + m),
    "scaled": (lambda key, merged, stored: stored.__isub__(merged * 0.5), lambda s, m: s - m * 0.5),
}


class StoreMachine(RuleBasedStateMachine):
    """Drives one gpukv store and a dict-of-NumPy model side by side."""

    @initialize(name=st.sampled_from(["local", "device"]), kind=st.sampled_from(["int", "str"]),
                strategy=st.sampled_from([None, "home", "tree", "ring", "cpu"]))
    def create(self, name, kind, strategy):
        self.kv = gpukv.create(name, strategy=strategy)
        self.kind = kind
        self.model: dict = {}
        self.dtypes: dict = {}
        self.update = None  # None: assign
        self.threshold = None  # 2bit compression's threshold, once set
        self.residuals: dict = {}  # (key, device slot) -> the model's 2bit residual

    # ------------------------------------------------------------------ helpers
    def _fresh_keys(self, data, n):
        keys = data.draw(st.lists(keys_of(self.kind), min_size=1, max_size=n, unique=True))
        return [k for k in keys if k not in self.model]

    def _known(self, data, max_size=3):
        """Existing keys, possibly repeated, as (keys, as_list)."""
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model, key=repr)),
                                  min_size=1, max_size=max_size))
        as_list = len(keys) > 1 or data.draw(st.booleans())
        return keys, as_list

    def _values(self, data, key):
        """One key's value as an array or a device list, and the arrays it holds."""
        shape = self.model[key].shape
        arrays = data.draw(device_values(shape, self.dtypes[key]))
        if len(arrays) == 1 and data.draw(st.booleans()):
            return arrays[0], arrays
        return arrays, arrays

    def _outs(self, data, key):
        shape = self.model[key].shape
        n = data.draw(st.integers(1, 3))
        outs = [np.full(shape, -99, self.dtypes[key]) for _ in range(n)]
        if n == 1 and data.draw(st.booleans()):
            return outs[0], outs
        return outs, outs

    def _decoded(self, key, arrays):
        """What the store sums for `key`: the arrays, or their 2bit codes with compression."""
        if self.threshold is None:
            return [a.astype(np.float64) for a in arrays]
        t, out = self.threshold, []
        for slot, a in enumerate(arrays):  # the n-th array of a key is on host device n
            q = self.residuals.get((key, slot), 0.0) + a.astype(np.float64)
            code = np.where(q >= t, t, np.where(q <= -t, -t, 0.0))
            self.residuals[(key, slot)] = q - code
            out.append(code)
        return out

    def _apply(self, key, arrays):
        merged = np.sum(self._decoded(key, arrays), axis=0)
        self._apply_merged(key, merged)

    def _apply_merged(self, key, merged):
        if self.update is None:
            self.model[key] = merged
        else:
            self.model[key] = UPDATERS[self.update][1](self.model[key], merged)

    def _check_outs(self, key, outs):
        for o in outs:
            assert o.tolist() == self.model[key].astype(self.dtypes[key]).tolist(), key

    # -------------------------------------------------------------------- rules
    @rule(data=st.data(), as_devices=st.booleans())
    def init(self, data, as_devices):
        keys = self._fresh_keys(data, 3)
        if not keys:
            return
        values, firsts = [], []
        for _ in keys:
            shape, dtype = data.draw(SHAPES), data.draw(DTYPES)
            first = data.draw(small_ints(shape, dtype))
            firsts.append(first)
            values.append([first, data.draw(small_ints(shape, dtype))] if as_devices else first)
        if len(keys) == 1 and data.draw(st.booleans()):
            self.kv.init(keys[0], values[0])
        else:
            self.kv.init(keys, values)
        for k, first in zip(keys, firsts):
            self.model[k] = first.astype(np.float64)
            self.dtypes[k] = first.dtype
        for v in values:  # the store copied them
            for a in (v if isinstance(v, list) else [v]):
                a[...] = 77

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def push(self, data):
        keys, as_list = self._known(data)
        per_key: dict = {}
        values = []
        for k in keys:
            value, arrays = self._values(data, k)
            values.append(value)
            per_key.setdefault(k, []).extend(arrays)
        self.kv.push(keys if as_list else keys[0], values if as_list else values[0])
        for k, arrays in per_key.items():
            self._apply(k, arrays)
        for arrays in per_key.values():  # no aliasing: the caller may reuse its arrays
            for a in arrays:
                a[...] = 55

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pull(self, data):
        keys, as_list = self._known(data)
        outs, flat = [], []
        for k in keys:
            out, arrays = self._outs(data, k)
            outs.append(out)
            flat.append((k, arrays))
        self.kv.pull(keys if as_list else keys[0], out=outs if as_list else outs[0])
        for k, arrays in flat:
            self._check_outs(k, arrays)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), with_out=st.booleans())
    def pushpull(self, data, with_out):
        keys, as_list = self._known(data)
        per_key: dict = {}
        values, outs, written = [], [], []
        for k in keys:
            value, arrays = self._values(data, k)
            values.append(value)
            per_key.setdefault(k, []).extend(arrays)
            if with_out:
                out, out_arrays = self._outs(data, k)
                outs.append(out)
                written.append((k, out_arrays))
            else:
                written.append((k, arrays))
        key_arg = keys if as_list else keys[0]
        value_arg = values if as_list else values[0]
        pushed = {k: [a.copy() for a in arrays] for k, arrays in per_key.items()}
        if with_out:
            self.kv.pushpull(key_arg, value_arg, out=outs if as_list else outs[0])
        else:
            self.kv.pushpull(key_arg, value_arg)
        for k, arrays in pushed.items():
            self._apply(k, arrays)
        for k, arrays in written:
            self._check_outs(k, arrays)

    @rule(data=st.data())
    def broadcast(self, data):
        keys = self._fresh_keys(data, 2)
        if not keys:
            return
        values, outs = [], []
        for k in keys:
            value = data.draw(small_ints(data.draw(SHAPES), data.draw(DTYPES)))
            values.append(value)
            n = data.draw(st.integers(1, 3))
            outs.append([np.full(value.shape, -99, value.dtype) for _ in range(n)])
        self.kv.broadcast(keys, values, out=outs)
        for k, value, out in zip(keys, values, outs):
            self.model[k] = value.astype(np.float64)
            self.dtypes[k] = value.dtype
            self._check_outs(k, out)

    @rule(which=st.sampled_from(sorted(UPDATERS)))
    def set_updater(self, which):
        self.kv.set_updater(UPDATERS[which][0])
        self.update = which

    @precondition(lambda self: self.kv.type == "device")
    @rule()
    def set_compression(self):
        self.kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        self.threshold = 0.5
        self.residuals = {}  # setting it again starts fresh residuals

    def _row_keys(self):
        return sorted((k for k, v in self.model.items() if v.ndim >= 1 and v.shape[0]),
                      key=repr)

    def _rows_value(self, data, key):
        """One RowSparse of `key` (ids may repeat) and its dense sum."""
        shape = self.model[key].shape
        ids = np.array(data.draw(st.lists(st.integers(0, shape[0] - 1), max_size=4)), np.int64)
        rows = data.draw(small_ints((len(ids),) + shape[1:], self.dtypes[key]))
        dense = np.zeros(shape, np.float64)
        np.add.at(dense, ids, rows.astype(np.float64))
        return gpukv.RowSparse(ids, rows, shape), dense

    @precondition(lambda self: self._row_keys())
    @rule(data=st.data())
    def push_rows(self, data):
        keys = data.draw(st.lists(st.sampled_from(self._row_keys()), min_size=1, max_size=3,
                                  unique=True))
        values, merged = [], {}
        for k in keys:
            n = data.draw(st.integers(1, 3))
            pairs = [self._rows_value(data, k) for _ in range(n)]
            values.append([rs for rs, _ in pairs] if n > 1 else pairs[0][0])
            merged[k] = np.sum([d for _, d in pairs], axis=0)
        self.kv.push(keys, values)
        for k in keys:  # row-sparse keys are never compressed
            self._apply_merged(k, merged[k])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), bad=st.sampled_from(["shape", "dtype", "rows", "mixed", "unknown"]),
          first=st.booleans())
    def failing_push_changes_nothing(self, data, bad, first):
        """A push with one bad part among good ones raises and leaves every key (and every
        compression residual) as it was."""
        keys, _ = self._known(data, max_size=3)
        keys = list(dict.fromkeys(keys))
        values = [np.ones(self.model[k].shape, self.dtypes[k]) for k in keys]
        row_keys = self._row_keys()
        if bad == "shape":
            bad_key, bad_value = keys[0], np.ones(self.model[keys[0]].shape + (2,), np.float32)
        elif bad == "dtype":
            bad_key, bad_value = keys[0], np.ones(self.model[keys[0]].shape, np.complex64)
        elif bad in ("rows", "mixed") and row_keys:
            bad_key = data.draw(st.sampled_from(row_keys))
            rows, _ = self._rows_value(data, bad_key)
            if bad == "rows":
                rows = gpukv.RowSparse([0], np.ones((1,) + self.model[bad_key].shape[1:],
                                                    self.dtypes[bad_key]), rows.shape)
                rows.indices[0] = self.model[bad_key].shape[0]  # edited after it was built
                bad_value = rows
            else:
                bad_value = [rows, np.ones(self.model[bad_key].shape, self.dtypes[bad_key])]
        else:
            bad_key = data.draw(keys_of(self.kind))
            if bad_key in self.model:
                return
            bad_value = np.zeros(3, np.float32)
        if bad_key in keys:
            i = keys.index(bad_key)
            del keys[i], values[i]
        keys = [bad_key] + keys if first else keys + [bad_key]
        values = [bad_value] + values if first else values + [bad_value]
        with pytest.raises(gpukv.GpukvError):
            self.kv.push(keys, values)

    @rule(data=st.data())
    def push_unknown_key_changes_nothing(self, data):
        key = data.draw(keys_of(self.kind))
        if key in self.model:
            return
        known = sorted(self.model, key=repr)[:1]
        with pytest.raises(gpukv.UnknownKeyError):
            self.kv.push(known + [key], [np.zeros(self.model[k].shape, self.dtypes[k])
                                         for k in known] + [np.zeros(3, np.float32)])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def push_bad_shape_changes_nothing(self, data):
        keys, _ = self._known(data, max_size=2)
        values = [np.ones(self.model[k].shape, self.dtypes[k]) for k in keys]
        values[-1] = np.ones(self.model[keys[-1]].shape + (2,), self.dtypes[keys[-1]])
        with pytest.raises(gpukv.ShapeError):
            self.kv.push(keys, values)

    @precondition(lambda self: self.model)
    @rule()
    def other_key_kind_is_refused(self):
        with pytest.raises(gpukv.KeyKindError):
            self.kv.push("zz" if self.kind == "int" else 5, np.zeros(3, np.float32))

    @invariant()
    def store_matches_model(self):
        for k, expected in getattr(self, "model", {}).items():
            out = np.full(expected.shape, -99, self.dtypes[k])
            self.kv.pull(k, out=out)
            assert out.tolist() == expected.astype(self.dtypes[k]).tolist(), k


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.__doc__ = "Random call sequences never make the store diverge from the model."
