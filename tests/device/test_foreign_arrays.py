"""Arrays from other libraries and protocols: pushed without copies, pulled into in place."""
from __future__ import annotations

import array

import numpy as np
import pytest

import gpukv

from ..bfloat16 import BF16, needs_bfloat16
from ..foreign import ArrayInterfaceOnly, DLPackOnly, OnDLPackDevice

SHAPE = (2, 3)


@pytest.fixture(params=["local", "device"])
def kv(request):
    return gpukv.create(request.param)


def readonly(a):
    a.flags.writeable = False
    return a


def pulled(kv, key, shape=SHAPE, dtype=np.float32):
    out = np.zeros(shape, dtype)
    kv.pull(key, out=out)
    return out


# -------------------------------------------------------------------------------- torch
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_torch_cpu_push_and_pull_in_place(kv, torch):
    """CPU tensors are init/push sources, and pull writes into the tensor's own memory."""
    kv.init(1, torch.zeros(SHAPE))
    kv.push(1, [torch.ones(SHAPE), torch.full(SHAPE, 2.0)])
    out = torch.zeros(SHAPE)
    pointer = out.data_ptr()
    kv.pull(1, out=out)
    assert out.data_ptr() == pointer
    assert torch.equal(out, torch.full(SHAPE, 3.0))


def test_torch_pushpull_writes_back_into_tensors(kv, torch):
    """pushpull without out writes the result back into every pushed tensor."""
    kv.init(1, torch.zeros(SHAPE))
    grads = [torch.full(SHAPE, float(i)) for i in range(1, 4)]
    kv.pushpull(1, grads)
    assert all(torch.equal(g, torch.full(SHAPE, 6.0)) for g in grads)


def test_torch_mixed_with_numpy(kv, torch):
    """Tensors and NumPy arrays mix in one device list and one list of keys."""
    kv.init([1, 2], [np.zeros(SHAPE, np.float32), torch.zeros(SHAPE)])
    kv.push([1, 2], [[torch.ones(SHAPE), np.ones(SHAPE, np.float32)],
                     np.full(SHAPE, 5, np.float32)])
    outs = [torch.zeros(SHAPE), np.zeros(SHAPE, np.float32)]
    kv.pull([1, 2], out=outs)
    assert torch.equal(outs[0], torch.full(SHAPE, 2.0)) and (outs[1] == 5).all()


def test_torch_requires_grad_tensors(kv, torch):
    """Tensors that require grad are pushed, and parameters pulled into in place under
    torch.no_grad() (as an optimizer writes them)."""
    param = torch.nn.Parameter(torch.zeros(SHAPE))
    kv.init("w", torch.ones(SHAPE))
    kv.push("w", torch.ones(SHAPE, requires_grad=True) * 4)
    with torch.no_grad():
        kv.pull("w", out=param)
    assert torch.equal(param.detach(), torch.full(SHAPE, 4.0)) and param.requires_grad


def test_torch_non_contiguous_out(kv, torch):
    """A transposed tensor is pulled into through its strides."""
    kv.init(1, torch.arange(6, dtype=torch.float32).reshape(SHAPE))
    base = torch.zeros(SHAPE[::-1])
    kv.pull(1, out=base.t())
    assert torch.equal(base.t(), torch.arange(6, dtype=torch.float32).reshape(SHAPE))


@pytest.mark.parametrize("name", ["float16", pytest.param("bfloat16", marks=needs_bfloat16),
                                  "float64", "int32", "int64", "uint8"])
def test_torch_dtypes(kv, torch, name):
    """Tensors of every supported dtype, bfloat16 included, round-trip in place."""
    dtype = getattr(torch, name)
    kv.init(1, torch.zeros(SHAPE, dtype=dtype))
    kv.push(1, [torch.ones(SHAPE, dtype=dtype)] * 3)
    out = torch.zeros(SHAPE, dtype=dtype)
    kv.pull(1, out=out)
    assert out.dtype == dtype and torch.equal(out, torch.full(SHAPE, 3, dtype=dtype))


def test_torch_negative_view_is_a_source_not_an_out(kv, torch):
    """A lazily negated tensor pushes its values, but pulling into it raises ReadOnlyError."""
    kv.init(1, torch.zeros(SHAPE))
    neg = torch.ones(SHAPE)._neg_view()
    kv.push(1, neg)
    assert (pulled(kv, 1) == -1).all()
    with pytest.raises(gpukv.ReadOnlyError):
        kv.pull(1, out=torch.zeros(SHAPE)._neg_view())


def test_torch_bool_is_unsupported(kv, torch):
    """A bool tensor is an unsupported dtype (ValueError)."""
    with pytest.raises(gpukv.DTypeError):
        kv.init(1, torch.ones(SHAPE, dtype=torch.bool))


def test_torch_push_does_not_alias(kv, torch):
    """Changing a pushed tensor afterwards changes nothing in the store."""
    kv.init(1, torch.zeros(SHAPE))
    t = torch.full(SHAPE, 2.0)
    kv.push(1, t)
    t.fill_(9.0)
    assert (pulled(kv, 1) == 2).all()


# ----------------------------------------------------------------------------- DLPack
def test_dlpack_only_source_and_out(kv):
    """An object exposing only __dlpack__ is read as a source and written as an out in place."""
    kv.init(1, DLPackOnly(np.full(SHAPE, 2, np.float32)))
    kv.push(1, [DLPackOnly(np.ones(SHAPE, np.float32)), DLPackOnly(np.ones(SHAPE, np.float32))])
    backing = np.zeros(SHAPE, np.float32)
    kv.pull(1, out=DLPackOnly(backing))
    assert (backing == 2).all()


def test_dlpack_read_only_source_is_fine(kv):
    """A read-only DLPack source can be pushed."""
    kv.init(1, np.zeros(SHAPE, np.float32))
    kv.push(1, DLPackOnly(readonly(np.full(SHAPE, 3, np.float32))))
    assert (pulled(kv, 1) == 3).all()


def test_dlpack_read_only_out_raises(kv):
    """Pulling into a read-only DLPack object is a ReadOnlyError, and nothing is written."""
    kv.init(1, np.ones(SHAPE, np.float32))
    target = readonly(np.zeros(SHAPE, np.float32))
    with pytest.raises(gpukv.ReadOnlyError):
        kv.pull(1, out=DLPackOnly(target))
    assert (target == 0).all()


# ---------------------------------------------------------------- __array_interface__
def test_array_interface_only_source_and_out(kv):
    """An object exposing only __array_interface__ is a source and an out written in place."""
    kv.init(1, ArrayInterfaceOnly(np.zeros(SHAPE, np.float32)))
    kv.push(1, ArrayInterfaceOnly(np.full(SHAPE, 7, np.float32)))
    backing = np.zeros(SHAPE, np.float32)
    kv.pull(1, out=ArrayInterfaceOnly(backing))
    assert (backing == 7).all()


def test_array_interface_read_only_out_raises(kv):
    """A read-only array-interface out is a ReadOnlyError."""
    kv.init(1, np.ones(SHAPE, np.float32))
    with pytest.raises(gpukv.ReadOnlyError):
        kv.pull(1, out=ArrayInterfaceOnly(readonly(np.zeros(SHAPE, np.float32))))


# ------------------------------------------------------------------------ buffer protocol
def test_array_array_source_and_out(kv):
    """array.array (buffer protocol only) is pushed and pulled into in place."""
    kv.init(1, array.array("d", [0.0] * 4))
    kv.push(1, [array.array("d", [1, 2, 3, 4]), array.array("d", [1, 1, 1, 1])])
    out = array.array("d", [0.0] * 4)
    kv.pull(1, out=out)
    assert out.tolist() == [2, 3, 4, 5]


def test_bytearray_out_and_memoryview_source(kv):
    """A bytearray is a writable uint8 out; a read-only memoryview is a fine source."""
    kv.init(1, np.zeros(4, np.uint8))
    kv.push(1, memoryview(b"\x01\x02\x03\x04"))
    out = bytearray(4)
    kv.pull(1, out=out)
    assert out == bytearray(b"\x01\x02\x03\x04")


def test_memoryview_cast_shapes(kv):
    """A multi-dimensional memoryview keeps its shape and dtype."""
    backing = np.zeros(SHAPE, np.float32)
    kv.init(1, np.full(SHAPE, 5, np.float32))
    kv.pull(1, out=memoryview(backing))
    assert (backing == 5).all()


def test_read_only_memoryview_out_raises(kv):
    """Pulling into a memoryview of bytes (read-only) is a ReadOnlyError."""
    kv.init(1, np.zeros(4, np.float64))
    with pytest.raises(gpukv.ReadOnlyError) as info:
        kv.pull(1, out=memoryview(bytes(32)).cast("d"))
    assert isinstance(info.value, ValueError)


def test_read_only_numpy_source_is_fine(kv):
    """Read-only NumPy arrays are valid init and push sources."""
    kv.init(1, readonly(np.full(SHAPE, 1, np.float32)))
    kv.push(1, [readonly(np.ones(SHAPE, np.float32))] * 2)
    assert (pulled(kv, 1) == 2).all()


# ------------------------------------------------------------ devices gpukv cannot use
@pytest.mark.parametrize("device", [(2, 99), (13, 99), (10, 0), (14, 0), (4, 0)],
                         ids=["cuda-99", "cuda-managed-99", "rocm", "oneapi", "opencl"])
@pytest.mark.parametrize("role", ["value", "out"])
def test_array_on_a_device_that_does_not_exist_is_a_device_error(kv, device, role):
    """A DLPack array on a missing GPU, or on a device kind gpukv lacks, is a DeviceError."""
    if device[0] in (2, 13):
        pytest.importorskip("cupy")  # without CuPy it is a BackendError saying how to get it
    kv.init(1, np.ones(SHAPE, np.float32))
    call = kv.push if role == "value" else (lambda k, v: kv.pull(k, out=v))
    with pytest.raises(gpukv.DeviceError, match=f"key 1: {role}: ") as info:
        call(1, [np.ones(SHAPE, np.float32), OnDLPackDevice(*device)])
    assert isinstance(info.value, ValueError)
    assert ("GPU" if device[0] in (2, 13) else f"device type {device[0]}") in str(info.value)
    assert (pulled(kv, 1) == 1).all()


@pytest.mark.parametrize("role", ["value", "out"])
def test_torch_meta_tensor_is_a_device_error(kv, torch, role):
    """A PyTorch tensor on the 'meta' device (no memory) is a DeviceError naming the key."""
    kv.init(1, np.ones(SHAPE, np.float32))
    meta = torch.ones(SHAPE, device="meta")
    with pytest.raises(gpukv.DeviceError, match="key 1: .*'meta'"):
        if role == "value":
            kv.push(1, meta)
        else:
            kv.pull(1, out=meta)
    assert (pulled(kv, 1) == 1).all()


def test_torch_sparse_tensor_is_an_argument_kind_error(kv, torch):
    """A sparse-layout PyTorch tensor is an ArgumentKindError (TypeError) naming the key."""
    kv.init(1, np.ones(SHAPE, np.float32))
    with pytest.raises(gpukv.ArgumentKindError, match="key 1: .*to_dense") as info:
        kv.push(1, torch.ones(SHAPE).to_sparse())
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("view", ["expand", "stride0"])
def test_torch_expanded_tensor_is_a_source_not_an_out(kv, torch, view):
    """An expanded tensor (rows sharing memory) is read as a source but refused as an out."""
    base = torch.arange(3, dtype=torch.float32)
    t = base.expand(2, 3) if view == "expand" else torch.as_strided(base, SHAPE, (0, 1))
    kv.init(1, np.arange(6, dtype=np.float32).reshape(SHAPE))
    with pytest.raises(gpukv.ReadOnlyError, match="key 1"):
        kv.pull(1, out=t)
    assert base.tolist() == [0, 1, 2]
    kv.push(1, t)
    assert pulled(kv, 1).tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.int64, np.uint8])
def test_numpy_scalars_are_sources_never_outs(kv, scalar):
    """A NumPy scalar (np.float64 as well as np.float32) is a 0-d source; as an out, read-only."""
    kv.init(1, scalar(2))
    kv.push(1, [scalar(3), np.ones((), scalar)])
    out = np.zeros((), scalar)
    kv.pull(1, out=out)
    assert out == 4
    target = scalar(0)
    with pytest.raises(gpukv.ReadOnlyError, match="key 1"):
        kv.pull(1, out=target)
    assert target == 0


def _cupy_view(shape, strides, dtype=np.float32):
    """A CuPy array header over made-up device memory (never read: no GPU is needed)."""
    cupy = pytest.importorskip("cupy")
    mem = cupy.cuda.UnownedMemory(1 << 20, 1 << 12, None, device_id=0)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=strides)


@pytest.mark.parametrize("strides", [(0, 4), (4, 4), (8, 0)], ids=["expanded", "overlap", "bcast"])
def test_gpu_out_with_shared_elements_is_refused(kv, strides):
    """A CuPy out whose elements share memory (zero stride, as an expanded PyTorch CUDA
    tensor arrives; or overlapping rows) is a ReadOnlyError naming the key, before any
    copy."""
    kv.init("w", np.zeros((3, 4), np.float32))
    out = _cupy_view((3, 4), strides)
    with pytest.raises(gpukv.ReadOnlyError, match="'w'.*sharing memory"):
        kv.pull("w", out=out)
    with pytest.raises(gpukv.ReadOnlyError, match="'w'"):
        kv.pushpull("w", np.ones((3, 4), np.float32), out=out)


def test_writable_host_out_with_shared_elements_is_refused(kv):
    """A writable NumPy view with a zero stride (as_strided) is refused as an out too."""
    from numpy.lib.stride_tricks import as_strided
    kv.init("w", np.zeros((3, 4), np.float32))
    base = np.zeros(4, np.float32)
    with pytest.raises(gpukv.ReadOnlyError, match="'w'"):
        kv.pull("w", out=as_strided(base, (3, 4), (0, 4)))
    assert not base.any()


@pytest.mark.parametrize("shape,strides,expected", [
    ((3, 4), (16, 4), False), ((3, 4), (4, 12), False), ((3, 2), (8, 12), False),
    ((4,), (-4,), False), ((3, 4), (0, 4), True), ((3, 4), (4, 4), True),
    ((2, 2), (4, 4), True), ((5,), (2,), True), ((0, 4), (0, 4), False), ((1, 4), (0, 4), False),
])
def test_has_overlapping_elements_from_strides(shape, strides, expected):
    """Element overlap is read from shape and strides alone, for any array-like header."""
    import types

    from gpukv.device import has_overlapping_elements
    header = types.SimpleNamespace(shape=shape, strides=strides, itemsize=4,
                                   flags=types.SimpleNamespace(c_contiguous=False,
                                                               f_contiguous=False))
    assert has_overlapping_elements(header) is expected


class _DLPackOf:
    """A CPU array seen only through DLPack (as a JAX array is, first)."""

    def __init__(self, tensor, array=None):
        self._tensor, self._array = tensor, array

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


class _DLPackAndArray(_DLPackOf):
    def __array__(self, dtype=None, copy=None):
        return self._array


@needs_bfloat16
def test_bfloat16_over_dlpack_is_a_typed_error_naming_the_key():
    """A bfloat16 array NumPy cannot take over DLPack is a DTypeError naming the key, not
    NumPy's bare RuntimeError; with `__array__` too (as JAX arrays have) it is pushed."""
    torch = pytest.importorskip("torch")
    kv = gpukv.create("local")
    kv.init("w", np.zeros(3, BF16))
    grad = torch.full((3,), 2.0, dtype=torch.bfloat16)
    with pytest.raises(gpukv.DTypeError, match="key 'w'.*DLPack"):
        kv.push("w", _DLPackOf(grad))
    kv.push("w", _DLPackAndArray(grad, np.full(3, 2.0, BF16)))
    out = np.zeros(3, BF16)
    kv.pull("w", out=out)
    assert out.astype(np.float32).tolist() == [2.0, 2.0, 2.0]


class _NoUfuncs(np.ndarray):
    __array_ufunc__ = None  # NumPy's arithmetic refuses it


class _TimesTen(np.ndarray):
    """A subclass whose arithmetic is its own: it multiplies its operands by ten."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = [i.view(np.ndarray) * 10 if isinstance(i, _TimesTen) else i for i in inputs]
        kwargs["out"] = tuple(o.view(np.ndarray) for o in kwargs.get("out", ()))
        return getattr(ufunc, method)(*inputs, **kwargs)


@pytest.mark.parametrize("cls", [_NoUfuncs, _TimesTen, np.matrix])
def test_numpy_subclasses_are_summed_and_written_as_their_elements(kv, cls):
    """A subclass of NumPy's array is its elements: its own arithmetic (none, or another
    sum) plays no part in the store's sums, on one device or several, and an out of the
    class is written in place."""
    kv.init(["a", "b"], [np.zeros((1, 3), np.float32)] * 2)
    ones = np.ones((1, 3), np.float32)
    kv.push(["b", "a"], [ones, [ones.view(cls), ones.view(cls)]])
    kv.push("b", ones.view(cls))
    out = np.zeros((1, 3), np.float32).view(cls)
    kv.pull("a", out=out)
    assert np.asarray(out.view(np.ndarray)).tolist() == [[2, 2, 2]]
    assert pulled(kv, "b", (1, 3)).tolist() == [[1, 1, 1]]


@pytest.mark.parametrize("role", ["value", "out"])
def test_a_masked_array_is_refused_naming_the_key(kv, role):
    """The store reads and writes every element: a mask would be ignored (masked
    elements summed, a pulled value hidden), so a masked array is refused before
    anything changes."""
    kv.init(["a", "b"], [np.zeros(3, np.float32)] * 2)
    masked = np.ma.array([1, 2, 3], mask=[0, 1, 0], dtype=np.float32)
    with pytest.raises(gpukv.ArgumentKindError, match="key 'b'.*masked array"):
        if role == "value":
            kv.push(["a", "b"], [np.ones(3, np.float32), masked])
        else:
            kv.pull(["a", "b"], out=[np.zeros(3, np.float32), masked])
    assert pulled(kv, "a", (3,)).tolist() == [0, 0, 0]


def test_a_dtype_with_named_fields_is_refused_naming_the_key(kv):
    """float32 with a named field calls itself float32 but saves as a structured dtype
    no store loads: a DTypeError, as structured dtypes are."""
    aliased = np.dtype(("f4", {"re": ("f4", 0)}))
    with pytest.raises(gpukv.DTypeError, match="key 7: unsupported dtype"):
        kv.init(7, np.ones(3, np.float32).astype(aliased))
    assert 7 not in kv
