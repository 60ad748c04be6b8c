"""gpukv.jax's pulls onto a GPU (on the CUDA emulation, with JAX on the CPU): the key is
pulled into a buffer on that GPU, handed to JAX by DLPack, never through the host."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import gpukv  # noqa: E402
import gpukv.jax as gjax  # noqa: E402
from gpukv.jax import placing, trees  # noqa: E402

pytestmark = pytest.mark.gpu


class _JaxGpu:
    """What gpukv reads of a JAX GPU device (JAX here has none)."""
    platform = "gpu"

    def __init__(self, index: int):
        self.local_hardware_id = index


@pytest.mark.parametrize("bucket_bytes", [0, gjax.BUCKET_BYTES])
def test_a_pull_onto_a_gpu_hands_over_the_gpus_own_buffer(bucket_bytes, monkeypatch):
    import cupy
    handed = []

    def from_dlpack(buffer):  # JAX's import of a GPU buffer, seen from the CPU
        handed.append(buffer)
        return jnp.asarray(cupy.asnumpy(buffer))
    monkeypatch.setattr(jax.dlpack, "from_dlpack", from_dlpack)
    kv = gpukv.create("device")
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    gjax.init_tree(kv, tree, bucket_bytes=bucket_bytes)
    layout = trees.layout_of(kv, "", "pull_tree")
    from gpukv.device.cuda.device import gpu_count
    last = gpu_count() - 1  # another GPU than the current one where there are several
    gpu = _JaxGpu(last)
    assert placing._is_gpu(gpu)
    buffers = [placing._buffers(bucket, {gpu}) for bucket in layout.buckets]
    kv.pull(layout.bucket_keys, out=[list(b.values()) for b in buffers])
    of_leaf = {i: (b, k) for b, bucket in enumerate(layout.buckets)
               for k, i in enumerate(bucket.leaves)}
    made = placing._Made(layout, buffers, of_leaf)
    made.place([(b, gpu) for b in range(len(layout.buckets))])
    leaves = [made.on(i, gpu) for i in range(len(layout.keys))]
    assert len(handed) == len(layout.buckets)
    for buffer in handed:
        assert isinstance(buffer, cupy.ndarray) and buffer.device.id == last
    for got, want in zip(leaves, jax.tree_util.tree_leaves(tree)):
        np.testing.assert_array_equal(np.asarray(got), want)
