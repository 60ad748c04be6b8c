"""Outs of other libraries written as their own library would: PyTorch's autograd rules and
version counters, and objects whose `__array__` hands out a copy."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv

from ..foreign import ArrayMethodCopy, ArrayMethodOnly

SHAPE = (2, 3)
#: every call that writes into arrays the caller gives
CALLS = ["pull", "pushpull", "pushpull-in-place", "broadcast"]


@pytest.fixture(params=["local", "device"])
def kv(request):
    return gpukv.create(request.param)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def write(kv, call, keys, targets):
    """Run `call` so that it writes the value of `keys` (all 5; broadcast initialises
    them, the other calls find them initialised) into `targets`."""
    values = [np.full(SHAPE, 5, np.float32) for _ in keys]
    if call == "pull":
        kv.pull(keys, out=targets)
    elif call == "pushpull":
        kv.pushpull(keys, values, out=targets)
    elif call == "pushpull-in-place":  # out=None: the values are written back
        kv.pushpull(keys, targets)
    else:
        kv.broadcast(keys, values, out=targets)


def stored(kv, call, keys):
    """`kv` with `keys` initialised to 5 unless `call` (broadcast) initialises them."""
    if call != "broadcast":
        kv.init(keys, [np.full(SHAPE, 5, np.float32) for _ in keys])
    return kv


def assert_unchanged(kv, call, key):
    """The refused call changed nothing in the store: `key` is as `stored` left it."""
    if call == "broadcast":
        assert key not in kv
    else:
        out = np.zeros(SHAPE, np.float32)
        kv.pull(key, out=out)
        assert (out == 5).all()


# ------------------------------------------------------------------------------ PyTorch
@pytest.mark.parametrize("call", CALLS)
def test_leaf_that_requires_grad_is_refused_outside_no_grad(kv, torch, call):
    """A leaf tensor that requires grad, outside torch.no_grad(), is refused as PyTorch
    refuses `t.copy_(v)`: a ReadOnlyError naming the key, the whole call unchanged."""
    keys = ["a", "w"]
    first, leaf = np.zeros(SHAPE, np.float32), torch.zeros(SHAPE, requires_grad=True)
    with pytest.raises(gpukv.ReadOnlyError, match=r"key 'w'.*leaf.*torch\.no_grad"):
        write(stored(kv, call, keys), call, keys, [first, leaf])
    assert (first == 0).all() and not leaf.detach().any() and leaf._version == 0
    assert_unchanged(kv, call, "a")


@pytest.mark.parametrize("call", CALLS)
def test_tensor_in_an_autograd_graph_is_refused_outside_no_grad(kv, torch, call):
    """A non-leaf tensor that requires grad (a view of a parameter, a result) is refused
    outside torch.no_grad(): the write could not be recorded in its graph."""
    param = torch.zeros((4,) + SHAPE, requires_grad=True)
    with pytest.raises(gpukv.ReadOnlyError, match=r"key 'w'.*autograd graph"):
        write(stored(kv, call, ["w"]), call, ["w"], [param[1]])
    assert not param.detach().any()
    assert_unchanged(kv, call, "w")


@pytest.mark.parametrize("call", CALLS)
def test_leaf_that_requires_grad_is_written_under_no_grad(kv, torch, call):
    """Under torch.no_grad() (as an optimizer step) a parameter is written in place, still
    requires grad, and its version counter moves."""
    param = torch.nn.Parameter(torch.zeros(SHAPE))
    stored(kv, call, ["w"])
    if call == "pushpull-in-place":
        param.data.fill_(5)  # what it pushes is what it gets back
    with torch.no_grad():
        write(kv, call, ["w"], [param])
    assert torch.equal(param.detach(), torch.full(SHAPE, 5.0)) and param.requires_grad
    assert param._version > 0


@pytest.mark.parametrize("writer", ["copy_", "gpukv"])
@pytest.mark.parametrize("call", CALLS)
def test_backward_through_a_saved_tensor_written_since_fails(kv, torch, call, writer):
    """A tensor saved by autograd and written since makes backward fail as it does after
    PyTorch's own `copy_`, instead of giving a wrong gradient without a word."""
    weight = torch.ones(SHAPE, requires_grad=True)
    saved = torch.zeros(SHAPE)
    loss = (weight * saved).sum()  # saves `saved` for the gradient of `weight`
    stored(kv, call, ["w"])
    if writer == "copy_":
        saved.copy_(torch.full(SHAPE, 5.0))
    else:
        write(kv, call, ["w"], [saved])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_every_out_of_a_device_list_moves_its_version(kv, torch):
    """A pull into one key's list of tensors moves the version of each of them."""
    outs = [torch.zeros(SHAPE) for _ in range(3)]
    kv.init("w", np.full(SHAPE, 5, np.float32))
    kv.pull("w", out=outs)
    assert [t._version for t in outs] == [1, 1, 1]


def test_inference_tensor_is_written_only_in_inference_mode(kv, torch):
    """An inference tensor is refused outside torch.inference_mode(), as PyTorch refuses
    an in-place write to it, and is written inside it."""
    with torch.inference_mode():
        out = torch.zeros(SHAPE)
    kv.init("w", np.full(SHAPE, 5, np.float32))
    with pytest.raises(gpukv.ReadOnlyError, match=r"key 'w'.*inference_mode"):
        kv.pull("w", out=out)
    assert not out.any()
    with torch.inference_mode():
        kv.pull("w", out=out)
    assert torch.equal(out, torch.full(SHAPE, 5.0))


# ------------------------------------------------------------------------- __array__
@pytest.mark.parametrize("call", CALLS)
def test_out_whose_array_method_returns_a_copy_is_refused(kv, call):
    """An out seen only through an `__array__` that returns a new copy each time would
    lose the write: a ReadOnlyError naming the key, the whole call unchanged."""
    keys = ["a", "w"]
    first, target = np.zeros(SHAPE, np.float32), ArrayMethodCopy(np.zeros(SHAPE, np.float32))
    with pytest.raises(gpukv.ReadOnlyError, match=r"key 'w'.*__array__ returns a copy"):
        write(stored(kv, call, keys), call, keys, [first, target])
    assert (first == 0).all() and (target.a == 0).all()
    assert_unchanged(kv, call, "a")


def test_out_whose_array_method_returns_its_memory_is_written(kv):
    """An `__array__` that hands out the object's own memory makes a fine out."""
    target = ArrayMethodOnly(np.zeros(SHAPE, np.float32))
    kv.init("w", np.full(SHAPE, 5, np.float32))
    kv.pull("w", out=target)
    assert (target.a == 5).all()


def test_array_method_copy_is_a_fine_source(kv):
    """An object whose `__array__` returns a copy is pushed as any source is."""
    kv.init("w", np.zeros(SHAPE, np.float32))
    kv.push("w", ArrayMethodCopy(np.full(SHAPE, 3, np.float32)))
    out = np.zeros(SHAPE, np.float32)
    kv.pull("w", out=out)
    assert (out == 3).all()
