"""PowerSGD ('powersgd') in a one-process store against a plain NumPy statement of its
rule (two sums, warm start, error feedback), its error-feedback invariant, keys it sends
as they are, its bytes, and its option checked."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv.encoding.compressors import make_compressor
from gpukv.encoding.compressors import powersgd as psgd

# every test twice: decoding compiled by Numba, then with NumPy
pytestmark = pytest.mark.usefixtures("host_codec_path")


def reference_push(ms: list, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """(the sum P Q'^T, Q', each source's new residual) of one push of the sources' M
    (gradient plus residual) with warm-start Q, as the rule says: P = orth(sum M_i Q)
    by Gram-Schmidt, Q' = sum M_i^T P, residual_i = M_i - P (M_i^T P)^T."""
    p = sum(m.astype(np.float64) @ q for m in ms)
    for i in range(p.shape[1]):
        for _ in range(2):
            for j in range(i):
                p[:, i] -= (p[:, j] @ p[:, i]) * p[:, j]
        norm = np.linalg.norm(p[:, i])
        if norm > 0:
            p[:, i] /= norm
    qs = [m.astype(np.float64).T @ p for m in ms]
    q_sum = sum(qs)
    return p @ q_sum.T, q_sum, [m - p @ q_i.T for m, q_i in zip(ms, qs)]


def _store(shape, rank=4, sources=None):
    kv = gpukv.create("device")
    kv.set_gradient_compression({"type": "powersgd", "rank": rank})
    kv.init("w", np.zeros(shape, np.float32))
    return kv


@settings(max_examples=20, deadline=None)
@given(st.integers(24, 80), st.integers(24, 80), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_a_push_is_the_rules_sum_push_after_push(rows, cols, rank, sources, pushes, seed):
    """Push after push (warm start and residuals carried), the pulled sum is the rule's
    to float32 rounding."""
    rng = np.random.default_rng(seed)
    kv = _store((rows, cols), rank)
    comp = make_compressor({"type": "powersgd", "rank": rank})
    q = comp.warm_q("w", cols).astype(np.float64)
    residuals = [np.zeros((rows, cols)) for _ in range(sources)]
    for _ in range(pushes):
        grads = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(sources)]
        kv.push("w", grads)
        want, q, residuals = reference_push([g + r for g, r in zip(grads, residuals)], q)
        got = np.empty((rows, cols), np.float32)
        kv.pull("w", out=got)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_deterministic_store_adds_the_sources_in_the_canonical_tree(deterministic):
    """With 5 sources a store adds each of P's and Q's five terms in call order,
    (((a + b) + c) + d) + e; a deterministic one as the canonical tree does,
    ((a + b) + (c + d)) + e, so that any split of the sources over processes gives its
    bits: both stores pull exactly the sums of `psgd.step` under that order."""
    def in_order(t):
        return (((t[0] + t[1]) + t[2]) + t[3]) + t[4]

    def tree(t):
        return ((t[0] + t[1]) + (t[2] + t[3])) + t[4]

    add = tree if deterministic else in_order
    shape, rng = (40, 50), np.random.default_rng(7)
    kv = gpukv.create("device", deterministic=deterministic)
    kv.set_gradient_compression({"type": "powersgd", "rank": 3})
    kv.init("w", np.zeros(shape, np.float32))
    comp = make_compressor({"type": "powersgd", "rank": 3})
    ms = [np.zeros(shape, np.float32) for _ in range(5)]
    for _ in range(3):
        grads = [(rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape))
                 .astype(np.float32) for _ in range(5)]
        kv.push("w", grads)
        for m, g in zip(ms, grads):
            m += g
        (want,) = psgd.step(comp, ["w"], [ms], lambda lists, _: [add(t) for t in lists])
        got = np.empty(shape, np.float32)
        kv.pull("w", out=got)
        assert got.tobytes() == want.tobytes()


def test_what_is_not_sent_comes_back_later():
    """Error feedback: after any number of pushes the pulled sums plus the residual left
    are the gradients pushed (to float32 rounding)."""
    rng = np.random.default_rng(0)
    kv = _store((96, 64), rank=2)
    kv.push("w", [np.zeros((96, 64), np.float32)])
    pushed = np.zeros((96, 64))
    pulled = np.zeros((96, 64))
    for _ in range(20):
        g = rng.standard_normal((96, 64)).astype(np.float32)
        kv.push("w", [g])
        out = np.empty((96, 64), np.float32)
        kv.pull("w", out=out)
        pushed += g
        pulled += out
    (residual,) = [r for (key, _), r in kv._compression.feedback.residuals.items()
                   if key == "w"]
    np.testing.assert_allclose(pulled + residual.reshape(96, 64), pushed, atol=1e-3)


def test_a_sum_of_rank_at_most_r_crosses_whole_at_once():
    """Sources whose sum has rank 3 under rank 4: the first push's sum is exact to
    float32 rounding (the twice-taken Gram-Schmidt keeps the spare column orthogonal)."""
    rng = np.random.default_rng(1)
    u, v = rng.standard_normal((128, 3)), rng.standard_normal((3, 40))
    grads = [(u * rng.standard_normal(3) @ v).astype(np.float32) for _ in range(3)]
    kv = _store((128, 40))
    kv.push("w", grads)
    out = np.empty((128, 40), np.float32)
    kv.pull("w", out=out)
    total = grads[0] + grads[1] + grads[2]
    assert np.abs(out - total).max() < 1e-5 * np.abs(total).max()


def test_a_zero_push_leaves_the_next_ones_as_if_it_had_not_been():
    """A push of zeros sums to zeros, and its Q' (all zeros) is not the next warm start:
    the next push gives the bits a store that never saw the zeros gives."""
    rng = np.random.default_rng(3)
    g = rng.standard_normal((96, 64)).astype(np.float32)
    after_zeros, fresh = _store((96, 64)), _store((96, 64))
    after_zeros.push("w", [np.zeros((96, 64), np.float32)])
    zeros = np.ones((96, 64), np.float32)
    after_zeros.pull("w", out=zeros)
    assert not zeros.any()
    after_zeros.push("w", [g])
    fresh.push("w", [g])
    got, want = np.empty_like(g), np.empty_like(g)
    after_zeros.pull("w", out=got)
    fresh.pull("w", out=want)
    assert got.tobytes() == want.tobytes() and np.abs(want).max() > 0


def test_a_sum_of_one_row_does_not_lower_the_rank_of_later_ones():
    """A gradient of one non-zero row leaves columns 2..R of P, and so of Q', zero;
    those are drawn afresh, so a later random gradient's sum has rank R again."""
    rng = np.random.default_rng(4)
    kv = _store((96, 64), rank=4)
    one_row = np.zeros((96, 64), np.float32)
    one_row[7] = rng.standard_normal(64)
    kv.push("w", [one_row])
    kv.push("w", [rng.standard_normal((96, 64)).astype(np.float32)])
    out = np.empty((96, 64), np.float32)
    kv.pull("w", out=out)
    assert np.linalg.matrix_rank(out) == 4


def test_a_warm_start_column_that_is_zero_or_not_finite_is_drawn_afresh():
    """keep_q keeps Q' but for its spent columns, which take the seed's (the first Q)."""
    comp = make_compressor({"type": "powersgd", "rank": 3})
    first = comp.warm_q("w", 10)
    q = np.arange(30, dtype=np.float32).reshape(10, 3) + 1
    q[:, 0], q[4, 2] = 0, np.inf
    comp.keep_q("w", q)
    kept = comp.warm_q("w", 10)
    np.testing.assert_array_equal(kept[:, 1], q[:, 1])
    np.testing.assert_array_equal(kept[:, [0, 2]], first[:, [0, 2]])


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_an_inf_or_nan_makes_its_matrix_nan_without_numpys_warnings(bad):
    """An inf or NaN in a pushed matrix: its sum is NaN throughout (the documented
    rule), and NumPy's RuntimeWarnings of the arithmetic on the way stay inside."""
    kv = _store((16, 16))
    g = np.ones((16, 16), np.float32)
    g[3, 5] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv.push("w", g)
    out = np.zeros((16, 16), np.float32)
    kv.pull("w", out=out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("shape", [(1000,), (8, 8), (4, 3, 2)])
def test_vectors_and_small_matrices_cross_as_they_are(shape):
    """A 1-D key, and a matrix PowerSGD would not cut 2x, is summed uncompressed."""
    rng = np.random.default_rng(2)
    kv = _store(shape)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    kv.push("w", grads)
    out = np.empty(shape, np.float32)
    kv.pull("w", out=out)
    assert out.tobytes() == ((grads[0] + grads[1]) + grads[2]).tobytes()


def test_its_bytes_are_p_and_q():
    """A matrix crosses as R * (rows + cols) float32 values; a vector whole."""
    comp = make_compressor({"type": "powersgd", "rank": 4})
    assert comp.nbytes((512, 256)) == 4 * 4 * (512 + 256)
    assert comp.nbytes((64, 3, 3, 16)) == 4 * 4 * (64 + 144)
    assert comp.nbytes((300,)) == 1200


def test_orthogonalize_and_decode_are_exact_in_their_order():
    """orthogonalize leaves orthonormal columns (a zero column zero); decode is P Q^T."""
    rng = np.random.default_rng(3)
    p = rng.standard_normal((200, 4)).astype(np.float32)
    p[:, 2] = 0
    psgd.orthogonalize(p)
    gram = p.T.astype(np.float64) @ p
    np.testing.assert_allclose(gram, np.diag([1, 1, 0, 1]), atol=1e-6)
    q = rng.standard_normal((30, 4)).astype(np.float32)
    out, scratch = np.empty((200, 30), np.float32), np.empty((200, 30), np.float32)
    psgd.decode(p, q, out, scratch)
    np.testing.assert_allclose(out, p.astype(np.float64) @ q.T, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.integers(1, 6), st.integers(0, 2**32 - 1),
       st.sampled_from([1e-30, 1.0, 1e30]))
def test_decode_adds_the_rank_one_terms_in_order(rows, cols, rank, seed, scale):
    """decode's bits are P[:, 0] Q[:, 0]^T + P[:, 1] Q[:, 1]^T + ... in float32, each
    product and sum rounded in turn (subnormals, overflow to inf included)."""
    rng = np.random.default_rng(seed)
    p = (rng.standard_normal((rows, rank)) * scale).astype(np.float32)
    q = (rng.standard_normal((cols, rank)) * scale).astype(np.float32)
    with np.errstate(all="ignore"):
        want = p[:, 0:1] * q[:, 0]
        for k in range(1, rank):
            want = want + p[:, k:k + 1] * q[:, k]
        out, scratch = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
        psgd.decode(p, q, out, scratch)
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("rank,error", [(0, gpukv.ArgumentError), (2000, gpukv.ArgumentError),
                                        ("-1", gpukv.ArgumentError), (1.5, TypeError),
                                        (True, TypeError), ("x", TypeError),
                                        ("+-2", TypeError)])
def test_a_bad_rank_is_refused_and_changes_nothing(rank, error):
    """rank must be an int from 1 to 1024 (a string of one too, as MXNet passes
    options); anything else is a typed error naming it, and the store keeps its
    compression."""
    kv = _store((64, 64))
    with pytest.raises(error, match="rank"):
        kv.set_gradient_compression({"type": "powersgd", "rank": rank})
    assert kv.gradient_compression == {"type": "powersgd", "rank": 4}
    kv.set_gradient_compression({"type": "powersgd", "rank": "2"})
    assert kv.gradient_compression == {"type": "powersgd", "rank": 2}
