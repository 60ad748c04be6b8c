"""Gradient compression in deterministic dist stores: each value a worker pushes is a
leaf compressed on its own (its own residual), and whoever sums decodes every leaf's
payload and sums them as one process does, so 8 values split over 2, 4 or 8 workers,
with 0 or 1 server, give the bits of one process given all 8 (programs/digest.py with
DIGEST_COMPRESS=1: fp16 with a pre_divide, 2-bit, sign, ternary and PowerSGD, three
rounds each, with and without SGD). PowerSGD's leaves have their own residuals too, and
its two sums follow the canonical tree."""
from __future__ import annotations

import pytest

from .. import gpu_env
from . import digests
from .mpirun import ok, run

pytestmark = pytest.mark.mpi

PHASES = ["fp16_sum", "twobit_sum", "sign_sum", "ternary_sum", "powersgd_sum", "twobit_sgd",
          "fp16_sgd", "sign_sgd", "ternary_sgd", "powersgd_sgd"]


def _env(gpus: bool = False) -> dict:
    env = gpu_env.subprocess_env(gpus=gpus)
    env["DIGEST_COMPRESS"] = "1"
    return env


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The digests of the one-process deterministic 'device' store given all 8 leaves."""
    found = digests.one_process("device", DIGEST_COMPRESS="1")
    assert sorted(found) == sorted(PHASES), found
    return found


@pytest.mark.parametrize("workers,servers,codecs",
                         [(2, 0, "numba"), (8, 0, "numpy"), (2, 1, "numpy")],
                         ids=lambda v: str(v))
def test_compressed_leaves_give_the_bits_of_one_process(one_process, workers, servers,
                                                        codecs):
    """8 host gradients on 8 // workers per worker, compressed (fp16 with pre_divide 3,
    2-bit with threshold 0.5, sign, ternary, PowerSGD; residuals carried over rounds), without an
    updater and with SGD: every phase's values are the bits of one process (Numba's
    codecs where it is installed), the workers' codecs Numba's or their NumPy twins."""
    if codecs == "numba":
        pytest.importorskip("numba", reason="the compiled codecs need Numba (the test extra)")
    env = _env()
    env.update(GPUKV_NUM_SERVERS=str(servers), STORE="dist_sync",
               GPUKV_HOST_JIT="1" if codecs == "numba" else "0")
    out = ok(run("digest.py", workers + servers, str(8 // workers), env=env, timeout=240))
    assert digests.digests(out) == one_process, out


def test_pieces_shorter_than_a_codecs_blocks_apart_give_the_bits_of_one_process(one_process):
    """bigarray_bound=100 on 4 workers: 'small' (1000 values) is split in shares of 250,
    which pieces cut at multiples of 128, where sign's and ternary's blocks fall in the
    whole key: one process's bits still."""
    env = _env()
    env.update(GPUKV_NUM_SERVERS="0", STORE="dist_sync", DIGEST_BOUND="100")
    out = ok(run("digest.py", 4, "2", env=env, timeout=240))
    assert digests.digests(out) == one_process, out


@pytest.mark.gpu
def test_gpu_values_give_the_bits_of_one_process(one_process):
    """dist_device_sync with each worker's 4 values on its (emulated) GPUs, compressed:
    the host's one-process bits."""
    env = _env(gpus=True)
    env.update(GPUKV_NUM_SERVERS="0", STORE="dist_device_sync")
    out = ok(run("digest.py", 2, "4", env=env, timeout=240))
    assert digests.digests(out) == one_process, out
