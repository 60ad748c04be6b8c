"""deterministic=True across processes: the same eight gradients, split over 1, 2, 4 or 8
workers, with 0, 1 or 2 servers, on the host or on (emulated) GPUs, give the bits of the
canonical tree's sum (gpukv.canonical), and of the same SGD rounds on one process."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from gpukv.canonical.tree import leaves_sum

from .. import gpu_env
from . import digests
from .mpirun import PROGRAMS, ok, run

pytestmark = pytest.mark.mpi

_spec = importlib.util.spec_from_file_location("digest_program", PROGRAMS / "digest.py")
assert _spec is not None and _spec.loader is not None
digest_program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digest_program)

#: (workers, servers): every split of 8 devices over workers, with 0, 1 and 2 servers
LAYOUTS = [(w, s) for w in (1, 2, 4, 8) for s in (0, 1, 2)]


def reference_sum() -> str:
    """The canonical tree's sum of each key's 8 leaves, in float32 (float64 for a float64
    key), rounded once."""
    names = sorted(digest_program.KEYS)
    sums = []
    for name in names:
        wide = np.float64 if digest_program.KEYS[name][0] == "float64" else np.float32
        values = [v.astype(wide) for v in digest_program.leaves(name)]
        total = leaves_sum(values, np.add)
        sums.append(total.astype(digest_program.KEYS[name][0]))
    return digest_program.digest(sums)


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The digests of the one-process 'local' store given all 8 leaves."""
    found = digests.one_process()
    assert found["sum"] == reference_sum(), "the one-process store is not canonical"
    return found


@pytest.mark.parametrize("workers,servers", LAYOUTS)
def test_every_split_over_processes_and_servers_gives_one_digest(one_process, workers,
                                                                 servers):
    """8 host gradients on 8 // workers per worker, num_servers=servers: the bits of one
    process, for the sum and after SGD."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), STORE="dist_sync")
    out = ok(run("digest.py", workers + servers, str(8 // workers), env=env, timeout=180))
    assert digests.digests(out) == one_process, out


@pytest.mark.gpu
@pytest.mark.parametrize("workers,servers", [(2, 0), (4, 0), (2, 1)])
def test_gpu_values_across_processes_give_the_same_digest(one_process, workers, servers):
    """dist_device_sync on the (emulated) GPUs of each process: the host's bits."""
    env = gpu_env.subprocess_env(gpus=True)
    env.update(GPUKV_NUM_SERVERS=str(servers), STORE="dist_device_sync")
    out = ok(run("digest.py", workers + servers, str(8 // workers), env=env, timeout=240))
    assert digests.digests(out) == one_process, out


@pytest.mark.parametrize("workers,servers", [(2, 0), (4, 0), (8, 0), (2, 1)])
def test_float32_pushes_into_a_float16_key_are_converted_first(workers, servers):
    """Values pushed as float32 into a float16 key are converted to float16 before the
    sum, as one process converts them: every layout gives one process's bits."""
    reference = digests.one_process(DIGEST_WIDE="1")
    assert reference != digests.one_process(), "the float32 values must differ in float16"
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), STORE="dist_sync", DIGEST_WIDE="1")
    out = ok(run("digest.py", workers + servers, str(8 // workers), env=env, timeout=180))
    assert digests.digests(out) == reference, out


def test_without_it_layouts_differ_on_this_data(one_process):
    """The store's default order gives these gradients other bits on 4 workers than the
    canonical order does (so the tests above can fail)."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", STORE="dist_sync", DIGEST_DEFAULT="1")
    out = ok(run("digest.py", 4, "2", env=env, timeout=180))
    assert digests.digests(out)["sum"] != one_process["sum"], out
