"""Which host codecs run: Numba's compiled ones when it imports and GPUKV_HOST_JIT is not
'0', else the NumPy twins (both are held to the codecs' rules in tests/encoding)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import gpukv.device
from gpukv import ArgumentError
from gpukv.device import host_codecs, host_jit


@pytest.fixture
def fresh(monkeypatch):
    """host_jit looks for Numba again; the test's changes to sys.modules are undone."""
    host_jit._kernels.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    host_jit._kernels.cache_clear()


def test_without_numba_the_numpy_twins_run(fresh):
    fresh.delenv(host_jit.ENV, raising=False)
    fresh.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    fresh.delitem(sys.modules, "gpukv.device.host_jit_kernels", raising=False)
    fresh.delattr(gpukv.device, "host_jit_kernels", raising=False)
    assert not host_jit.enabled()
    g = np.linspace(-1, 1, 300, dtype=np.float32)
    r = np.zeros_like(g)
    payload = host_codecs.quantize_sign(g, r, np.empty(host_codecs.sign_nbytes(300), np.uint8))
    out = np.empty_like(g)
    host_codecs.dequantize_sign(payload, 300, out, False)
    np.testing.assert_allclose(out + r, g, atol=1e-6)  # what was sent plus what is left


def test_the_environment_turns_them_off(fresh):
    pytest.importorskip("numba")
    fresh.setenv(host_jit.ENV, "0")
    assert not host_jit.enabled()
    fresh.setenv(host_jit.ENV, "1")
    assert host_jit.enabled()


def test_a_malformed_setting_is_named_and_encodes_nothing(fresh):
    fresh.setenv(host_jit.ENV, "yes")
    g = np.ones(100, np.float32)
    r = np.zeros_like(g)
    with pytest.raises(ArgumentError, match="GPUKV_HOST_JIT='yes'"):
        host_codecs.quantize_ternary(g, r, np.empty(host_codecs.ternary_nbytes(100), np.uint8))
    assert not r.any()


def test_a_malformed_setting_is_refused_when_compression_is_set(fresh):
    kv = gpukv.create("device")
    kv.init("w", np.zeros(8, np.float32))
    fresh.setenv(host_jit.ENV, "on")
    with pytest.raises(ArgumentError, match="GPUKV_HOST_JIT='on'"):
        kv.set_gradient_compression({"type": "sign"})
    fresh.setenv(host_jit.ENV, "0")
    kv.set_gradient_compression({"type": "sign"})  # nothing was set: it can be now
    kv.push("w", [np.ones(8, np.float32)] * 2)
    out = np.empty(8, np.float32)
    kv.pull("w", out=out)
    assert out.any()


@pytest.mark.parametrize("name", ["device", "local"])
def test_a_malformed_setting_is_refused_when_a_store_is_made(fresh, name):
    """The host's float16 sums read it too, with or without compression."""
    fresh.setenv(host_jit.ENV, "true")
    with pytest.raises(ArgumentError, match="GPUKV_HOST_JIT='true'"):
        gpukv.create(name)


# Numba refusing to cache, as where gpukv is installed in a folder the user cannot write in
# and their home is not writable either: every folder Numba tries fails its write test,
# except (with "temp") the folder NUMBA_CACHE_DIR names.
_NO_CACHE = """
import hashlib, logging, os, sys
import numba.core.caching as caching
from numba import config

def ensure_cache_path(self):
    path = self.get_cache_path()
    if not (sys.argv[1] == "temp" and config.CACHE_DIR and path.startswith(config.CACHE_DIR)):
        raise OSError("not writable")
    os.makedirs(path, exist_ok=True)

caching._CacheLocator.ensure_cache_path = ensure_cache_path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
import numpy as np
import gpukv
from gpukv.device import host_jit

kv = gpukv.create("device")
kv.init("w", np.zeros(1000, np.float32))
kv.set_gradient_compression({"type": "sign"})
rng = np.random.default_rng(0)
kv.push("w", [rng.standard_normal(1000).astype(np.float32) for _ in range(2)])
out = np.empty(1000, np.float32)
kv.pull("w", out=out)
cached = sorted(os.listdir(config.CACHE_DIR)) if config.CACHE_DIR else []
print("enabled", host_jit.enabled(), "cached", bool(cached))
print("pulled", hashlib.sha256(out.tobytes()).hexdigest())
"""


def _without_a_cache(where: str):
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", host_jit.ENV)}
    done = subprocess.run([sys.executable, "-c", _NO_CACHE, where], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), done.stderr


def test_numba_without_a_folder_to_cache_in_compiles_into_one_of_the_process():
    """Where Numba can cache nowhere, it refuses to compile at import (a RuntimeError):
    the codecs are compiled into a temporary folder of the process's own, and say so;
    where even that fails, the NumPy twins run, with a warning. Both pull the same
    bits."""
    pytest.importorskip("numba")
    (state, pulled), log = _without_a_cache("temp")
    assert state == "enabled True cached True"
    assert "compiles the host's codecs in each process, into" in log
    (state, pulled_numpy), log = _without_a_cache("nowhere")
    assert state == "enabled False cached False"
    assert "WARNING gpukv: Numba cannot cache the host's compiled codecs" in log
    assert "NUMBA_CACHE_DIR" in log
    assert pulled == pulled_numpy
