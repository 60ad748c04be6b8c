"""A deterministic store sums every key in the canonical tree order: one result, the
NumPy reference `leaves_sum`, whatever the strategy, the devices or the slicing.

The gradients span six decades of magnitude, so float32 sums in different orders differ
(the last test shows that without `deterministic` they do).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

import gpukv
from gpukv import ArgumentError, ArgumentKindError
from gpukv.canonical.tree import leaves_sum
from gpukv.comm import nccl as nccl_mod
from gpukv.comm.canonical import Canonical
from gpukv.comm.home import HomeStrategy
from gpukv.comm.staged import StagedStrategy
from gpukv.encoding.sparse import RowSparse

from ..bfloat16 import needs_bfloat16
from ..gpu_gate import hardware_missing

SIZE = 256 * 1024
#: (store type, strategy): 'staged' is StagedStrategy given as an object (a user's Strategy)
LAYOUTS = [("local", None), ("device", "home"), ("device", "tree"), ("device", "ring"),
           ("device", "cpu"), ("device", "staged"), ("device", "auto"), ("device", "nccl")]
LAYOUT_IDS = [f"{t}-{s}" for t, s in LAYOUTS]
COUNTS = (1, 2, 3, 5, 8)


def gradients(n: int, dtype=np.float32, size: int = SIZE, seed: int = 0) -> list:
    """`n` gradients whose magnitudes span six decades."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10 ** rng.uniform(-3, 3, size)).astype(dtype)
            for _ in range(n)]


def reference(arrays, out_dtype=np.float32) -> np.ndarray:
    """The canonical sum in NumPy: the tree in float32, rounded into `out_dtype` once."""
    wide = [a.astype(np.float32) for a in arrays]
    return leaves_sum(wide, np.add).astype(out_dtype)


def digest(array) -> str:
    return hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]


def make_store(kind: str, strategy, deterministic=True):
    if strategy == "staged":
        strategy = StagedStrategy()
    if strategy is None:
        return gpukv.create(kind, deterministic=deterministic)
    return gpukv.create(kind, strategy=strategy, deterministic=deterministic)


def pushed(kv, values, dtype=np.float32) -> np.ndarray:
    """The value of a new key after one push of `values` (host arrays or GPU arrays)."""
    kv.init("w", np.zeros(values[0].shape, dtype))
    kv.push("w", values)
    out = np.empty(values[0].shape, dtype)
    kv.pull("w", out=out)
    return out


# ------------------------------------------------------------------- host devices
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(("kind", "strategy"), LAYOUTS, ids=LAYOUT_IDS)
def test_every_strategy_gives_the_reference_on_host_devices(kind, strategy, count):
    """A push of 1, 2, 3, 5 or 8 float32 gradients from host devices gives the bits of
    `leaves_sum` through every store type and strategy."""
    values = gradients(count)
    got = pushed(make_store(kind, strategy), values)
    assert digest(got) == digest(reference(values))


def test_without_deterministic_strategies_differ():
    """The same 8 gradients through the default stores give at least two results, so the
    tests above can fail."""
    values = gradients(8)
    digests = {digest(pushed(make_store(k, s, deterministic=False), values))
               for k, s in LAYOUTS}
    assert len(digests) >= 2


@pytest.mark.parametrize(("kind", "strategy"), LAYOUTS, ids=LAYOUT_IDS)
def test_float16_values_are_summed_in_float32_and_rounded_once(kind, strategy):
    """float16 gradients into a float16 key: the float32 tree, rounded to float16 once."""
    values = gradients(5, np.float16, size=4099)
    got = pushed(make_store(kind, strategy), values, np.float16)
    assert digest(got) == digest(reference(values, np.float16))


@pytest.mark.parametrize(("kind", "strategy"), LAYOUTS, ids=LAYOUT_IDS)
def test_a_key_in_four_slices_gives_the_bits_of_the_whole(kind, strategy):
    """Sums are per element: the gradients pushed as 4 keys of a quarter each give the
    bits of the whole key pushed at once."""
    values = gradients(8, size=4096)
    kv = make_store(kind, strategy)
    whole = pushed(kv, values)
    quarters = [np.array_split(v, 4) for v in values]
    keys = [f"part{i}" for i in range(4)]
    kv.init(keys, [q for q in quarters[0]])
    kv.push(keys, [[quarters[d][i] for d in range(8)] for i in range(4)])
    outs = [np.empty_like(q) for q in quarters[0]]
    kv.pull(keys, out=outs)
    assert digest(np.concatenate(outs)) == digest(whole)


@pytest.mark.parametrize("strategy", ["home", "tree", "ring", "auto"])
@pytest.mark.parametrize("compression", [pytest.param({"type": "bf16"}, marks=needs_bfloat16),
                                         {"type": "fp16"}])
def test_decoded_payloads_follow_the_tree(strategy, compression):
    """With compression, the terms (bf16's decoded values, fp16's payloads) are summed in
    the tree: the reference over the values as they travel."""
    values = gradients(8, size=4096)
    kv = make_store("device", strategy)
    kv.set_gradient_compression(compression)
    travelled = [v.astype(np.float16) if compression["type"] == "fp16"
                 else _bf16(v) for v in values]
    assert digest(pushed(kv, values)) == digest(reference(travelled))


def _bf16(values: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize(("kind", "strategy"), LAYOUTS[:3], ids=LAYOUT_IDS[:3])
def test_row_sparse_pushes_give_the_dense_pushes_bits(kind, strategy):
    """Row-sparse values (rows overlapping, some repeated within a source) are merged in
    the tree: the bits of a dense push of their dense values."""
    rng = np.random.default_rng(3)
    shape = (40, 3)
    sparse = []
    for i in range(5):
        ids = rng.integers(0, shape[0], size=25)
        data = gradients(1, size=25 * 3, seed=10 + i)[0].reshape(25, 3)
        sparse.append(RowSparse(ids, data, shape))
    dense = [s.todense() for s in sparse]
    a, b = make_store(kind, strategy), make_store(kind, strategy)
    assert digest(pushed(a, sparse)) == digest(pushed(b, dense)) \
        == digest(reference(dense))


# ------------------------------------------------------------------ the strategy
def test_canonical_keeps_the_inner_strategys_identity():
    """Canonical(inner) has inner's name, explicit flag and store options."""
    inner = gpukv.comm.registry.make_strategy("tree")
    wrapped = Canonical(inner)
    assert (wrapped.name, wrapped.explicit, wrapped.store_options) == \
        (inner.name, inner.explicit, inner.store_options)


def test_a_users_strategy_is_wrapped():
    """A Strategy instance given to a deterministic store sums in the canonical order."""
    kv = gpukv.create("device", strategy=HomeStrategy(), deterministic=True)
    values = gradients(8, size=1000)
    assert digest(pushed(kv, values)) == digest(reference(values))


# ------------------------------------------------------------------- the option
@pytest.mark.parametrize(("env", "expected"), [(None, False), ("", False), ("0", False),
                                               ("1", True), (" 1 ", True)])
def test_the_environment_variable_gives_the_default(monkeypatch, env, expected):
    """deterministic=None reads GPUKV_DETERMINISTIC: '1' on, '0', blank or unset off."""
    if env is None:
        monkeypatch.delenv("GPUKV_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("GPUKV_DETERMINISTIC", env)
    for kind in ("local", "device"):
        kv = gpukv.create(kind)
        assert kv.deterministic is expected
        assert f"deterministic={expected}" in repr(kv)


@pytest.mark.parametrize("value", [True, False])
def test_the_option_wins_over_the_environment(monkeypatch, value):
    """An explicit deterministic= is used whatever GPUKV_DETERMINISTIC says."""
    monkeypatch.setenv("GPUKV_DETERMINISTIC", "0" if value else "1")
    assert gpukv.create("local", deterministic=value).deterministic is value


@pytest.mark.parametrize("env", ["yes", "2", "true"])
def test_a_malformed_environment_variable_is_refused(monkeypatch, env):
    """A GPUKV_DETERMINISTIC other than '0' or '1' is an ArgumentError naming it."""
    monkeypatch.setenv("GPUKV_DETERMINISTIC", env)
    with pytest.raises(ArgumentError, match="GPUKV_DETERMINISTIC"):
        gpukv.create("local")


@pytest.mark.parametrize("value", ["1", 1, 0.0])
def test_an_option_of_another_kind_is_refused(value):
    """deterministic= other than a bool or None is an ArgumentKindError naming it."""
    with pytest.raises(ArgumentKindError, match="deterministic"):
        gpukv.create("device", deterministic=value)


# -------------------------------------------------------------------------- GPUs
@pytest.fixture
def eight_gpus(monkeypatch):
    """8 logical GPUs dealt over the physical ones (some pairs without peer access)."""
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", "8")
    monkeypatch.delenv("GPUKV_STRATEGY", raising=False)
    from gpukv.device.cuda.device import gpu_devices
    return gpu_devices()


def _gpu_store(strategy):
    from gpukv.device.cuda.device import gpu_count
    if strategy == "nccl" and gpu_count() > 1 and not nccl_mod.nccl_available():
        hardware_missing("NCCL is not installed")
    return make_store("device", strategy)


def _on(device, array):
    import cupy
    with device.cuda_device:
        return cupy.asarray(array)


GPU_STRATEGIES = ["home", "tree", "ring", "cpu", "staged", "auto", "nccl"]


@pytest.mark.gpu
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("strategy", GPU_STRATEGIES)
def test_every_strategy_gives_the_reference_on_gpus(eight_gpus, strategy, count):
    """A push of 1, 2, 3, 5 or 8 float32 gradients from GPUs (the key homed on one of
    them) gives the bits of `leaves_sum` through every strategy."""
    values = gradients(count)
    kv = _gpu_store(strategy)
    kv.init("w", _on(eight_gpus[count % 8], np.zeros(SIZE, np.float32)))
    kv.push("w", [_on(d, v) for d, v in zip(eight_gpus, values)])
    out = np.empty(SIZE, np.float32)
    kv.pull("w", out=out)
    assert digest(out) == digest(reference(values))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["home", "tree", "staged"])
def test_mixed_host_and_gpu_sources_give_the_reference(eight_gpus, strategy):
    """Sources on GPUs and on the host together, into a GPU-homed key, give the bits of
    `leaves_sum` over them in the order given."""
    values = gradients(6, size=5000)
    kv = _gpu_store(strategy)
    kv.init("w", _on(eight_gpus[3], np.zeros(5000, np.float32)))
    kv.push("w", [v if i % 2 else _on(eight_gpus[i], v) for i, v in enumerate(values)])
    out = np.empty(5000, np.float32)
    kv.pull("w", out=out)
    assert digest(out) == digest(reference(values))


def _subnormal_gradients(n: int) -> list:
    """Gradients that are float32 subnormals (and sums of them), a few normal values."""
    rng = np.random.default_rng(7)
    tiny = np.finfo(np.float32).tiny
    out = []
    for _ in range(n):
        v = (rng.standard_normal(3000) * tiny * 0.25).astype(np.float32)
        v[::7] = rng.standard_normal(v[::7].size).astype(np.float32)
        out.append(v)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("count", [2, 5, 8])
def test_subnormals_give_the_hosts_bits_on_gpus(eight_gpus, count):
    """float32 subnormal inputs and partial sums are kept on the GPU as on the host: the
    deterministic 'device' store on GPUs gives the 'local' store's bits."""
    values = _subnormal_gradients(count)
    kv = _gpu_store("home")
    kv.init("w", _on(eight_gpus[0], np.zeros(3000, np.float32)))
    kv.push("w", [_on(d, v) for d, v in zip(eight_gpus, values)])
    out = np.empty(3000, np.float32)
    kv.pull("w", out=out)
    host = pushed(make_store("local", None), values)
    assert np.count_nonzero((host != 0) & (np.abs(host) < np.finfo(np.float32).tiny))
    assert digest(out) == digest(host) == digest(reference(values))
