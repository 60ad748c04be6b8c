"""Topology planning: link matrices, per-root reduction trees and rings, without a GPU."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpukv
from gpukv.comm.plan import topology as T
from gpukv.device.cuda import driver as D
from gpukv.device.cuda import probe

MACHINES = {
    "dgx1": T.dgx1_v100(),
    "nvswitch8": T.nvswitch_h100(8),
    "nvswitch16": T.nvswitch_h100(16),
    "pcie8": T.pcie_two_socket(8),
    "pcie12": T.pcie_two_socket(12),
}


@st.composite
def link_matrices(draw, min_n=2, max_n=16):
    """Symmetric non-negative integer matrices, dense, sparse or disconnected."""
    n = draw(st.integers(min_n, max_n))
    density = draw(st.sampled_from([0.0, 0.15, 0.4, 0.8, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    return T.random_link_matrix(n, seed, density=density, max_weight=draw(st.integers(1, 4)))


def _check_trees(matrix):
    n = len(matrix)
    trees = T.plan_trees(matrix)
    assert [t.root for t in trees] == list(range(n))
    for tree in trees:
        T.validate_tree(tree, n, max_depth=T.tree_depth(n))
        assert tree.depth == T.tree_depth(n)
        w = T.as_link_matrix(matrix)
        assert tree.staged == {(c, p) for c, p in tree.edges() if w[c, p] == 0}
    return trees


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_known_machines_get_one_valid_tree_per_root(name):
    """Every known machine gets one valid tree of depth ceil(log2 n) for every root."""
    _check_trees(MACHINES[name])


def test_dgx1_matrix_is_mxnets_hybrid_cube_mesh():
    """The DGX-1 matrix has six NVLinks per GPU: two single and two double neighbours."""
    w = T.dgx1_v100()
    assert np.array_equal(w, w.T)
    nvlinks = np.where(w >= 2, w - 1, 0)
    assert list(nvlinks.sum(axis=1)) == [6] * 8
    assert all(sorted(row[row >= 2]) == [2, 2, 3, 3] for row in w)


@pytest.mark.parametrize("backtrack", [False, True])
def test_dgx1_trees_use_only_nvlink(backtrack):
    """On DGX-1 every tree uses NVLink only, never the PCIe fallback (MXNet's result)."""
    trees = T.plan_trees(T.dgx1_v100(), backtrack=backtrack)
    w = T.dgx1_v100()
    assert all(w[c, p] >= 2 for t in trees for c, p in t.edges())


@pytest.mark.parametrize("name,bound", [("dgx1", 3.0), ("nvswitch8", 3.0),
                                        ("nvswitch16", 3.0), ("pcie8", 3.0)])
def test_trees_spread_over_links(name, bound):
    """On symmetric topologies the per-root trees load their links within a bounded ratio."""
    summary = T.usage_summary(T.plan_trees(MACHINES[name]), MACHINES[name])
    assert summary["ratio"] <= bound


def test_nvswitch_trees_use_every_link():
    """On an all-to-all machine the link usage penalty spreads the trees over every pair."""
    summary = T.usage_summary(T.plan_trees(MACHINES["nvswitch8"]), MACHINES["nvswitch8"])
    assert summary["used"] == summary["links"] == 28


@pytest.mark.parametrize("n", [8, 12])
def test_pcie_trees_cross_sockets_once(n):
    """On a two-socket PCIe box each tree crosses the sockets (a staged edge) exactly once."""
    trees = T.plan_trees(T.pcie_two_socket(n))
    assert [len(t.staged) for t in trees] == [1] * n


@pytest.mark.parametrize("n", range(2, 17))
def test_disconnected_matrix_still_gets_trees(n):
    """A matrix without any link still yields valid trees made of staged edges."""
    trees = _check_trees(np.zeros((n, n)))
    assert all(len(t.staged) == n - 1 for t in trees)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(link_matrices())
def test_random_matrices_always_get_valid_trees(matrix):
    """Any symmetric matrix on 2..16 devices, however sparse, gets a valid tree per root."""
    _check_trees(matrix)


@pytest.mark.parametrize("n", [20, 24])
def test_large_sets_use_kernighan_lin_and_stay_valid(n):
    """Above the exhaustive limit the Kernighan-Lin path still gives valid balanced trees."""
    _check_trees(T.random_link_matrix(n, seed=n, density=0.3))


def test_single_device_tree_is_empty():
    """One device needs no reduction step."""
    (tree,) = T.plan_trees(np.zeros((1, 1)))
    assert tree.parent == [-1] and tree.levels == []
    T.validate_tree(tree)


def test_tree_levels_are_parallel_steps():
    """In every step a device is in one edge at most, and the broadcast mirrors the reduction."""
    for tree in T.plan_trees(T.dgx1_v100()):
        for level in tree.levels:
            devices = [d for edge in level for d in edge]
            assert len(devices) == len(set(devices))
        assert tree.broadcast_levels()[0] == [(p, c) for c, p in tree.levels[-1]]


@pytest.mark.parametrize("tree,reason", [
    (T.Tree(0, [-1, 0, 0], [[(1, 0)], [(2, 0)]]), None),
    (T.Tree(0, [-1, 0, 1], [[(2, 1), (1, 0)]]), "two edges"),
    (T.Tree(0, [-1, 0, 0], [[(1, 0)]]), "never send"),
    (T.Tree(0, [-1, 2, 1], [[(1, 2)], [(2, 1)]]), "cycle"),
    (T.Tree(0, [-1, 0, 1], [[(1, 0)], [(2, 1)]]), "before its child"),
    (T.Tree(1, [-1, 0], [[(1, 0)]]), "root"),
])
def test_validate_tree_rejects_broken_trees(tree, reason):
    """validate_tree accepts a valid tree and names what is wrong with a broken one."""
    if reason is None:
        T.validate_tree(tree)
        assert T.is_valid_tree(tree)
    else:
        with pytest.raises(ValueError, match=reason):
            T.validate_tree(tree)
        assert not T.is_valid_tree(tree)


def test_validate_tree_enforces_depth():
    """A chain is valid, but not within the balanced depth bound."""
    chain = T.Tree(0, [-1, 0, 1, 2], [[(3, 2)], [(2, 1)], [(1, 0)]])
    T.validate_tree(chain)
    with pytest.raises(ValueError, match="depth"):
        T.validate_tree(chain, max_depth=2)


def _ring_ok(matrix, ring):
    n = len(matrix)
    assert sorted(ring) == list(range(n)) and ring[0] == 0


def _best_bottleneck(matrix):
    n = len(matrix)
    eff = T.effective_weights(matrix)
    return max(min(eff[a, b] for a, b in zip((0,) + p, p + (0,)))
               for p in itertools.permutations(range(1, n)))


@pytest.mark.parametrize("name,expected", [("dgx1", 3.0), ("nvswitch8", 19.0),
                                           ("nvswitch16", 19.0), ("pcie8", 0.0)])
def test_ring_on_known_machines(name, expected):
    """The ring on DGX-1 uses only double NVLinks; NVSwitch any; PCIe must cross sockets."""
    ring = T.plan_ring(MACHINES[name])
    _ring_ok(MACHINES[name], ring)
    assert T.ring_bottleneck(MACHINES[name], ring) == expected


@settings(max_examples=30, deadline=None)
@given(link_matrices(min_n=1, max_n=16))
def test_random_rings_are_cycles(matrix):
    """plan_ring returns every device once, starting at 0, for any matrix."""
    _ring_ok(matrix, T.plan_ring(matrix))


@settings(max_examples=25, deadline=None)
@given(link_matrices(min_n=3, max_n=7))
def test_small_rings_are_optimal(matrix):
    """Up to 8 devices the ring's slowest link is the best any ring can have."""
    ring = T.plan_ring(matrix)
    eff = T.effective_weights(matrix)
    got = min(eff[a, b] for a, b in zip(ring, ring[1:] + ring[:1]))
    assert got == pytest.approx(_best_bottleneck(matrix))


@pytest.mark.parametrize("nelems,bound,expected", [
    (100, 1000, [(3, 0, 100)]),
    (10, 4, [(0, 0, 3), (1, 3, 6), (2, 6, 8), (3, 8, 10)]),
    (3, 1, [(0, 0, 1), (1, 1, 2), (2, 2, 3)]),
])
def test_slice_plan(nelems, bound, expected):
    """Small keys ride the home tree whole; big ones are cut over all trees contiguously."""
    assert T.slice_plan(nelems, 4, 3, array_bound=bound) == expected


@pytest.mark.parametrize("nelems,roots,expected", [
    (10, [3], [(3, 0, 10)]),
    (10, [3, 1], [(1, 0, 5), (3, 5, 10)]),
    (7, [0, 2, 3], [(0, 0, 3), (2, 3, 5), (3, 5, 7)]),
    (2, [0, 1, 2, 3], [(0, 0, 1), (1, 1, 2)]),
    (0, [0, 1], [(3, 0, 0)]),
])
def test_slice_plan_over_given_roots(nelems, roots, expected):
    """With roots, a key is cut contiguously over exactly those trees, in root order."""
    assert T.slice_plan(nelems, 4, 3, roots=roots) == expected


def test_slice_plan_without_bound_uses_mxnet_default(monkeypatch):
    """With no bound given or set, slice_plan applies MXNet's 10M-element bound."""
    for prefix in ("GPUKV_TREE_", "MXNET_KVSTORE_TREE_"):
        monkeypatch.delenv(prefix + "ARRAY_BOUND", raising=False)
    assert T.slice_plan(T.MXNET_ARRAY_BOUND, 8, 2) == [(2, 0, T.MXNET_ARRAY_BOUND)]
    assert len(T.slice_plan(T.MXNET_ARRAY_BOUND + 1, 8, 2)) == 8


def test_slice_roots_prefer_the_homes_fastest_links():
    """The home's tree first, then trees rooted at the home's best-linked devices."""
    w = T.dgx1_v100()
    assert T.slice_roots(w, 0, 1) == [0]
    assert T.slice_roots(w, 0, 3) == [0, 3, 4]        # the two double NVLinks of GPU 0
    assert T.slice_roots(w, 0, 5) == [0, 1, 2, 3, 4]  # then the single NVLinks
    assert T.slice_roots(w, 5, 8) == list(range(8))
    with pytest.raises(ValueError):
        T.slice_roots(w, 0, 9)


@pytest.mark.parametrize("env,expected", [
    ({}, {"penalty": 0.7, "backtrack": False, "array_bound": None}),
    ({"MXNET_KVSTORE_TREE_LINK_USAGE_PENALTY": "0.5", "GPUKV_TREE_BACKTRACK": "1"},
     {"penalty": 0.5, "backtrack": True, "array_bound": None}),
    ({"GPUKV_TREE_ARRAY_BOUND": "5", "MXNET_KVSTORE_TREE_ARRAY_BOUND": "7"},
     {"penalty": 0.7, "backtrack": False, "array_bound": 5}),
    ({"MXNET_KVSTORE_TREE_ARRAY_BOUND": "7"},
     {"penalty": 0.7, "backtrack": False, "array_bound": 7}),
])
def test_tree_options_from_environment(monkeypatch, env, expected):
    """GPUKV_TREE_* settings win over MXNET_KVSTORE_TREE_* ones, which win over defaults
    (no array bound by default: the cost model decides slicing)."""
    for name in ("LINK_USAGE_PENALTY", "BACKTRACK", "ARRAY_BOUND"):
        monkeypatch.delenv("GPUKV_TREE_" + name, raising=False)
        monkeypatch.delenv("MXNET_KVSTORE_TREE_" + name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert T.tree_options() == expected


@pytest.mark.parametrize("name,value,expected", [
    ("GPUKV_TREE_ARRAY_BOUND", "-1", "a positive integer"),
    ("MXNET_KVSTORE_TREE_ARRAY_BOUND", "1.5", "a positive integer"),
    ("GPUKV_TREE_LINK_USAGE_PENALTY", "5", "a number with 0 < penalty <= 1"),
    ("GPUKV_TREE_BACKTRACK", "yes", "an integer")])
def test_a_bad_tree_variable_is_named_with_its_value(monkeypatch, name, value, expected):
    """Each malformed setting is an ArgumentError naming the variable it came from, its
    value and what it takes; a setting not asked for is not read, so an option given in
    its place (array_bound=) wins even over a malformed variable."""
    for other in ("LINK_USAGE_PENALTY", "BACKTRACK", "ARRAY_BOUND"):
        monkeypatch.delenv("GPUKV_TREE_" + other, raising=False)
        monkeypatch.delenv("MXNET_KVSTORE_TREE_" + other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(gpukv.ArgumentError, match=f"{name}={value!r}: expected {expected}"):
        T.tree_options()
    asked = {"ARRAY_BOUND": "array_bound", "PENALTY": "penalty", "BACKTRACK": "backtrack"}
    other = [v for k, v in asked.items() if not name.endswith(k)]
    assert set(T.tree_options(*other)) == set(other)


@pytest.mark.parametrize("value", ["0", "1.5", "x"])
def test_bad_penalty_is_rejected(monkeypatch, value):
    """An out-of-range or non-numeric link usage penalty raises ValueError naming it."""
    monkeypatch.setenv("GPUKV_TREE_LINK_USAGE_PENALTY", value)
    with pytest.raises(ValueError, match="penalty|LINK_USAGE_PENALTY"):
        T.tree_options()


@pytest.mark.parametrize("bad", [np.zeros((2, 3)), -np.ones((2, 2)), [[0, np.nan], [1, 0]]])
def test_bad_matrices_are_rejected(bad):
    """Non-square, negative or non-finite link matrices raise ValueError."""
    with pytest.raises(ValueError, match="link matrix"):
        T.as_link_matrix(bad)


class FakeRuntime:
    """A stand-in for cupy.cuda.runtime on a made-up 3-GPU machine."""

    cudaDevP2PAttrPerformanceRank = 1
    cudaDevP2PAttrAccessSupported = 2
    # GPU 0-1: best link (rank 0); 0-2 and 1-2: slower (rank 1); 2 cannot reach 3
    ranks = {frozenset({0, 1}): 0, frozenset({0, 2}): 1, frozenset({1, 2}): 1}

    def deviceCanAccessPeer(self, a, b):
        return int(frozenset({a, b}) in self.ranks)

    def deviceGetP2PAttribute(self, attr, a, b):
        if attr == self.cudaDevP2PAttrAccessSupported:
            return 1
        return self.ranks[frozenset({a, b})]


def test_link_matrix_from_ranks_turns_ranks_into_weights():
    """Lower CUDA performance rank -> higher weight; no peer access -> 0; same GPU -> fastest."""
    ranks = {(0, 1): 0, (1, 0): 0, (0, 2): 1, (2, 0): 1, (1, 2): 1, (2, 1): 1}
    w = T.link_matrix_from_ranks([0, 1, 2, 3, 0], ranks)
    assert w[0, 1] == 2 and w[0, 2] == 1 and w[1, 2] == 1
    assert w[2, 3] == 0 and w[0, 3] == 0
    assert w[0, 4] == T.SAME_DEVICE_WEIGHT and w[1, 4] == 2
    assert np.array_equal(w, w.T) and not w.diagonal().any()
    _check_trees(w)


def test_link_matrix_from_ranks_takes_device_objects():
    """Devices are named by their `.physical` (or `.id`) GPU; a one-way rank counts as
    the pair's link only in that direction, so the matrix keeps the slower one (none)."""
    import types
    devs = [types.SimpleNamespace(physical=0), types.SimpleNamespace(id=1)]
    assert T.link_matrix_from_ranks(devs, {(0, 1): 0, (1, 0): 0})[0, 1] == 1
    assert T.link_matrix_from_ranks([0, 1], {(0, 1): 0})[0, 1] == 0


def test_probe_ranks_come_from_the_runtime_without_a_driver():
    """Given only a runtime, the probe reports every pair with peer access and its rank."""
    ranks = probe.p2p_ranks([0, 1, 2, 3, 0], runtime=FakeRuntime())
    assert ranks == {(0, 1): 0, (1, 0): 0, (0, 2): 1, (2, 0): 1, (1, 2): 1, (2, 1): 1}
    assert probe.p2p_ranks([2, 2], runtime=FakeRuntime()) == {}


def test_topology_does_not_import_cupy():
    """Importing and using the planner never imports CuPy, nor asks the device layer."""
    import subprocess
    import sys
    code = ("import sys; from gpukv.comm.plan import topology as T; "
            "T.plan_trees(T.dgx1_v100()); T.plan_ring(T.dgx1_v100()); "
            "T.link_matrix_from_ranks([0, 1, 1], {(0, 1): 0, (1, 0): 0}); "
            "assert 'cupy' not in sys.modules; "
            "assert 'gpukv.device.cuda.probe' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


class FakeDriver:
    """A stand-in for libcuda (ctypes): GPUs 0-1 on NVLink (rank 0), 0-2 and 1-2 on PCIe
    (rank 1), 3 reachable from nobody. The CUdevice handles differ from the ordinals, as
    they may under CUDA_VISIBLE_DEVICES, so the attributes are keyed by handle."""

    HANDLE = {0: 10, 1: 11, 2: 12, 3: 13}
    ranks = {frozenset({10, 11}): 0, frozenset({10, 12}): 1, frozenset({11, 12}): 1}

    def __init__(self, init_status=0):
        self.init_status = init_status
        self.calls = []

    def cuInit(self, flags):  # noqa: N802 - the driver API's name
        self.calls.append(("cuInit", flags))
        return self.init_status

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        assert self.calls and self.calls[0][0] == "cuInit", "cuDeviceGet before cuInit"
        self.calls.append(("cuDeviceGet", ordinal))
        if ordinal not in self.HANDLE:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev.contents.value = self.HANDLE[ordinal]
        return 0

    def cuDeviceGetP2PAttribute(self, value, attrib, src, dst):  # noqa: N802
        assert src in self.HANDLE.values() and dst in self.HANDLE.values(), "not a handle"
        self.calls.append(("p2p", attrib, src, dst))
        pair = frozenset({src, dst})
        if attrib == D.CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED:
            value.contents.value = int(pair in self.ranks)
        elif attrib == D.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK:
            value.contents.value = self.ranks.get(pair, 0)
        else:
            return 1  # CUDA_ERROR_INVALID_VALUE
        return 0


class AccessOnlyRuntime:
    """cupy.cuda.runtime as in CuPy 14: can-access-peer, but no deviceGetP2PAttribute."""

    def deviceCanAccessPeer(self, a, b):
        return int({a, b} != {2, 3} and 3 not in {a, b})


def test_cuda_driver_enum_values_are_cuda_h():
    """The P2P and pointer attribute numbers are those of cuda.h."""
    assert (D.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, D.CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
            D.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
            D.CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED) == (1, 2, 3, 4)
    assert (D.CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, D.CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE) == (16, 0)


def test_probe_asks_the_driver_for_ranks(monkeypatch):
    """With libcuda loadable, NVLink and PCIe pairs get different weights (driver ranks),
    asked with the CUdevice handles of the ordinals after cuInit."""
    driver = FakeDriver()
    monkeypatch.setattr(probe, "cuda_driver", lambda: driver)
    ids = [0, 1, 2, 3, 0]
    w = T.link_matrix_from_ranks(ids, probe.p2p_ranks(ids))
    assert w[0, 1] == 2 and w[0, 2] == 1 and w[1, 2] == 1
    assert w[2, 3] == 0 and w[0, 3] == 0
    assert w[0, 4] == T.SAME_DEVICE_WEIGHT and w[1, 4] == 2
    assert driver.calls[0] == ("cuInit", 0)
    assert ("p2p", D.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, 10, 11) in driver.calls
    assert not any(c[0] == "p2p" and c[1] == D.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK
                   and 13 in c[2:] for c in driver.calls)  # no rank asked without access
    _check_trees(w)


def test_probe_falls_back_to_the_runtime(monkeypatch):
    """Without a usable driver (not loadable, or cuInit failing) peer access from the
    runtime is used, every accessible pair at weight 1."""
    import types

    from gpukv.device.cuda import device as cuda
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=AccessOnlyRuntime()))
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake)
    for driver in (None, FakeDriver(init_status=100)):
        monkeypatch.setattr(probe, "cuda_driver", lambda d=driver: d)
        ids = [0, 1, 2, 3]
        w = T.link_matrix_from_ranks(ids, probe.p2p_ranks(ids))
        assert w[0, 1] == w[0, 2] == w[1, 2] == 1
        assert not w[3].any()


def test_cuda_driver_is_none_without_libcuda(monkeypatch):
    """When libcuda cannot be loaded, cuda_driver() is None (and is asked only once)."""
    import ctypes
    tried = []

    def cdll(name):
        tried.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(D, "_driver", [])
    assert D.cuda_driver() is None
    assert D.cuda_driver() is None
    assert tried == list(D._NAMES)
