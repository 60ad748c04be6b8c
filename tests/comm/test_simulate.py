"""The alpha-beta simulator: sane, monotonic predictions that rank strategies sensibly."""
from __future__ import annotations

import numpy as np
import pytest

from gpukv.comm import simulate as S
from gpukv.comm import topology as T

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB, 256 * MB, 1 * GB]


@pytest.mark.parametrize("size", [1 * MB, 4 * MB, 16 * MB, 64 * MB])
def test_tree_beats_home_on_dgx1_for_mid_sizes(size):
    """On a simulated 8-GPU DGX-1 the tree beats home-device reduction (MXNet: 1.2-6.6x)."""
    home = S.predict("home", size, 8, "dgx1-v100")
    tree = S.predict("tree", size, 8, "dgx1-v100")
    assert 1.2 <= home / tree <= 15


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
@pytest.mark.parametrize("strategy", ["home", "ring", "cpu", "nccl"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_predictions_grow_with_size(machine, strategy, n):
    """A bigger key never takes less predicted time."""
    times = [S.predict(strategy, s, n, machine) for s in SIZES]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert all(t > 0 for t in times)


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
@pytest.mark.parametrize("bound", [1, 1 << 40])
def test_tree_grows_with_size_at_fixed_slicing(machine, bound):
    """With slicing always on (or always off) the tree's time grows with the key size."""
    times = [S.predict("tree", s, 8, machine, array_bound=bound) for s in SIZES]
    assert all(a <= b for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_approaches_bandwidth_bound(machine, n):
    """For 1 GB the ring takes 2(n-1)/n * size / slowest ring link plus its sums, within 2%."""
    m = S.machine(machine, n)
    ring = T.plan_ring(m.matrix)
    slowest = min(m.link(a, b).gbps for a, b in zip(ring, ring[1:] + ring[:1])) * 1e9
    wire = 2 * (n - 1) / n * GB / slowest
    sums = (n - 1) * 3 * (GB / n) / (m.hbm_gbps * 1e9)  # read 2 chunks, write 1, per step
    assert wire + sums <= S.predict("ring", GB, n, m) <= 1.02 * (wire + sums)


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
def test_small_keys_are_latency_bound(machine):
    """A 4 KB key costs microseconds, and NCCL's single call is the cheapest."""
    times = S.predict_all(4 * KB, 8, machine)
    assert all(1e-6 < t < 2e-3 for t in times.values())
    assert S.best_strategy(4 * KB, 8, machine) == "nccl"
    assert S.best_strategy(4 * KB, 8, machine, ["home", "tree", "ring", "cpu"]) == "home"


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
def test_cpu_staging_is_slowest_for_big_keys(machine):
    """Through the host is the slowest way to reduce a 256 MB key on any GPU machine."""
    times = S.predict_all(256 * MB, 8, machine)
    assert max(times, key=times.get) == "cpu"


def test_fully_connected_quad_prefers_home_over_tree():
    """On DGX-1's NVLink quad (GPUs 0-3) one step over dedicated links beats a 2-level tree."""
    assert S.predict("home", 1 * MB, 4, "dgx1-v100") < S.predict("tree", 1 * MB, 4, "dgx1-v100")


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_bare_matrices_and_machines_agree(n):
    """A bare matrix is simulated with the generic profile, and subsets use the first n devices."""
    t = S.predict("tree", 16 * MB, n, T.dgx1_v100())
    assert t == S.predict("tree", 16 * MB, n, S.generic_machine(T.dgx1_v100()[:n, :n]))
    assert t > 0


def test_disconnected_matrix_is_simulated_through_the_host():
    """Without P2P links every strategy still gets a finite prediction."""
    times = S.predict_all(16 * MB, 4, np.zeros((4, 4)))
    assert all(np.isfinite(t) and t > 0 for t in times.values())


@pytest.mark.parametrize("args,match", [
    (("bogus", 1, 2, "dgx1-v100"), "strategy"),
    (("home", -1, 2, "dgx1-v100"), "nbytes"),
    (("home", 1, 9, "dgx1-v100"), "devices"),
    (("home", 1, 2, "no-such-box"), "machine"),
])
def test_bad_arguments_are_rejected(args, match):
    """Unknown strategies or machines, negative sizes and too many devices raise ValueError."""
    with pytest.raises(ValueError, match=match):
        S.predict(*args)


def test_best_strategy_is_the_minimum():
    """best_strategy returns the strategy with the smallest prediction."""
    for size in SIZES:
        times = S.predict_all(size, 8, "nvswitch-h100")
        assert S.best_strategy(size, 8, "nvswitch-h100") == min(times, key=times.get)
