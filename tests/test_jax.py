"""gpukv.jax: pytrees of JAX arrays kept in a store, pulled back as new arrays."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import gpukv  # noqa: E402
import gpukv.jax as gjax  # noqa: E402

DEVICES = 3  # "devices" on the CPU: the same device repeated, one set of arrays each


def _model(dtype=jnp.float32) -> dict:
    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    return {"dense": {"w": jax.random.normal(k1, (4, 2), dtype),
                      "b": jnp.zeros((2,), dtype)},
            "scale": [jax.random.normal(k2, (2,), dtype)]}


def _loss(params, x, y):
    out = (x @ params["dense"]["w"] + params["dense"]["b"]) * params["scale"][0]
    return jnp.sum((out.astype(jnp.float32) - y) ** 2)


def _batches(n_devices, steps=3):
    rng = np.random.default_rng(1)
    return [[(jnp.asarray(rng.standard_normal((5, 4)), jnp.float32),
              jnp.asarray(rng.standard_normal((5, 2)), jnp.float32))
             for _ in range(n_devices)] for _ in range(steps)]


def _grads(params, shards):
    return [jax.grad(_loss)(params, x.astype(params["scale"][0].dtype), y) for x, y in shards]


def test_init_tree_names_one_key_per_leaf_by_its_path():
    """init_tree with bucket_bytes=0 gives every leaf a key named prefix + its path."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, _model(), prefix="net", bucket_bytes=0)
    assert sorted(kv.keys()) == sorted(["net['dense']['b']", "net['dense']['w']",
                                        "net['scale'][0]"])


@pytest.mark.parametrize("n_devices", [2, 4])
def test_pushpull_tree_sums_the_gradients_of_every_device(n_devices):
    """pushpull_tree returns, for each device, a tree of the gradients summed over devices."""
    kv = gpukv.create("device")
    params = _model()
    gjax.init_tree(kv, jax.tree_util.tree_map(jnp.zeros_like, params))
    grads = _grads(params, _batches(n_devices)[0])
    summed = gjax.pushpull_tree(kv, grads)
    expected = jax.tree_util.tree_map(lambda *g: sum(np.asarray(x) for x in g), *grads)
    assert len(summed) == n_devices
    for tree in summed:
        assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(params)
        for got, want in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(expected)):
            assert isinstance(got, jax.Array)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name,strategy", [("local", None), ("device", "tree"),
                                           ("device", "ring")])
def test_a_deterministic_store_sums_trees_in_the_canonical_order(name, strategy, dtype):
    """pushpull_tree on a deterministic store: each leaf is the canonical tree's sum of
    the 5 devices' gradients (in float32, rounded once), bit for bit, in every store."""
    from gpukv.canonical.tree import leaves_sum
    options = {"strategy": strategy} if strategy else {}
    kv = gpukv.create(name, deterministic=True, **options)
    params = _model(dtype)
    gjax.init_tree(kv, jax.tree_util.tree_map(jnp.zeros_like, params))
    grads = [jax.tree_util.tree_map(lambda g, i=i: g * 10.0 ** (i - 2), tree)
             for i, tree in enumerate(_grads(params, _batches(5)[0]))]
    summed = gjax.pushpull_tree(kv, grads)[0]
    for got, *leaves in zip(jax.tree_util.tree_leaves(summed),
                            *[jax.tree_util.tree_leaves(g) for g in grads]):
        want = leaves_sum([np.asarray(x, np.float32) for x in leaves], np.add)
        assert np.asarray(got).tobytes() == want.astype(got.dtype).tobytes()


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_sgd_training_loop_matches_summing_by_hand(dtype, tol):
    """With set_optimizer('sgd'), push_tree then pull_tree gives the parameters a hand-written
    SGD on the summed gradients gives, for float32 and bfloat16 leaves."""
    lr = 0.01
    kv = gpukv.create("local")
    params = _model(dtype)
    gjax.init_tree(kv, params)
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    by_hand = jax.tree_util.tree_map(lambda p: np.asarray(p, np.float32), params)
    for shards in _batches(DEVICES):
        grads = _grads(params, shards)
        gjax.push_tree(kv, grads)
        params = gjax.pull_tree(kv, params)
        summed = jax.tree_util.tree_map(lambda *g: sum(np.asarray(x, np.float32) for x in g),
                                        *grads)
        by_hand = jax.tree_util.tree_map(lambda p, g: (p - lr * g).astype(dtype).astype(
            np.float32), by_hand, summed)
    for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(by_hand)):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_pull_tree_returns_new_arrays_on_the_given_devices():
    """pull_tree with devices gives one tree per device, each leaf a new array there, and
    later pushes leave earlier results unchanged."""
    kv = gpukv.create("local")
    params = {"w": jnp.ones((3,), jnp.float32)}
    gjax.init_tree(kv, params)
    device = jax.devices()[0]
    trees = gjax.pull_tree(kv, params, devices=[device, device])
    assert len(trees) == 2
    for tree in trees:
        assert tree["w"].devices() == {device}
        np.testing.assert_array_equal(np.asarray(tree["w"]), np.ones(3))
    gjax.push_tree(kv, [{"w": jnp.full((3,), 5.0)}])
    np.testing.assert_array_equal(np.asarray(trees[0]["w"]), np.ones(3))
    np.testing.assert_array_equal(np.asarray(gjax.pull_tree(kv, params)["w"]), np.full(3, 5.0))


def test_trees_of_different_structure_are_an_error_naming_the_leaf():
    """Trees per device that differ in structure raise an ArgumentError naming the leaf
    path, and nothing is pushed."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    with pytest.raises(gpukv.ArgumentError, match=r"\['b'\]"):
        gjax.push_tree(kv, [{"a": jnp.ones(2), "b": jnp.ones(2)}, {"a": jnp.ones(2)}])
    pulled = gjax.pull_tree(kv, {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    np.testing.assert_array_equal(np.asarray(pulled["a"]), np.zeros(2))


def test_a_leaf_that_is_no_array_is_an_error_naming_its_path():
    """A leaf that is not an array raises an ArgumentKindError naming its path."""
    kv = gpukv.create("local")
    with pytest.raises(gpukv.ArgumentKindError, match=r"\['lr'\]"):
        gjax.init_tree(kv, {"w": jnp.zeros(2), "lr": "fast"})
    assert len(kv) == 0


def test_trees_per_device_must_be_a_list():
    """push_tree given one tree instead of a list of trees is an ArgumentKindError."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"w": jnp.zeros(2)})
    with pytest.raises(gpukv.ArgumentKindError, match="list"):
        gjax.push_tree(kv, {"w": jnp.ones(2)})


def test_a_shape_mismatch_names_the_leaf_path():
    """A pushed leaf of the wrong shape is a ShapeError naming its path."""
    kv = gpukv.create("local")
    gjax.init_tree(kv, {"w": jnp.zeros(2)})
    with pytest.raises(gpukv.ShapeError, match=r"\['w'\]"):
        gjax.push_tree(kv, [{"w": jnp.ones(3)}])


def test_import_gpukv_does_not_import_jax():
    """`import gpukv` leaves JAX unimported; `import gpukv.jax` without JAX is a
    BackendError that says how to install it."""
    code = ("import sys, gpukv; assert 'jax' not in sys.modules\n"
            "sys.modules['jax'] = None\n"
            "try:\n    import gpukv.jax\nexcept gpukv.BackendError as e:\n"
            "    assert \"pip install 'gpukv[jax]'\" in str(e), e\n"
            "else:\n    raise SystemExit(1)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
