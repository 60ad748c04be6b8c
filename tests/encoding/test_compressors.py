"""The compressor registry and error feedback: a compressor is one registered class,
found by its type name with its options checked; `ErrorFeedback` keeps one residual per
slot whoever compresses."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv.encoding import compressors
from gpukv.encoding.compressors import registry


def test_mxnet_types_sign_ternary_and_powersgd_are_registered():
    """MXNet's 2bit, 1bit, fp16 and bf16 and gpukv's sign, ternary and powersgd are
    registered; 'none' turns compression off."""
    assert compressors.type_names() == ["1bit", "2bit", "bf16", "fp16", "none", "powersgd",
                                        "sign", "ternary"]
    assert compressors.registered() == [compressors.Cast, compressors.OneBit,
                                        compressors.PowerSGD, compressors.Sign,
                                        compressors.Ternary, compressors.TwoBit]
    assert compressors.make_compressor({"type": "none"}) is None


@pytest.fixture
def scaled(monkeypatch):
    """A compressor of a test's own, registered as 'scaled' for the test only."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @compressors.register("scaled")
    class Scaled(compressors.Compressor):
        """Sends x * factor as float32; decodes by dividing."""
        name = "scaled"
        options = {"factor": 2.0}
        positive = ("factor",)
        kernels = (compressors.KernelTraffic("scale", "gpukv_scale", 4, 4, "x in, out"),)

        def __init__(self, factor=2.0):
            self.factor = factor

        def compress(self, x, residual=None):
            return np.asarray(x, np.float32) * np.float32(self.factor), \
                compressors.Ctx(x.size, x.shape)

        def decompress(self, payload, ctx, out=None, accumulate=False):
            value = payload / np.float32(self.factor)
            if out is None:
                return value
            out[...] = out + value if accumulate else value
            return out

        def params(self):
            return {"type": self.name, "factor": self.factor}
    return Scaled


def test_a_registered_class_is_a_compressor_of_every_store(scaled):
    """One registered class is enough for make_compressor, a store's
    set_gradient_compression and the kernel-resource table."""
    from gpukv.tools import kernel_resources
    comp = compressors.make_compressor({"type": "Scaled", "factor": "4"})
    assert isinstance(comp, scaled) and comp.factor == 4.0
    kv = gpukv.create("device")
    kv.init(0, np.zeros(3, np.float32))
    kv.set_gradient_compression({"type": "scaled", "factor": 8})
    kv.push(0, [np.full(3, 1.5, np.float32), np.full(3, 0.5, np.float32)])
    out = np.empty(3, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert "gpukv_scale" in {c.kernel for c in kernel_resources._compression_cases()}


@pytest.mark.parametrize("params, message", [
    ({"type": "scaled", "threshold": 1}, "unknown option 'threshold'; valid options are "
                                         "type, factor"),
    ({"type": "scaled", "factor": 0}, "option 'factor' must be greater than 0, got 0"),
    ({"type": "scaled", "factor": "x"}, "option 'factor' must be a float32 number"),
    ({"type": "scaledx"}, "valid types are 1bit, 2bit, bf16, fp16, none, powersgd, "
                          "scaled, sign"),
])
def test_a_registered_class_has_its_options_checked(scaled, params, message):
    """Its options are checked from what it declares, with the others' messages."""
    with pytest.raises(gpukv.ArgumentError, match=message):
        compressors.make_compressor(params)


def test_a_type_registered_twice_is_refused(scaled):
    """Two classes cannot answer to one type name, nor any to 'none'."""
    for name in ("scaled", "none"):
        with pytest.raises(ValueError, match="registered twice"):
            compressors.register(name)(scaled)


def test_error_feedback_keeps_one_residual_per_slot():
    """Each slot's residual starts at zero and moves on with its own pushes; a new size
    starts afresh; a compressor without error feedback gets none."""
    feedback = compressors.ErrorFeedback(compressors.TwoBit(0.5))
    g = np.array([0.3, -0.2, 0.6], np.float32)
    feedback.compress(("k", 0), g)
    feedback.compress(("k", 0), g)
    feedback.compress(("k", 1), g)
    assert feedback.residuals[("k", 0)].tolist() == pytest.approx([0.1, -0.4, 0.2])
    assert feedback.residuals[("k", 1)].tolist() == pytest.approx([0.3, -0.2, 0.1])
    assert feedback.residual(("k", 0), 5).tolist() == [0.0] * 5
    assert compressors.ErrorFeedback(compressors.Cast("fp16")).residual("s", 3) is None


@pytest.mark.parametrize("params, scale, warns", [
    ({"type": "2bit", "threshold": 0.5}, 2.0, True),    # gradients past t: r grows
    ({"type": "2bit", "threshold": 0.5}, 0.05, False),
    ({"type": "1bit", "threshold": 0.5}, 4.0, True),    # a step of 1 cannot keep up
    ({"type": "1bit", "threshold": 0.5}, 0.3, False),
    ({"type": "sign"}, 1000.0, False),                  # nothing to outgrow
    ({"type": "ternary"}, 1000.0, False),
])
def test_a_residual_past_its_bound_warns_once_naming_the_key(params, scale, warns, caplog):
    """2bit/1bit: a key whose residual passes 8x its threshold (8 for 1bit) logs one
    warning naming it, however many pushes follow; gradients the rule keeps up with,
    and sign's and ternary's, none."""
    feedback = compressors.ErrorFeedback(compressors.make_compressor(params))
    rng = np.random.default_rng(1)
    with caplog.at_level("WARNING", logger="gpukv"):
        for _ in range(100):
            for key in ("w", "b"):
                g = (np.abs(rng.standard_normal(64)) * scale).astype(np.float32)
                feedback.compress((key, 0), g)
    named = [r.getMessage() for r in caplog.records if "residual of key" in r.getMessage()]
    assert len(named) == (2 if warns else 0), named
    if warns:
        assert {"'w'", "'b'"} == {m.split("residual of key ")[1].split(" ")[0] for m in named}


@pytest.mark.parametrize("params", [{"type": "2bit", "threshold": 0.5},
                                    {"type": "1bit", "threshold": 0.5}])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_in_a_residual_warns_naming_the_key(params, bad, caplog):
    """A gradient with a NaN (or an inf) leaves it in the residual for good: one warning
    names the key, as for a residual past the bound (a NaN is past any bound; before,
    its max() hid the key from the check)."""
    feedback = compressors.ErrorFeedback(compressors.make_compressor(params))
    g = np.zeros(64, np.float32)
    g[3] = bad
    with caplog.at_level("WARNING", logger="gpukv"):
        feedback.compress(("w", 0), g)
        for _ in range(20):
            feedback.compress(("w", 0), np.full(64, 0.01, np.float32))
    named = [r.getMessage() for r in caplog.records if "residual of key 'w'" in r.getMessage()]
    assert len(named) == 1, named


#: the compressors that scale each block of values by the block's own size
BLOCKWISE = ["sign", "ternary"]


@pytest.mark.parametrize("kind", BLOCKWISE)
def test_accumulate_adds_the_decoded_values(kind):
    comp = compressors.make_compressor({"type": kind})
    g = np.linspace(-3, 2, 600, dtype=np.float32)
    payload, ctx = comp.compress(g, np.zeros(600, np.float32))
    decoded = comp.decompress(payload, ctx)
    assert (decoded > 0).any() and (decoded < 0).any()
    out = np.full(600, 0.5, np.float32)
    comp.decompress(payload, ctx, out, accumulate=True)
    assert out.tobytes() == (decoded + np.float32(0.5)).tobytes()


@pytest.mark.parametrize("kind", BLOCKWISE)
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
@pytest.mark.parametrize("density", [1.0, 0.1, 1 / 128])
def test_a_blockwise_residual_stays_bounded_whatever_the_scale(kind, scale, density):
    """300 pushes of gradients of any scale, dense or sparse (mostly exact zeros, which
    sign decodes to +scale): the residual stays within a few times the largest gradient
    (2bit at its default threshold grows without bound once gradients pass it)."""
    rng = np.random.default_rng(0)
    comp = compressors.make_compressor({"type": kind})
    residual = np.zeros(4096, np.float32)
    largest = 0.0
    for _ in range(300):
        g = (rng.standard_normal(4096) * scale * (rng.random(4096) < density)
             ).astype(np.float32)
        largest = max(largest, float(np.abs(g).max()))
        comp.compress(g, residual)
    assert np.abs(residual).max() < 4 * largest


@pytest.mark.parametrize("kind", BLOCKWISE)
def test_a_blockwise_compressor_takes_no_option_and_says_so(kind):
    with pytest.raises(gpukv.ArgumentError, match="unknown option 'threshold'; valid "
                                                  "options are type$"):
        compressors.make_compressor({"type": kind, "threshold": 0.5})
    assert compressors.make_compressor({"type": kind.upper()}).params() == {"type": kind}
