"""Dtypes: every supported dtype round-trips exactly, and 16-bit floats are summed in float32."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import gpukv

from .bfloat16 import BF16, needs_bfloat16

MX = json.loads((pathlib.Path(__file__).parent / "data" / "mxnet_reference.json").read_text())[
    "behaviours"]
SHAPE = (2, 3)
#: bfloat16 as a case: it skips without ml_dtypes
BF16_CASE = pytest.param(BF16, id="bfloat16", marks=needs_bfloat16)
DTYPES = ["float16", BF16_CASE, "float32", "float64", "uint8", "int8", "int32", "int64"]
NARROW = ["float16", BF16_CASE]


@pytest.fixture(params=["local", "device"])
def kv(request):
    return gpukv.create(request.param)


def full(value, dtype):
    return np.full(SHAPE, value, dtype=dtype)


def pulled(kv, key, dtype):
    out = np.zeros(SHAPE, dtype)
    kv.pull(key, out=out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_round_trip(kv, dtype):
    """init, a 3-device push and a pull keep the dtype and give the exact sum."""
    kv.init(1, full(0, dtype))
    kv.push(1, [full(1, dtype), full(2, dtype), full(3, dtype)])
    out = pulled(kv, 1, dtype)
    assert out.dtype == np.dtype(dtype)
    assert (out.astype(np.float64) == 6).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_updater_sees_stored_dtype(kv, dtype):
    """The stored array handed to the updater has the key's dtype."""
    seen = []
    kv.init(1, full(1, dtype))
    kv.set_updater(lambda k, m, s: (seen.append(s.dtype), s.__iadd__(m.astype(s.dtype))))
    kv.push(1, full(2, dtype))
    assert seen == [np.dtype(dtype)]
    assert (pulled(kv, 1, dtype).astype(np.float64) == 3).all()


def test_int64_sums_are_exact(kv):
    """int64 sums never pass through floating point (2**53 + 1 survives)."""
    big = 2 ** 53 + 1
    kv.init(1, full(0, np.int64))
    kv.push(1, [full(big, np.int64), full(big, np.int64), full(-1, np.int64)])
    assert (pulled(kv, 1, np.int64) == 2 * big - 1).all()


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_floats_cancel_instead_of_overflowing(kv, dtype):
    """Pushes 60000, 60000, -60000, -60000 sum to 0, not inf or nan."""
    kv.init(0, full(0, dtype))
    kv.push(0, [full(s, dtype) for s in (60000, 60000, -60000, -60000)])
    out = pulled(kv, 0, dtype)
    assert np.isfinite(out.astype(np.float32)).all()
    assert (out.astype(np.float32) == 0).all()
    if dtype == "float16":
        assert MX["fp16_four_pushes"] == 0.0


def test_fp16_merged_is_float32_past_fp16_range(kv):
    """Two fp16 pushes of 60000 reach the updater as 120000 in float32 (MXNet: inf in fp16)."""
    assert MX["fp16_two_pushes_halved"] == {"value": "inf", "merged_dtype": "float16"}
    seen = []

    def halve(key, merged, stored):
        seen.append((merged.dtype, float(merged.ravel()[0])))
        stored[...] = merged / 2

    kv.init(0, full(0, np.float16))
    kv.set_updater(halve)
    kv.push(0, [full(60000, np.float16)] * 2)
    assert seen == [(np.dtype(np.float32), 120000.0)]
    assert (pulled(kv, 0, np.float16) == 60000).all()


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_narrow_updater_sees_float32(kv, dtype, n):
    """The updater of a 16-bit key gets a float32 merged value, for one device or several."""
    seen = []
    kv.init(0, full(1, dtype))
    kv.set_updater(lambda k, m, s: (seen.append(m.dtype), s.__iadd__(m.astype(s.dtype))))
    kv.push(0, [full(2, dtype)] * n)
    assert seen == [np.dtype(np.float32)]
    assert (pulled(kv, 0, np.float32) == 1 + 2 * n).all()


@pytest.mark.parametrize("dtype,big,step", [
    ("float16", 2048, 1), pytest.param(BF16, 256, 1, id="bfloat16-256-1", marks=needs_bfloat16)],
    ids=str)
def test_narrow_sum_keeps_small_terms(kv, dtype, big, step):
    """Small terms are not lost to rounding: big + 4 * step is exact after fp32 accumulation."""
    kv.init(0, full(0, dtype))
    kv.push(0, [full(big, dtype)] + [full(step, dtype)] * 4)
    sequential = np.array(big, dtype)
    for _ in range(4):
        sequential = (sequential + np.array(step, dtype)).astype(dtype)
    assert float(sequential) == big  # summing in the narrow type would lose every term
    assert (pulled(kv, 0, np.float32) == big + 4 * step).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_two_fp16_pushes_of_60000_assigned_overflow_like_fp16(kv):
    """Assigning 120000 to an fp16 key gives inf: the sum was right, fp16 cannot hold it
    (and NumPy's overflow warning stays inside gpukv)."""
    assert MX["fp16_two_pushes"] == "inf"
    kv.init(0, full(0, np.float16))
    kv.push(0, [full(60000, np.float16)] * 2)
    assert np.isinf(pulled(kv, 0, np.float16)).all()


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_pull_into_float32(kv, dtype):
    """A 16-bit key pulls into a float32 out, cast exactly."""
    kv.init(0, full(1.5, dtype))
    assert (pulled(kv, 0, np.float32) == 1.5).all()


@needs_bfloat16
def test_bfloat16_keys_from_ml_dtypes(kv):
    """bfloat16 arrays made with ml_dtypes are a supported dtype end to end."""
    kv.init(["w", "b"], [full(1, BF16), full(2, BF16)])
    kv.pushpull(["w", "b"], [[full(0.5, BF16)] * 2, full(3, BF16)], out=[
        [a := np.zeros(SHAPE, BF16)], b := np.zeros(SHAPE, BF16)])
    assert (a.astype(np.float32) == 1).all() and (b.astype(np.float32) == 3).all()


@pytest.mark.parametrize("dtype", ["float16", "float64", "int32", "uint8"])
def test_pull_across_dtypes_matches_mxnet(kv, dtype):
    """Pulling a float32 key of 2s into another dtype gives MXNet's numbers."""
    kv.init(3, full(2, np.float32))
    assert pulled(kv, 3, dtype).tolist() == MX["pull_casts_to_out_dtype"][dtype]


@pytest.mark.parametrize("pushed", ["float64", "float16", "int32"])
@pytest.mark.parametrize("with_updater", [False, True])
def test_push_of_another_dtype_is_cast_then_summed(kv, pushed, with_updater):
    """As MXNet, each pushed array is converted to the key's dtype before the sum."""
    values = [np.full(SHAPE, v, dtype=pushed) for v in (0.1, 0.2, 0.3)]
    kv.init(1, full(0, "float32"))
    if with_updater:
        kv.set_updater(lambda k, m, s: s.__iadd__(m))
    kv.push(1, values)
    as_key = [v.astype(np.float32) for v in values]
    expected = (as_key[0] + as_key[1]) + as_key[2]
    np.testing.assert_array_equal(pulled(kv, 1, "float32"), expected)
    np.testing.assert_array_equal(values[0], np.full(SHAPE, 0.1, dtype=pushed))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_non_native_byte_order_is_stored_native(kv, dtype, tmp_path):
    """A big-endian init value is stored in native order, so save/load and pushes round-trip."""
    swapped = np.dtype(dtype).newbyteorder("S")
    kv.init(1, np.arange(6).reshape(SHAPE).astype(swapped))
    kv.push(1, [full(1, swapped), full(2, dtype)])
    assert pulled(kv, 1, dtype).tolist() == full(3, dtype).tolist()
    kv.save(tmp_path / "kv.npz")
    kv.load(tmp_path / "kv.npz")
    fresh = gpukv.create(kv.type)
    fresh.load(tmp_path / "kv.npz")
    assert pulled(fresh, 1, dtype).tolist() == full(3, dtype).tolist()


def test_init_device_lists_may_differ_in_byte_order_only(kv):
    """Device-list init entries of one dtype in two byte orders agree; other dtypes do not."""
    kv.init(1, [full(2, ">f4"), full(2, "<f4")])
    assert pulled(kv, 1, "float32").tolist() == full(2, "float32").tolist()
    with pytest.raises(gpukv.DTypeError, match="key 2"):
        kv.init(2, [full(2, ">f4"), full(2, "<f8")])


@pytest.mark.parametrize("call", ["push", "pull", "init"])
def test_a_torch_dtype_numpy_has_not_is_a_dtype_error_that_changes_nothing(kv, call):
    """A float8 PyTorch tensor is refused as any unsupported dtype is: a DTypeError (a
    ValueError) naming the key and the dtypes gpukv takes; the call's other key keeps its
    value."""
    torch = pytest.importorskip("torch")
    eight = torch.zeros(2, dtype=torch.float8_e4m3fn)
    kv.init(["a", "w"], [np.zeros(2, np.float32)] * 2)
    calls = {"push": lambda: kv.push(["a", "w"], [np.ones(2, np.float32), eight]),
             "pull": lambda: kv.pull(["a", "w"], out=[np.ones(2, np.float32), eight]),
             "init": lambda: kv.init(["b", "x"], [np.ones(2, np.float32), eight])}
    with pytest.raises(gpukv.DTypeError, match=r"key '[wx]'.*float8_e4m3fn.*supported: "
                                               r"bfloat16, float16"):
        calls[call]()
    out = np.full(2, 5, np.float32)
    kv.pull("a", out=out)
    assert out.tolist() == [0, 0] and "b" not in kv.keys()
