"""The alpha-beta simulator: sane, monotonic predictions that rank strategies sensibly."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpukv.comm import Strategy
from gpukv.comm.plan import simulate as S
from gpukv.comm.plan import topology as T

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


# ------------------------------------------------------------ tree slicing decision
FINE_SIZES = [int(4 * KB * 2 ** (i / 2)) for i in range(37)]  # 4 KB .. 1 GB, x sqrt(2)


@pytest.fixture
def no_bound(monkeypatch):
    """No array bound in the environment: the cost model decides the tree's slicing."""
    for prefix in ("GPUKV_TREE_", "MXNET_KVSTORE_TREE_"):
        monkeypatch.delenv(prefix + "ARRAY_BOUND", raising=False)
    return monkeypatch


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_tree_slicing_decision_is_monotone(no_bound, machine, n):
    """Tiny keys stay whole on the home's tree, big ones are sliced, the slice count never
    drops as keys grow, and no slice is under MIN_SLICE_BYTES."""
    m = S.machine(machine, n)
    for home in range(n):
        counts = []
        for size in FINE_SIZES:
            plan = S.tree_slice_plan(size // 4, m, home)
            assert plan[0][1] == 0 and plan[-1][2] == size // 4
            assert all(a[2] == b[1] for a, b in zip(plan, plan[1:]))
            if len(plan) > 1:
                assert min(stop - start for _, start, stop in plan) * 4 >= S.MIN_SLICE_BYTES
            else:
                assert plan == [(home, 0, size // 4)]
            counts.append(len(plan))
        assert counts[0] == 1 and counts[-1] >= 2
        assert all(a <= b for a, b in zip(counts, counts[1:])), counts


def test_tree_slices_well_below_mxnet_bound_on_dgx1(no_bound):
    """On an 8-GPU DGX-1, 64 KB stays whole and 16 MB (4M elements, under MXNet's 10M
    bound) is sliced over the home's tree and its NVLink neighbours' trees."""
    assert S.tree_slice_plan(16 * KB, "dgx1-v100", 0) == [(0, 0, 16 * KB)]
    plan = S.tree_slice_plan(4 * MB, "dgx1-v100", 0)
    assert [r for r, _, _ in plan] == [0, 1, 2, 3, 4]


def test_explicit_array_bound_wins(no_bound):
    """array_bound= beats GPUKV_TREE_ARRAY_BOUND, which beats MXNET_KVSTORE_TREE_ARRAY_BOUND,
    which beats the cost model; a bound gives MXNet's whole-or-all-trees rule."""
    big, tiny = 256 * MB // 4, 1000
    assert len(S.tree_slice_plan(big, "dgx1-v100", 2)) > 1
    assert S.tree_slice_plan(big, "dgx1-v100", 2, array_bound=1 << 40) == [(2, 0, big)]
    assert len(S.tree_slice_plan(tiny, "dgx1-v100", 2, array_bound=1)) == 8
    no_bound.setenv("MXNET_KVSTORE_TREE_ARRAY_BOUND", str(1 << 40))
    assert S.tree_slice_plan(big, "dgx1-v100", 2) == [(2, 0, big)]
    no_bound.setenv("GPUKV_TREE_ARRAY_BOUND", "1")
    assert len(S.tree_slice_plan(tiny, "dgx1-v100", 2)) == 8
    assert S.tree_slice_plan(tiny, "dgx1-v100", 2, array_bound=tiny) == [(2, 0, tiny)]
    # the prediction follows the bound too: always-on slicing is slower for 64 KB keys
    assert S.predict("tree", 64 * KB, 8, "dgx1-v100") == \
        S.predict("tree", 64 * KB, 8, "dgx1-v100", array_bound=1)


def test_tree_prediction_has_no_jump_at_mxnets_bound(no_bound):
    """16 MB (under MXNet's bound) is no slower than 64 MB (over it) on an 8-GPU DGX-1."""
    t16 = S.predict("tree", 16 * MB, 8, "dgx1-v100")
    t64 = S.predict("tree", 64 * MB, 8, "dgx1-v100")
    assert t16 <= t64
    fixed16 = S.predict("tree", 16 * MB, 8, "dgx1-v100", array_bound=T.MXNET_ARRAY_BOUND)
    assert t16 < fixed16 / 2  # the fixed bound left 16 MB unsliced


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_tree_prediction_grows_and_amortises(no_bound, machine, n):
    """The tree's predicted time never drops as a key grows, and its time per byte never
    rises: slicing only ever removes time, it never causes a step."""
    times = [S.predict("tree", s, n, machine) for s in FINE_SIZES]
    assert all(a <= b for a, b in zip(times, times[1:]))
    per_byte = [t / s for t, s in zip(times, FINE_SIZES)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(per_byte, per_byte[1:]))


@pytest.mark.parametrize("machine", sorted(S.MACHINES))
def test_tree_decision_is_the_fastest_candidate(no_bound, machine):
    """The model's plan is never predicted slower than whole or sliced over every tree."""
    for size in (64 * KB, 4 * MB, 64 * MB):
        chosen = S.predict("tree", size, 8, machine, home=3)
        whole = S.predict("tree", size, 8, machine, home=3, array_bound=1 << 40)
        every = S.predict("tree", size, 8, machine, home=3, array_bound=1)
        assert chosen <= min(whole, every) * (1 + 1e-9)


def test_strategy_and_prediction_share_the_decision(no_bound, monkeypatch):
    """The tree strategy cuts keys exactly as the simulator's 'tree' prediction assumes."""
    from gpukv.comm import ReduceJob
    from gpukv.comm.tree import TreeStrategy
    from gpukv.device import host_device

    calls = []
    original = S.tree_slice_plan

    def spy(nelems, m, home, **kw):
        plan = original(nelems, m, home, **kw)
        calls.append((nelems, home, plan))
        return plan

    monkeypatch.setattr(S, "tree_slice_plan", spy)
    nelems = 4 * MB // 4
    S.predict("tree", 4 * MB, 8, T.dgx1_v100(), home=5)
    predicted = calls[-1]
    strategy = TreeStrategy(matrix=T.dgx1_v100())
    values = [np.full(nelems, i, np.float32) for i in range(8)]
    out = np.zeros(nelems, np.float32)
    strategy.reduce_many([ReduceJob("k", values, [host_device(i) for i in range(8)],
                                    host_device(5), out)])
    assert calls[-1] == predicted and len(predicted[2]) > 1
    np.testing.assert_array_equal(out, np.full(nelems, 28.0))


# ------------------------------------------------------------- 'auto' follows the model
#: Four devices joined only through slow staged copies (0.5 GB/s), next to a host path
#: (copies to host memory and the host sum) that is a thousand times faster.
FAST_HOST = S.Machine(
    name="fast host, slow links", matrix=np.zeros((4, 4)), links={},
    staged=S.LinkClass("staged", 0.5, 50.0, port="pcie"), ports={"pcie": 0.5},
    hbm_gbps=1000.0, host_gbps=1000.0, host_total_gbps=4000.0, host_sum_gbps=1000.0)
#: The same constants, but every host copy and host sum costs ten seconds to start.
SLOW_HOST_CALLS = dataclasses.replace(S.COSTS, host_copy_us=1e7, host_sum_us=1e7)


class _Recorder(Strategy):
    """A strategy that sums on the host and notes, under its name, every key it ran."""

    def __init__(self, name: str, ran: list):
        self.name, self.ran = name, ran

    def reduce(self, job):
        self.ran.append((self.name, job.key))
        job.out[...] = sum(job.sources)

    def broadcast(self, job):
        for out in job.outs:
            out[...] = job.src


@pytest.mark.parametrize("costs, best", [
    (S.COSTS, "cpu"),             # the host path is far faster: through the host
    (SLOW_HOST_CALLS, "ring"),    # host calls cost seconds: the bandwidth-optimal ring
])
def test_auto_hands_a_key_to_the_cheapest_strategy_of_its_cost_table(costs, best):
    """On a machine whose best strategy is known, 'auto' runs the key through it, and a
    cost table that makes the host path slow moves the key to the ring."""
    from gpukv.comm import ReduceJob
    from gpukv.comm.auto import AutoStrategy
    from gpukv.device import host_device

    ran: list = []
    names = ("home", "tree", "ring", "cpu", "nccl")
    auto = AutoStrategy(machine=FAST_HOST, costs=costs, model_host=True,
                        strategies={n: _Recorder(n, ran) for n in names})
    devices = [host_device(i) for i in range(4)]
    values = [np.full(MB // 4, i + 1, np.float32) for i in range(4)]  # 1 MiB each
    out = np.zeros(MB // 4, np.float32)
    auto.reduce_many([ReduceJob("k", values, devices, devices[0], out)])
    assert ran == [(best, "k")]
    np.testing.assert_array_equal(out, 10.0)
