"""Record MXNet 1.9.1's answers for the core KVStore API into mxnet_reference.json.

Run under an MXNet interpreter (CPU is enough):

    /path/to/mxenv/bin/python tests/data/make_mxnet_reference.py

The output is deterministic (fixed seeds, small float32 integers, shapes of a few
elements), so re-running it rewrites the same file. The test suite replays what is
recorded here on gpukv and needs no MXNet.
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import mxnet as mx
import numpy as np

SHAPE = (2, 3)
SEQ_SHAPE = (2, 2)
HERE = os.path.dirname(os.path.abspath(__file__))


def arr(x):
    return x.asnumpy().tolist()


def first(x):
    return float(x.asnumpy().ravel()[0])


def mx_error(fn):
    """Whether fn raises, and the exception class name MXNet uses."""
    try:
        fn()
        mx.nd.waitall()
    except Exception as exc:  # MXNetError, AssertionError, OverflowError ...
        return type(exc).__name__
    return None


# ------------------------------------------------------------------ the tutorial
def tutorial():
    values, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        kv = mx.kv.create("local")
        shape = SHAPE
        kv.init(3, mx.nd.ones(shape) * 2)
        a = mx.nd.zeros(shape)
        kv.pull(3, out=a)
        values["after_init"] = arr(a)
        kv.push(3, mx.nd.ones(shape) * 8)
        kv.pull(3, out=a)
        values["after_push"] = arr(a)
        b = [mx.nd.ones(shape, ctx=mx.cpu(i)) for i in range(4)]
        kv.push(3, b)
        kv.pull(3, out=a)
        values["after_device_push"] = arr(a)

        def update(key, input, stored):
            print(f"update on key: {key}")
            stored += input * 2

        kv._set_updater(update)
        kv.pull(3, out=a)
        values["after_set_updater"] = arr(a)
        kv.push(3, mx.nd.ones(shape))
        kv.pull(3, out=a)
        values["after_updater_push"] = arr(a)
        b = [mx.nd.ones(shape, ctx=mx.cpu(i)) for i in range(4)]
        kv.pull(3, out=b)
        values["pull_to_devices"] = [arr(x) for x in b]
        keys = [5, 7, 9]
        kv.init(keys, [mx.nd.ones(shape)] * len(keys))
        kv.push(keys, [mx.nd.ones(shape)] * len(keys))
        b = [mx.nd.zeros(shape) for _ in keys]
        kv.pull(keys, out=b)
        values["list_pull"] = [arr(x) for x in b]
        b = [[mx.nd.ones(shape, ctx=mx.cpu(i)) for i in range(4)] for _ in keys]
        kv.push(keys, b)
        kv.pull(keys, out=b)
        values["list_device_pull"] = [[arr(x) for x in row] for row in b]
    return {"shape": list(SHAPE), "values": values,
            "printed": printed.getvalue().splitlines()}


# ------------------------------------------- MXNet's own tests/python/unittest/test_kvstore.py
def kvstore_unittests():
    shape, keys, str_keys = (4, 4), [5, 7, 11], ["b", "c", "d"]
    out = {}

    def init_kv(name, use_str):
        kv = mx.kv.create(name)
        if use_str:
            kv.init("a", mx.nd.zeros(shape))
            kv.init(str_keys, [mx.nd.zeros(shape)] * len(str_keys))
            return kv, "a", str_keys
        kv.init(3, mx.nd.zeros(shape))
        kv.init(keys, [mx.nd.zeros(shape)] * len(keys))
        return kv, 3, keys

    for name in ("local", "device"):
        for use_str in (False, True):
            tag = f"{name}/{'str' if use_str else 'int'}"
            devs = [mx.cpu(i) for i in range(4)]
            # single
            kv, key, key_list = init_kv(name, use_str)
            kv.push(key, mx.nd.ones(shape))
            val = mx.nd.empty(shape)
            kv.pull(key, out=val)
            out[f"single/{tag}"] = first(val)
            # init
            kv2 = mx.kv.create(name)
            kv2.init(key, mx.nd.ones(shape) * 4)
            a = mx.nd.zeros(shape)
            kv2.pull(key, out=a)
            out[f"init/{tag}"] = first(a)
            # list
            kv.push(key_list, [mx.nd.ones(shape) * 4] * len(key_list))
            val = [mx.nd.empty(shape) for _ in key_list]
            kv.pull(key_list, out=val)
            out[f"list/{tag}"] = [first(v) for v in val]
            # aggregator
            kv, key, key_list = init_kv(name, use_str)
            vals = [mx.nd.ones(shape, d) for d in devs]
            kv.push(key, vals)
            kv.pull(key, out=vals)
            agg_single = [first(v) for v in vals]
            vals = [[mx.nd.ones(shape, d) * 2.0 for d in devs] for _ in key_list]
            kv.push(key_list, vals)
            kv.pull(key_list, out=vals)
            out[f"aggregator/{tag}"] = {"single": agg_single,
                                        "list": [[first(v) for v in vv] for vv in vals]}
            # updater (+=), four pushes of four devices
            kv, key, key_list = init_kv(name, use_str)

            def updater(k, recv, local):
                local += recv

            kv._set_updater(updater)
            vals = [mx.nd.ones(shape, d) for d in devs]
            kv.push(key, vals)
            kv.pull(key, out=vals)
            upd_single = [first(v) for v in vals]
            vals = [[mx.nd.ones(shape, d) for d in devs] for _ in key_list]
            for _ in range(4):
                kv.push(key_list, vals)
            kv.pull(key_list, out=vals)
            out[f"updater/{tag}"] = {"single": upd_single,
                                     "list": [[first(v) for v in vv] for vv in vals]}
            # broadcast and pushpull (the dist tests' forms, on one machine)
            kv = mx.kv.create(name)
            bkeys = ["10", "11", "12"] if use_str else [10, 11, 12]
            val = [mx.nd.zeros(shape) for _ in bkeys]
            for i, k in enumerate(bkeys):
                kv.broadcast(k, [mx.nd.ones(shape) * i], out=val[i])
            out[f"broadcast/{tag}"] = [first(v) for v in val]
            arrs = [mx.nd.ones(shape, ctx=d) * (j + 1) for j, d in enumerate(devs)]
            kv.pushpull(bkeys[0], arrs)
            out[f"pushpull/{tag}"] = [first(v) for v in arrs]
    for kvtype in ("local", "device", "local_allreduce_cpu", "local_update_cpu",
                   "local_allreduce_device"):
        out[f"get_type/{kvtype}"] = mx.kv.create(kvtype).type
    return out


# ------------------------------------------------------- single behaviours, settled
def behaviours():
    shape = SHAPE
    out = {}
    calls = []

    def record(key, merged, stored):
        calls.append(key.decode() if isinstance(key, bytes) else key)
        stored += merged

    for name in ("local", "device"):
        kv = mx.kv.create(name)
        kv.init([9, 2, 5], [mx.nd.zeros(shape)] * 3)
        kv._set_updater(record)
        calls.clear()
        kv.push([9, 2, 5], [mx.nd.ones(shape) * v for v in (1, 2, 3)])
        out[f"updater_order_int/{name}"] = list(calls)
        calls.clear()
        kv.push([5, 9, 5], [mx.nd.ones(shape) * v for v in (1, 2, 3)])
        out[f"updater_order_repeated/{name}"] = list(calls)
        a = mx.nd.zeros(shape)
        kv.pull(5, out=a)
        out[f"repeated_key_push_sum/{name}"] = first(a)
        kv = mx.kv.create(name)
        kv.init(["z", "a"], [mx.nd.zeros(shape)] * 2)
        kv._set_updater(record)
        calls.clear()
        kv.push(["z", "a"], [mx.nd.ones(shape), mx.nd.ones(shape)])
        out[f"updater_order_str/{name}"] = list(calls)

    kv = mx.kv.create("local")
    kv.init(1, mx.nd.ones(shape))
    v = [mx.nd.ones(shape, ctx=mx.cpu(i)) * (i + 1) for i in range(3)]
    kv.pushpull(1, v)
    out["pushpull_in_place"] = [first(x) for x in v]
    o = [mx.nd.zeros(shape, ctx=mx.cpu(i)) for i in range(2)]
    v = [mx.nd.ones(shape, ctx=mx.cpu(i)) * (i + 1) for i in range(3)]
    kv.pushpull(1, v, out=o)
    out["pushpull_with_out"] = {"out": [first(x) for x in o], "value": [first(x) for x in v]}
    kv._set_updater(lambda k, m, s: s.__iadd__(m))
    v = mx.nd.ones(shape) * 10
    kv.pushpull(1, v)
    out["pushpull_with_updater"] = first(v)
    o = [mx.nd.zeros(shape), mx.nd.zeros(shape)]
    kv.pull([1, 1], out=o)
    out["repeated_key_pull"] = [first(x) for x in o]

    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones(shape) * 2)
    out["broadcast_existing_key_error"] = mx_error(
        lambda: kv.broadcast(3, mx.nd.ones(shape) * 7, out=mx.nd.zeros(shape)))
    out["duplicate_init_error"] = mx_error(lambda: kv.init(3, mx.nd.ones(shape)))
    a = mx.nd.zeros(shape)
    kv.pull(3, out=a)
    out["value_after_failed_init"] = first(a)
    out["unknown_push_error"] = mx_error(lambda: kv.push(99, mx.nd.ones(shape)))
    out["unknown_pull_error"] = mx_error(lambda: kv.pull(99, out=mx.nd.zeros(shape)))
    out["mixed_kinds_across_calls_error"] = mx_error(lambda: kv.init("a", mx.nd.ones(shape)))
    # MXNet reports a bad shape only when the engine runs the copy, so use a scratch store.
    scratch = mx.kv.create("local")
    scratch.init(3, mx.nd.ones(shape))
    out["push_shape_error"] = mx_error(
        lambda: (scratch.push(3, mx.nd.ones((3, 2))), scratch.pull(3, out=mx.nd.zeros(shape))))
    out["mixed_kinds_one_call_error"] = mx_error(
        lambda: mx.kv.create().init([1, "a"], [mx.nd.ones(shape)] * 2))
    out["key_2_31_error"] = mx_error(lambda: mx.kv.create().init(2 ** 31, mx.nd.ones(shape)))
    out["init_device_list_error"] = mx_error(
        lambda: mx.kv.create().init(1, [mx.nd.ones(shape), mx.nd.ones(shape)]))
    casts = {}
    for dtype in ("float64", "float16", "int32", "uint8"):
        o = mx.nd.zeros(shape, dtype=dtype)
        kv.pull(3, out=o)
        casts[dtype] = o.asnumpy().tolist()
    out["pull_casts_to_out_dtype"] = casts
    o = [[mx.nd.zeros(shape, ctx=mx.cpu(i)) for i in range(2)] for _ in range(2)]
    kv.broadcast([20, 21], [mx.nd.ones(shape) * 1, mx.nd.ones(shape) * 2], out=o)
    out["broadcast_list"] = [[first(x) for x in row] for row in o]
    o = [mx.nd.zeros(shape), mx.nd.zeros(shape)]
    kv.broadcast(22, mx.nd.ones(shape) * 6, out=o)
    out["broadcast_one_to_list"] = [first(x) for x in o]

    x = mx.nd.ones(shape) * 3
    kv.init(30, x)
    x[:] = 100
    a = mx.nd.zeros(shape)
    kv.pull(30, out=a)
    out["init_copies"] = first(a)
    y = mx.nd.ones(shape) * 5
    kv.push(30, y)
    y[:] = 77
    kv.pull(30, out=a)
    out["push_aliases"] = first(a)  # MXNet keeps the pushed array; gpukv must not

    kv = mx.kv.create("local")
    kv.init(0, mx.nd.zeros(shape, dtype="float16"))
    big = [mx.nd.ones(shape, dtype="float16") * s for s in (60000, 60000, -60000, -60000)]
    kv.push(0, big)
    a = mx.nd.zeros(shape, dtype="float16")
    kv.pull(0, out=a)
    out["fp16_four_pushes"] = first(a)
    kv.push(0, big[:2])
    kv.pull(0, out=a)
    out["fp16_two_pushes"] = str(first(a))
    seen = []

    def halve(key, merged, stored):
        seen.append(np.dtype(merged.dtype).name)
        stored[:] = merged / 2

    kv._set_updater(halve)
    kv.push(0, big[:2])
    kv.pull(0, out=a)
    out["fp16_two_pushes_halved"] = {"value": str(first(a)), "merged_dtype": seen[0]}

    kv = mx.kv.create("local")
    kv.init(1, mx.nd.ones(shape))
    kv.push(1, [mx.nd.ones(shape) * 2, mx.nd.ones(shape) * 3])
    kv._set_updater(lambda k, m, s: s.__iadd__(m))
    kv.push(1, [mx.nd.ones(shape), mx.nd.ones(shape)])
    a = mx.nd.zeros(shape)
    kv.pull(1, out=a)
    out["updater_after_device_push"] = first(a)  # 5 + 2 is 7; MXNet's shared buffer gives 4

    kv = mx.kv.create("local")
    out["type_upper_case"] = mx.kv.create("LOCAL").type
    out["rank"], out["num_workers"] = kv.rank, kv.num_workers
    out["is_capable_optimizer"] = kv.is_capable("optimizer")
    out["is_capable_unknown_error"] = mx_error(lambda: kv.is_capable("foo"))
    return out


# ------------------------------------------------------------ random operation sequences
INT_KEYS = [0, 3, 17, 2 ** 31 - 1, 40, 41]
STR_KEYS = ["w", "b", "emb", "x1", "bias", "g"]


def enc(a):
    return a.asnumpy().astype(float).tolist()


def sequence(seed, name, key_kind, n_ops=24):
    rng = np.random.RandomState(seed)
    pool = list(INT_KEYS if key_kind == "int" else STR_KEYS)
    kv = mx.kv.create(name)
    known, fresh = [], list(pool)
    rng.shuffle(fresh)
    ops = []
    updater = None
    wanted_updater = [None, "sum", "scaled"][seed % 3]
    ndev = {}

    def rand_array(dev=0):
        return mx.nd.array(rng.randint(-3, 4, size=SEQ_SHAPE), ctx=mx.cpu(dev), dtype="float32")

    def rand_entry(arrays):
        """One key's value: {'a': array} or {'l': [arrays]} (one array: either form)."""
        if len(arrays) == 1 and rng.rand() < 0.5:
            return {"a": arrays[0]}
        return {"l": arrays}

    def to_mx(e):
        return e["a"] if "a" in e else e["l"]

    def to_json(e):
        return {"a": enc(e["a"])} if "a" in e else {"l": [enc(x) for x in e["l"]]}

    def out_entry():
        if rng.rand() < 0.5:
            return {"a": mx.nd.zeros(SEQ_SHAPE)}
        return {"l": [mx.nd.zeros(SEQ_SHAPE, ctx=mx.cpu(d)) for d in range(rng.randint(1, 4))]}

    def pick_keys():
        if rng.rand() < 0.35:
            return known[rng.randint(len(known))], False
        n = rng.randint(1, 4)
        return [known[rng.randint(len(known))] for _ in range(n)], True  # repeats allowed

    def push_entries():
        """Keys and values of one push. MXNet fixes the number of devices of a key at its
        first push (more later crashes it), so every push of a key brings ndev[key] arrays,
        split over two entries of the list when the key is repeated."""
        if rng.rand() < 0.35:
            key = known[rng.randint(len(known))]
            return key, False, [rand_entry([rand_array(d) for d in range(ndev[key])])]
        chosen = list(dict.fromkeys(known[rng.randint(len(known))]
                                    for _ in range(rng.randint(1, 4))))
        keys, entries = [], []
        for key in chosen:
            arrays = [rand_array(d) for d in range(ndev[key])]
            if len(arrays) >= 2 and rng.rand() < 0.4:
                cut = rng.randint(1, len(arrays))
                keys += [key, key]
                entries += [rand_entry(arrays[:cut]), rand_entry(arrays[cut:])]
            else:
                keys.append(key)
                entries.append(rand_entry(arrays))
        order = rng.permutation(len(keys))
        return [keys[i] for i in order], True, [entries[i] for i in order]

    for _ in range(n_ops):
        choices = ["init"] if not known else ["init", "push", "push", "pull", "pushpull",
                                              "broadcast"]
        if not fresh:
            choices = [c for c in choices if c not in ("init", "broadcast")]
        op = choices[rng.randint(len(choices))]
        if known and wanted_updater is not None and updater is None:
            # Before any push: MXNet's plain assign makes the stored value share memory
            # with its merge buffer, so an updater set after a push sees wrong values
            # (behaviours/updater_after_device_push); gpukv has no such sharing.
            op = "set_updater"
        if op in ("init", "broadcast"):
            n = min(len(fresh), rng.randint(1, 3))
            keys = [fresh.pop() for _ in range(n)]
            vals = [{"a": rand_array()} for _ in keys]
            as_list = n > 1 or rng.rand() < 0.5
            record = {"op": op, "key": keys if as_list else keys[0],
                      "value": [to_json(v) for v in vals] if as_list else to_json(vals[0])}
            if op == "init":
                kv.init(keys if as_list else keys[0],
                        [to_mx(v) for v in vals] if as_list else to_mx(vals[0]))
            else:
                outs = [out_entry() for _ in keys]
                kv.broadcast(keys if as_list else keys[0],
                             [to_mx(v) for v in vals] if as_list else to_mx(vals[0]),
                             out=[to_mx(o) for o in outs] if as_list else to_mx(outs[0]))
                record["out"] = [to_json(o) for o in outs] if as_list else to_json(outs[0])
            known.extend(keys)
            for k in keys:
                ndev[k] = rng.randint(1, 5)
        elif op == "set_updater":
            updater = wanted_updater
            if updater == "sum":
                kv._set_updater(lambda k, m, s: s.__iadd__(m))
            else:
                kv._set_updater(lambda k, m, s: s.__iadd__(m * 0.5))
            record = {"op": op, "updater": updater}
        else:
            if op == "pull":
                key, as_list = pick_keys()
            else:
                key, as_list, vals = push_entries()
            n = len(key) if as_list else 1
            record = {"op": op, "key": key}
            if op in ("push", "pushpull"):
                value = [to_mx(v) for v in vals] if as_list else to_mx(vals[0])
                record["value"] = [to_json(v) for v in vals] if as_list else to_json(vals[0])
            if op in ("pull", "pushpull"):
                use_out = op == "pull" or rng.rand() < 0.5
                if use_out:
                    outs = [out_entry() for _ in range(n)]
                    out = [to_mx(o) for o in outs] if as_list else to_mx(outs[0])
            if op == "push":
                kv.push(key, value)
            elif op == "pull":
                kv.pull(key, out=out)
                record["out"] = [to_json(o) for o in outs] if as_list else to_json(outs[0])
            else:
                if use_out:
                    kv.pushpull(key, value, out=out)
                    record["out"] = [to_json(o) for o in outs] if as_list else to_json(outs[0])
                else:
                    kv.pushpull(key, value)
                    record["value_after"] = ([to_json(v) for v in vals] if as_list
                                             else to_json(vals[0]))
        ops.append(record)
    final = {}
    for k in known:
        a = mx.nd.zeros(SEQ_SHAPE)
        kv.pull(k, out=a)
        final[str(k)] = enc(a)
    return {"seed": seed, "store": name, "key_kind": key_kind, "ops": ops, "final": final}


def main():
    ref = {
        "mxnet_version": mx.__version__,
        "tutorial": tutorial(),
        "kvstore_unittests": kvstore_unittests(),
        "behaviours": behaviours(),
        "sequences": [sequence(seed, name, kind)
                      for seed, (name, kind) in enumerate(
                          [("local", "int"), ("local", "str"), ("device", "int"),
                           ("device", "str"), ("local", "int"), ("local", "str"),
                           ("device", "int"), ("local", "int")], start=1)],
    }
    path = os.path.join(HERE, "mxnet_reference.json")
    with open(path, "w") as f:
        json.dump(ref, f, indent=None, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
