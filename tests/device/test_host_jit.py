"""Which host codecs run: Numba's compiled ones when it imports and GPUKV_HOST_JIT is not
'0', else the NumPy twins (both are held to the codecs' rules in tests/encoding)."""
from __future__ import annotations

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
