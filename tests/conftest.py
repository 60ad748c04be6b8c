"""Shared fixtures, the GPUs of the run (tests/gpu_env.py), and the GPU gate."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

from . import gpu_env
from .gpu_gate import gpu_unavailable

gpu_env.install()

# JAX sees this many CPU devices (read once, when JAX starts), so the tests of sharded
# arrays have several devices without a GPU.
JAX_HOST_DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                               f"platform_device_count={JAX_HOST_DEVICES}").strip()

# CI runs the same examples every time, so a CI result never depends on a lucky draw;
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _no_user_calibration(tmp_path_factory):
    """No test (nor a subprocess it starts) reads or writes the user's cost-model
    calibration: the cache folder is a temporary one and GPUKV_CALIBRATION is unset."""
    from gpukv.comm.plan import simulate
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    patch.delenv("GPUKV_CALIBRATION", raising=False)
    simulate.reset_calibration()
    yield
    patch.undo()
    simulate.reset_calibration()


@pytest.fixture(scope="module", params=["numba", "numpy"])
def host_codec_path(request):
    """Runs a module's (or a test's) tests with the host's codecs compiled by Numba, then
    with their NumPy twins (GPUKV_HOST_JIT); modules take it with
    `pytestmark = pytest.mark.usefixtures("host_codec_path")`."""
    from gpukv.device import host_jit
    if request.param == "numba":
        pytest.importorskip("numba", reason="the compiled codecs need Numba (the test extra)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(host_jit.ENV, "1" if request.param == "numba" else "0")
        assert host_jit.enabled() == (request.param == "numba")
        yield request.param


@pytest.fixture(autouse=True)
def _timer_slack_kept():
    """A dist store's transport sets this process's timer slack to 1 us for its naps:
    put back after each test, so that later tests wait as they would alone (with that
    slack, test_threads' GIL switches every 1 us took 100x longer)."""
    from gpukv.distributed.mpi.transport import timer_slack
    before = timer_slack()
    yield
    timer_slack(before)


@pytest.fixture(autouse=True)
def _streams_settled():
    """Under the CUDA emulation, the work a test queued runs before the next test starts,
    and a race the checker found fails the test that made it, even where the code under
    test caught the error."""
    if not gpu_env.EMULATED or "cudaemu" not in sys.modules:
        yield
        return
    from cudaemu import races, streams
    del races.found[:]
    yield
    streams.drain_all()
    found, races.found[:] = list(races.found), []
    if found:
        pytest.fail("unordered GPU accesses:\n" + "\n".join(found), pytrace=False)


def _logical_gpus() -> int:
    from gpukv.device.cuda.device import gpu_count, gpu_devices
    return len(gpu_devices()) if gpu_count() else 0


def pytest_runtest_setup(item):
    """The GPU gate. A `multi_gpu(n)` test on a machine with fewer GPUs gets n logical
    ones through GPUKV_VIRTUAL_GPUS (for that test only), so it runs on one GPU too."""
    needed = 0
    if item.get_closest_marker("gpu") is not None:
        needed = 1
    multi = item.get_closest_marker("multi_gpu")
    if multi is not None:
        needed = max(needed, multi.args[0] if multi.args else 2)
    if not needed:
        return
    have = _logical_gpus()
    if have >= needed:
        return
    if have:
        item._virtual_gpus = pytest.MonkeyPatch()
        item._virtual_gpus.setenv("GPUKV_VIRTUAL_GPUS", str(needed))
        return
    gpu_unavailable(f"needs {needed} GPU(s), none is visible")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """The gate's GPUKV_VIRTUAL_GPUS is undone after the test's own fixtures (which may
    have set it too) are torn down."""
    try:
        return (yield)
    finally:
        patch = getattr(item, "_virtual_gpus", None)
        if patch is not None:
            patch.undo()
