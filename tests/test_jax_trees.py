"""gpukv.jax beyond one key per leaf: calls refused inside transforms, sharded arrays,
the tree kept by init_tree, buckets (and PowerSGD's keys), the mean beside an optimizer
of one's own, and 64-bit leaves while JAX's x64 is off."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gpukv  # noqa: E402
import gpukv.jax as gjax  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) >= 4, "tests/conftest.py gives JAX 4 host devices"
    return Mesh(np.array(devices[:4]), ("i",))


def _tree(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((3, 4)), dtype),
            "b": jnp.asarray(rng.standard_normal(4), dtype),
            "layers": [jnp.asarray(rng.standard_normal(2), dtype),
                       jnp.asarray(rng.standard_normal((2, 2)), dtype)]}


def _values(tree) -> list:
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def _same(a, b) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(_values(a), _values(b)):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


# ------------------------------------------------------------------ transforms
@pytest.mark.parametrize("call", ["pull_tree", "push_tree", "pushpull_tree", "init_tree"])
def test_calls_inside_jit_are_refused_at_trace_time(call):
    """A gpukv.jax call traced by jit is an ArgumentError saying calls stay outside
    transforms; the store is unchanged and works after."""
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    calls = {"pull_tree": lambda t: gjax.pull_tree(kv, t),
             "push_tree": lambda t: gjax.push_tree(kv, [t]),
             "pushpull_tree": lambda t: gjax.pushpull_tree(kv, [t]),
             "init_tree": lambda t: gjax.init_tree(kv, t, prefix="other")}
    with pytest.raises(gpukv.ArgumentError, match="outside"):
        jax.jit(calls[call])(params)
    assert "other['w']" not in kv.keys()
    _same(gjax.pull_tree(kv, params), params)


def test_a_pull_in_a_jitted_function_without_traced_arguments_is_refused():
    """pull_tree inside jit with a template closed over (no tracer in sight) is refused:
    its value would be compiled in as a constant."""
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    with pytest.raises(gpukv.ArgumentError, match="traces"):
        jax.jit(lambda: gjax.pull_tree(kv, params))()


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_calls_inside_vmap_and_grad_are_refused(transform):
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"w": jnp.zeros(3)})

    def f(x):
        gjax.push_tree(kv, [{"w": x}])
        return jnp.sum(x)
    wrapped = jax.vmap(f) if transform == "vmap" else jax.grad(f)
    with pytest.raises(gpukv.ArgumentError, match="outside"):
        wrapped(jnp.ones((2, 3)) if transform == "vmap" else jnp.ones(3))
    assert np.asarray(gjax.pull_tree(kv, {"w": jnp.zeros(3)})["w"]).tolist() == [0, 0, 0]


# ------------------------------------------------------------------ typed errors
def test_a_deleted_array_is_an_error_naming_its_leaf():
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    grads = _tree(1)
    jax.jit(lambda t: t, donate_argnums=0)(grads)  # donated: deleted
    with pytest.raises(gpukv.ArgumentError, match=r"leaf \"\['b'\]\": the array was deleted"):
        gjax.push_tree(kv, [grads])
    _same(gjax.pull_tree(kv, params), params)


@pytest.mark.parametrize("change", ["dropped", "tuple", "dict", "extra", "subtree"])
def test_a_tree_whose_structure_changed_is_refused_and_changes_nothing(change):
    """A pushed tree that lost a leaf, became a tuple, became a dict of the same paths,
    gained a leaf, or has a list where a leaf was, is an ArgumentError naming what
    differs; no key changes."""
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    grads = _tree(1)
    if change == "dropped":
        del grads["layers"][1]
        match = r"no leaf \"\['layers'\]\[1\]\""
    elif change == "tuple":
        grads["layers"] = tuple(grads["layers"])
        match = "PyTreeDef"
    elif change == "dict":
        grads["layers"] = dict(enumerate(grads["layers"]))
        match = "PyTreeDef"
    elif change == "extra":
        grads["extra"] = jnp.ones(2)
        match = r"a leaf \"\['extra'\]\""
    else:
        grads["b"] = [grads["b"], grads["b"]]
        match = (r"where init_tree's has the leaf \"\['b'\]\", it has 2 leaves "
                 r"\(\"\['b'\]\[0\]\", \"\['b'\]\[1\]\"\): give it one array there")
    with pytest.raises(gpukv.ArgumentError, match=match):
        gjax.push_tree(kv, [_tree(2), grads])
    _same(gjax.pull_tree(kv, params), params)


def test_a_second_init_tree_on_one_prefix_is_refused_and_changes_nothing():
    """A second tree on a prefix would orphan the first one's keys: refused before any
    key is made; another prefix takes it."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"a": jnp.ones(2)})
    with pytest.raises(gpukv.ArgumentError, match="prefix '' holds a tree already"):
        gjax.init_tree(kv, {"b": jnp.ones(2)})
    assert kv.keys() == ["['a']"]
    gjax.push_tree(kv, [{"a": jnp.full(2, 3.0)}])
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, {"a": jnp.ones(2)})["a"]),
                                  np.full(2, 3.0))
    gjax.init_tree(kv, {"b": jnp.ones(2)}, prefix="other/")
    assert kv.keys() == ["['a']", "other/['b']"]


def test_a_single_device_leaf_with_a_leading_axis_of_one_is_a_shape_error():
    """Only a shard of a sharded leaf may drop a leading axis of 1: a whole leaf of
    shape (1, 3) for a key of (3,) is refused, and nothing changes."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"b": jnp.zeros(3)})
    for leaf in (jnp.ones((1, 3)), np.ones((1, 3), np.float32)):
        with pytest.raises(gpukv.ShapeError, match=r"\['b'\]\": .*shape \(1, 3\)"):
            gjax.pushpull_tree(kv, [{"b": leaf}])
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, {"b": jnp.zeros(3)})["b"]),
                                  np.zeros(3))


def test_a_leaf_stacked_on_a_mesh_of_one_device_gives_its_row():
    """shard_map's stacked gradient on a one-device mesh: shape (1, *key's shape), laid
    out by a sharding, so its leading axis goes as a sharded leaf's does."""
    one = Mesh(np.array(jax.devices()[:1]), ("i",))
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"b": jnp.zeros(3)})
    row = np.arange(3, dtype=np.float32)
    gjax.push_tree(kv, [{"b": jax.device_put(row[None], NamedSharding(one, P("i")))}])
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, {"b": jnp.zeros(3)})["b"]),
                                  row)


def test_a_leaf_sharded_over_one_device_comes_back_with_its_sharding_and_shape():
    """On a one-device mesh (one GPU, or a plain CPU run) as on several: pushpull_tree
    and mean_tree give a stacked leaf back with its NamedSharding and shape, and pull_tree
    lays a value out as a one-device template's sharding says."""
    one = Mesh(np.array(jax.devices()[:1]), ("i",))
    kv = gpukv.create("device")
    gjax.init_tree(kv, {"g": jnp.zeros(3)})
    row = np.arange(3, dtype=np.float32)
    pushed = {"g": jax.device_put(row[None], NamedSharding(one, P("i")))}
    for call in (gjax.pushpull_tree, gjax.mean_tree):
        (out,) = call(kv, [pushed])
        assert out["g"].sharding == pushed["g"].sharding and out["g"].shape == (1, 3), call
        np.testing.assert_array_equal(np.asarray(out["g"]), row[None])
    template = {"g": jax.device_put(np.zeros(3, np.float32), NamedSharding(one, P()))}
    got = gjax.pull_tree(kv, template)
    assert got["g"].sharding == template["g"].sharding
    np.testing.assert_array_equal(np.asarray(got["g"]), row)


def test_calls_before_init_tree_say_to_call_it():
    kv = gpukv.create("local")
    kv.init("['w']", np.zeros(3, np.float32))
    with pytest.raises(gpukv.ArgumentError, match="init_tree"):
        gjax.push_tree(kv, [{"w": jnp.ones(3)}])


def test_a_leaf_of_another_dtype_in_a_shared_key_is_a_dtype_error():
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    grads = _tree(1)
    grads["b"] = grads["b"].astype(jnp.float16)
    with pytest.raises(gpukv.DTypeError, match=r"\['b'\]"):
        gjax.push_tree(kv, [grads])
    _same(gjax.pull_tree(kv, params), params)


def test_a_sharding_that_cannot_lay_out_a_leaf_is_a_shape_error_naming_it(mesh):
    """pull_tree(devices=[sharding]) whose sharding splits a leaf's axis more ways than
    it is long: a ShapeError naming that leaf, not JAX's own error."""
    kv = gpukv.create("local")
    tree = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    gjax.init_tree(kv, tree)
    with pytest.raises(gpukv.ShapeError, match=r"\['b'\]\": its shape \(2,\) cannot be laid"):
        gjax.pull_tree(kv, tree, devices=[NamedSharding(mesh, P("i"))])
    (got,) = gjax.pull_tree(kv, tree, devices=[NamedSharding(mesh, P())])  # replicated
    _same(got, tree)


def test_a_template_of_another_shape_is_a_shape_error():
    kv = gpukv.create("local")
    params = _tree()
    gjax.init_tree(kv, params)
    like = dict(params, b=jnp.zeros(5))
    with pytest.raises(gpukv.ShapeError, match=r"\['b'\]"):
        gjax.pull_tree(kv, like)


# ------------------------------------------------------------------ buckets
def test_small_leaves_share_keys_by_dtype_and_a_large_one_keeps_its_own():
    """Consecutive leaves of one dtype share a key named first..last; a change of dtype,
    or a leaf past bucket_bytes, starts another; a leaf of ALONE_BYTES or more keeps a
    key of its own whatever bucket_bytes says."""
    from gpukv.jax.buckets import ALONE_BYTES
    kv = gpukv.create("local")
    tree = {"a": jnp.zeros(4), "b": jnp.zeros(4), "c": jnp.zeros(4, jnp.bfloat16),
            "d": jnp.zeros(100), "e": jnp.zeros(3), "f": jnp.zeros(2),
            "g": jnp.zeros(ALONE_BYTES // 4), "h": jnp.zeros(1), "i": jnp.zeros(1)}
    gjax.init_tree(kv, tree, bucket_bytes=64)
    assert kv.keys() == ["['a']..['b']", "['c']", "['d']", "['e']..['f']", "['g']",
                         "['h']..['i']"]
    gjax.init_tree(kv, tree, prefix="big/", bucket_bytes=1 << 30)
    assert [k for k in kv.keys() if k.startswith("big/")] == [
        "big/['a']..big/['b']", "big/['c']", "big/['d']..big/['f']", "big/['g']",
        "big/['h']..big/['i']"]


def test_bucket_bytes_0_gives_every_leaf_its_own_key_an_empty_one_too():
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"a": jnp.zeros(0), "b": jnp.zeros((0, 4)), "c": jnp.ones(3)},
                   bucket_bytes=0)
    assert kv.keys() == ["['a']", "['b']", "['c']"]


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
       capacity=st.sampled_from([0, 16, 100, 1 << 20]),
       devices=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_buckets_give_the_bits_of_one_key_per_leaf(sizes, capacity, devices, seed):
    """pushpull_tree's sums are the same bits whatever the buckets (each element is
    summed in the same order), and placed on each tree's device."""
    rng = np.random.default_rng(seed)
    cpus = jax.devices()[:devices]
    trees = [{f"p{i}": jax.device_put(rng.standard_normal(n).astype(np.float32), cpus[d])
              for i, n in enumerate(sizes)} for d in range(devices)]
    results = []
    for bucket_bytes in (0, capacity):
        kv = gpukv.create("device")
        gjax.init_tree(kv, jax.tree_util.tree_map(jnp.zeros_like, trees[0]),
                       bucket_bytes=bucket_bytes)
        results.append(gjax.pushpull_tree(kv, trees))
    for by_leaf, bucketed, tree in zip(*results, trees):
        _same(by_leaf, bucketed)
        for leaf, pushed in zip(jax.tree_util.tree_leaves(bucketed),
                                jax.tree_util.tree_leaves(tree)):
            assert leaf.devices() == pushed.devices()
    want = [sum(leaves) for leaves in zip(*[_values(t) for t in trees])]
    for got, expected in zip(_values(results[1][0]), want):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ sharded arrays
def test_a_sharded_push_counts_each_shard_as_a_device(mesh):
    """A leaf sharded along its first axis gives each device its slice: the store sums
    the 4 slices; a replicated leaf counts once per device (4x its value)."""
    kv = gpukv.create("device")
    gjax.init_tree(kv, {"g": jnp.zeros((2, 3)), "r": jnp.zeros(3)})
    stacked = np.arange(24, dtype=np.float32).reshape(8, 3)
    grads = {"g": jax.device_put(stacked, NamedSharding(mesh, P("i"))),
             "r": jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, P()))}
    gjax.push_tree(kv, [grads])
    got = gjax.pull_tree(kv, {"g": jnp.zeros((2, 3)), "r": jnp.zeros(3)})
    np.testing.assert_array_equal(np.asarray(got["g"]), stacked.reshape(4, 2, 3).sum(0))
    np.testing.assert_array_equal(np.asarray(got["r"]), np.full(3, 4.0))


@pytest.mark.parametrize("spec", [P("i"), P()], ids=["sharded", "replicated"])
def test_a_plain_call_given_an_array_over_several_devices_points_to_the_tree_calls(mesh,
                                                                                   spec):
    """A jax.Array laid over 4 devices, given to a plain store call, is refused by JAX's
    own protocol: the error also says what takes it (the tree calls, or its shards as a
    list), and the call changes nothing."""
    kv = gpukv.create("local")
    kv.init("w", np.ones(2, np.float32))
    spread = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, spec))
    with pytest.raises(gpukv.ArgumentKindError,
                       match=r"key 'w': .*a jax\.Array over 4 devices: gpukv\.jax's push_tree"
                             r".*\[s\.data for s in a\.addressable_shards\]"):
        kv.push("w", spread)
    out = np.zeros(2, np.float32)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.ones(2, np.float32))


def test_sharded_arrays_init_whole_and_pull_into_the_templates_sharding(mesh):
    """init_tree takes a sharded or replicated leaf's whole value; pull_tree lays the
    value out as the template's sharding says."""
    kv = gpukv.create("local")
    value = np.arange(8, dtype=np.float32)
    tree = {"s": jax.device_put(value, NamedSharding(mesh, P("i"))),
            "r": jax.device_put(value * 2, NamedSharding(mesh, P()))}
    gjax.init_tree(kv, tree)
    got = gjax.pull_tree(kv, tree)
    for name in tree:
        assert got[name].sharding == tree[name].sharding
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(tree[name]))


def test_pushpull_of_sharded_leaves_gives_every_shard_the_sum(mesh):
    """pushpull_tree returns a sharded leaf with the pushed leaf's sharding, each shard
    holding the sum over the shards (what psum gives every device)."""
    kv = gpukv.create("device")
    gjax.init_tree(kv, {"g": jnp.zeros((1, 3))})
    stacked = np.arange(12, dtype=np.float32).reshape(4, 3)
    pushed = jax.device_put(stacked, NamedSharding(mesh, P("i")))
    (out,) = gjax.pushpull_tree(kv, [{"g": pushed}])
    assert out["g"].sharding == pushed.sharding
    for shard in out["g"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data)[0], stacked.sum(0))


def test_leaves_on_different_devices_in_one_sharded_tree_are_refused(mesh):
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    tree = {"a": jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("i"))),
            "b": jnp.ones(2)}
    with pytest.raises(gpukv.ArgumentError, match="same devices"):
        gjax.push_tree(kv, [tree])


# ------------------------------------------------------------------ an optimizer beside
def _pmean(grads: list, mesh):
    """What jitted shard_map + jax.lax.pmean gives each device of `mesh` for `grads`
    (one tree per device)."""
    from jax import shard_map
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *grads)
    on_mesh = jax.device_put(stacked, NamedSharding(mesh, P("i")))
    pmean = shard_map(lambda t: jax.tree_util.tree_map(
        lambda x: jax.lax.pmean(x, "i"), t), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return jax.tree_util.tree_map(lambda x: x[0], jax.jit(pmean)(on_mesh))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_mean_tree_is_pmean_bit_for_bit(mesh, dtype):
    """mean_tree over 4 devices gives shard_map + pmean's bits; in float16 the sum
    rounded once from float32, then divided (XLA's psum on host devices rounds float16
    after each add, and may end an ulp or two away)."""
    kv = gpukv.create("device")
    grads = [_tree(seed, dtype) for seed in range(4)]
    gjax.init_tree(kv, grads[0])
    want = _pmean(grads, mesh)
    by_device = [jax.device_put(g, d) for g, d in zip(grads, jax.devices()[:4])]
    for got in gjax.mean_tree(kv, by_device):
        if dtype != jnp.float16:
            _same(got, want)
            continue
        from gpukv.canonical.tree import leaves_sum
        for x, *leaves in zip(_values(got), *[_values(g) for g in grads]):
            total = leaves_sum([leaf.astype(np.float32) for leaf in leaves], np.add)
            assert x.tobytes() == (total.astype(np.float16) / np.float16(4)).tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("count", [2, 3])
def test_mean_tree_is_pmean_bit_for_bit_on_any_number_of_devices(count, dtype):
    """On 3 devices too (where x / 3 and x * (1/3) round apart): XLA makes a division
    by the constant n a multiplication by 1/n (bfloat16's in float32), and mean_tree
    does the same."""
    devices = jax.devices()[:count]
    kv = gpukv.create("device")
    grads = [_tree(seed, dtype) for seed in range(count)]
    gjax.init_tree(kv, grads[0])
    want = _pmean(grads, Mesh(np.array(devices), ("i",)))
    by_device = [jax.device_put(g, d) for g, d in zip(grads, devices)]
    for got in gjax.mean_tree(kv, by_device):
        _same(got, want)


@pytest.mark.parametrize("updates", ["optimizer", "updater"])
def test_mean_tree_refuses_a_store_with_an_optimizer_or_updater(updates):
    """A push there would update the values, not keep their sum: refused, nothing
    changes (the refusal comes before any push)."""
    kv = gpukv.create("local")
    assert not kv.has_updater
    gjax.init_tree(kv, {"w": jnp.ones(3)})
    if updates == "optimizer":
        kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.1))
    else:
        kv.set_updater(lambda key, merged, stored: None)
    assert kv.has_updater
    with pytest.raises(gpukv.ArgumentError, match="mean_tree: the store has an optimizer"):
        gjax.mean_tree(kv, [{"w": jnp.full(3, 2.0)}])
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, {"w": jnp.ones(3)})["w"]),
                                  np.ones(3))


def test_mean_tree_on_dist_async_says_to_use_dist_sync(monkeypatch):
    """dist_async keeps no sum (it needs an optimizer, which mean_tree refuses): the
    error says which store mean_tree takes, rather than to set an optimizer. (A store
    that calls itself dist_async stands in: a real one needs servers, several processes.)"""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"w": jnp.ones(3)})
    monkeypatch.setattr(type(kv), "type", property(lambda self: "dist_async"))
    with pytest.raises(gpukv.ArgumentError, match="a dist_async store .* use dist_sync"):
        gjax.mean_tree(kv, [{"w": jnp.full(3, 2.0)}])
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, {"w": jnp.ones(3)})["w"]),
                                  np.ones(3))


def test_mean_tree_refuses_integer_leaves_naming_one():
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"w": jnp.zeros(2), "n": jnp.zeros(2, jnp.int32)})
    with pytest.raises(gpukv.DTypeError, match=r"\['n'\]\": mean_tree averages"):
        gjax.mean_tree(kv, [{"w": jnp.ones(2), "n": jnp.ones(2, jnp.int32)}])


def test_optax_beside_the_store_trains_as_pmean_does(mesh):
    """gpukv sums, optax updates on every device: after 5 Adam steps every device holds
    the bits of shard_map + pmean, then the same jitted optax update (pmean of per-device
    gradients: check_vma=False, else JAX sums a replicated parameter's gradient itself)."""
    optax = pytest.importorskip("optax")
    from jax import shard_map
    devices = jax.devices()[:4]

    def loss(p, x):
        return jnp.sum((x @ p["w"] + p["b"]) ** 2)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 5, 3)).astype(np.float32) for _ in range(5)]
    params = {"w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32), "b": jnp.zeros(2)}
    opt = optax.adam(1e-2)

    @jax.jit
    def update(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    kv = gpukv.create("device")
    gjax.init_tree(kv, params)
    grad = jax.jit(jax.grad(loss))
    mine = [jax.device_put(params, d) for d in devices]
    states = [opt.init(p) for p in mine]
    for batch in data:
        grads = [grad(p, jax.device_put(x, d)) for p, x, d in zip(mine, batch, devices)]
        for r, g in enumerate(gjax.mean_tree(kv, grads)):
            mine[r], states[r] = update(mine[r], states[r], g)

    pmean = jax.jit(shard_map(lambda p, x: jax.tree_util.tree_map(
        lambda v: jax.lax.pmean(v, "i"), jax.grad(loss)(p, x[0])), mesh=mesh,
        in_specs=(P(), P("i")), out_specs=P(), check_vma=False))
    theirs, state = params, opt.init(params)
    for batch in data:
        theirs, state = update(theirs, state, pmean(theirs, batch))
    assert not np.allclose(_values(theirs)[0], _values(params)[0])
    for p in mine:
        _same(p, theirs)


def test_leaves_committed_to_no_device_come_back_so():
    """pull_tree and pushpull_tree of leaves on JAX's default device, committed to none
    (jnp.zeros), give leaves committed to none: the next jitted step mixes them with a
    batch on another device, as it did with the leaves it started from."""
    kv = gpukv.create("local")
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    assert not params["w"].committed
    gjax.init_tree(kv, params)
    pulled = gjax.pull_tree(kv, params)
    (summed,) = gjax.pushpull_tree(kv, [params])
    batch = jax.device_put(np.ones(3, np.float32), jax.devices()[1])
    for tree in (pulled, summed):
        assert not any(leaf.committed for leaf in jax.tree_util.tree_leaves(tree))
        out = jax.jit(lambda p, x: p["w"] * x + p["b"])(tree, batch)
        assert out.devices() == {jax.devices()[1]}
    committed = jax.device_put(params, jax.devices()[2])
    assert gjax.pull_tree(kv, committed)["w"].committed
    assert gjax.pull_tree(kv, committed)["w"].devices() == {jax.devices()[2]}


@pytest.mark.parametrize("bucket_bytes", [0, None])
@pytest.mark.parametrize("pushed", [jnp.float32, jnp.int32])
def test_a_leaf_of_another_dtype_is_refused_whatever_the_buckets(bucket_bytes, pushed):
    """A leaf pushed in another dtype than init_tree's is a DTypeError naming it, with
    leaves in keys of their own or sharing one alike; nothing changes."""
    kv = gpukv.create("local")
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    params = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)}
    gjax.init_tree(kv, params, **options)
    grads = {"a": jnp.ones(3, pushed), "b": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(gpukv.DTypeError, match=r"leaf \"\['a'\]\": dtype .*, the key "
                                               r"holds bfloat16"):
        gjax.push_tree(kv, [grads])
    pulled = gjax.pull_tree(kv, params)
    assert not any(np.asarray(leaf, np.float32).any()
                   for leaf in jax.tree_util.tree_leaves(pulled))


# ------------------------------------------------------------------ PowerSGD's keys
def _powersgd(rank: int):
    kv = gpukv.create("device")
    kv.set_gradient_compression({"type": "powersgd", "rank": rank})
    return kv


@settings(max_examples=20, deadline=None)
@given(leaves=st.lists(st.tuples(st.sampled_from([np.float32, np.int32]),
                                 st.lists(st.integers(1, 12), min_size=1, max_size=2)),
                       min_size=1, max_size=7),
       rank=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_under_powersgd_each_matrix_it_compresses_keeps_a_key_of_its_own(leaves, rank,
                                                                         seed):
    """With PowerSGD set before init_tree, every leaf it compresses (a float matrix it
    cuts at least in half) is a key of its own, the others share buckets as without
    it, and the sums are the bits of one key per leaf: compressed, of rank <= R."""
    from gpukv.encoding.compressors import compresses_key, make_compressor
    comp = make_compressor({"type": "powersgd", "rank": rank})
    rng = np.random.default_rng(seed)
    names = [f"p{i}" for i in range(len(leaves))]
    dtypes = [np.dtype(dtype) for dtype, _ in leaves]
    shapes = [tuple(shape) for _, shape in leaves]
    trees = [{name: jax.device_put((rng.standard_normal(shape) * 8).astype(dtype), cpu)
              for name, dtype, shape in zip(names, dtypes, shapes)}
             for cpu in jax.devices()[:4]]
    compressed = [compresses_key(comp, dtype, shape) for dtype, shape in zip(dtypes, shapes)]
    results = []
    for bucket_bytes in (0, gjax.BUCKET_BYTES):
        kv = _powersgd(rank)
        gjax.init_tree(kv, jax.tree_util.tree_map(jnp.zeros_like, trees[0]),
                       bucket_bytes=bucket_bytes)
        results.append(gjax.pushpull_tree(kv, trees))
    for name, alone in zip(names, compressed):
        if alone:
            assert f"['{name}']" in kv.keys()
    # the rest share a key per run of consecutive leaves of one dtype
    runs = sum(1 for i in range(len(names)) if not compressed[i] and (
        i == 0 or compressed[i - 1] or dtypes[i - 1] != dtypes[i]))
    assert len(kv.keys()) == sum(compressed) + runs
    for by_leaf, bucketed in zip(*results):
        _same(by_leaf, bucketed)
    for name, alone in zip(names, compressed):
        if alone:
            assert np.linalg.matrix_rank(np.asarray(results[1][0][name])) <= rank


@pytest.mark.parametrize("call", ["push_tree", "pushpull_tree", "mean_tree"])
def test_powersgd_set_after_init_tree_bucketed_a_matrix_is_refused_at_the_next_push(call):
    """PowerSGD set after init_tree put a matrix it compresses in a bucket (which it
    would send uncompressed): the next push is an ArgumentError naming the prefix and
    the leaf and saying to call init_tree after it; nothing changes."""
    kv = gpukv.create("device")
    params = {"w": jnp.ones((16, 16)), "b": jnp.ones(16)}
    gjax.init_tree(kv, params, prefix="net")
    kv.set_gradient_compression({"type": "powersgd", "rank": 2})
    grads = [jax.device_put(params, d) for d in jax.devices()]
    calls = {"push_tree": lambda: gjax.push_tree(kv, grads, prefix="net"),
             "pushpull_tree": lambda: gjax.pushpull_tree(kv, grads, prefix="net"),
             "mean_tree": lambda: gjax.mean_tree(kv, grads, prefix="net")}
    with pytest.raises(gpukv.ArgumentError,
                       match=r"PowerSGD.*prefix 'net'.*\"net\['w'\]\".*init_tree"):
        calls[call]()
    _same(gjax.pull_tree(kv, params, prefix="net"), params)


@pytest.mark.parametrize("bucket_bytes", [0, None])
def test_powersgd_set_after_init_tree_with_no_matrix_in_a_bucket_runs(bucket_bytes):
    """PowerSGD set after init_tree is taken where no bucket holds a matrix it
    compresses: every leaf its own key, or a bucket of matrices too small to cut."""
    kv = gpukv.create("device")
    params = ({"w": jnp.ones((16, 16)), "b": jnp.ones(16)} if bucket_bytes == 0
              else {"w": jnp.ones((4, 4)), "b": jnp.ones(4)})
    gjax.init_tree(kv, params, bucket_bytes=gjax.BUCKET_BYTES if bucket_bytes is None
                   else bucket_bytes)
    kv.set_gradient_compression({"type": "powersgd", "rank": 2})
    rng = np.random.default_rng(0)
    grads = [jax.device_put(jax.tree_util.tree_map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32), params), d)
        for d in jax.devices()]
    (summed, *_) = gjax.pushpull_tree(kv, grads)
    want_rank = 2 if bucket_bytes == 0 else 4   # (4x4 is sent as it is at rank 2)
    assert np.linalg.matrix_rank(np.asarray(summed["w"])) == want_rank


# ------------------------------------------------------------------ 64-bit leaves
@contextlib.contextmanager
def _x64(on: bool):
    """JAX's x64 set to `on` inside, set back as it was after."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


_WIDE = ["float64", "int64", "uint64", "complex128"]


@settings(max_examples=20, deadline=None)
@given(dtypes=st.lists(st.sampled_from(["float32", "int32", *_WIDE]), min_size=1,
                       max_size=6).filter(lambda ds: any(d in _WIDE for d in ds)))
def test_init_tree_refuses_a_64_bit_leaf_while_x64_is_off_before_making_a_key(dtypes):
    """With x64 off, init_tree given a float64, int64, uint64 or complex128 leaf is a
    DTypeError naming the first such leaf and saying to cast it or enable x64; no key
    is made and the prefix stays free."""
    tree = {f"p{i}": np.array([2**40 + 5]).astype(d) for i, d in enumerate(dtypes)}
    first = next(f"p{i}" for i, d in enumerate(dtypes) if d in _WIDE)
    with _x64(False):
        kv = gpukv.create("device")
        with pytest.raises(gpukv.DTypeError, match=rf"leaf \"\['{first}'\]\" is "
                                                   rf"{dtypes[int(first[1:])]}.*cast.*x64"):
            gjax.init_tree(kv, tree)
        assert kv.keys() == []
        gjax.init_tree(kv, {"p": np.zeros(2, np.float32)})


@pytest.mark.parametrize("call", ["pull_tree", "pushpull_tree", "mean_tree"])
def test_pulls_refuse_64_bit_leaves_once_x64_is_turned_off(call):
    """A tree given to init_tree with x64 on, pulled once x64 is off, is a DTypeError
    naming its first 64-bit leaf, before anything is pushed or pulled; with x64 on
    again its values come back whole."""
    tree = {"step": np.array([2**40 + 5], np.int64), "w": np.array([1e-50, 1.0])}
    if call == "mean_tree":  # (which averages floating-point leaves only)
        del tree["step"]
    with _x64(True):
        kv = gpukv.create("device")
        gjax.init_tree(kv, tree)
    calls = {"pull_tree": lambda: gjax.pull_tree(kv, tree),
             "pushpull_tree": lambda: gjax.pushpull_tree(kv, [tree]),
             "mean_tree": lambda: gjax.mean_tree(kv, [tree])}
    with _x64(False):
        with pytest.raises(gpukv.DTypeError, match=rf"{call}: leaf \"\['{min(tree)}'\]\""
                                                   rf".*x64.*turned off since init_tree"):
            calls[call]()
    with _x64(True):
        back = gjax.pull_tree(kv, tree)
    for name, value in tree.items():
        assert np.asarray(back[name]).dtype == value.dtype
        assert np.asarray(back[name]).tobytes() == value.tobytes()
