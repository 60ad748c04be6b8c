"""Deterministic engines across processes continue the canonical reduction tree
(`gpukv.canonical`): fed each worker's node partials, every key's value is the same bits
as the NumPy tree sum of all its values, whatever the number of workers and servers, the
updater, and however the key is split, packed or chunked (programs/canonical.py)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import gpukv
from gpukv import ArgumentError, PeerMismatchError
from gpukv.canonical.arrays import merge_into, own_sum
from gpukv.canonical.tree import leaves_sum, nodes, rank_nodes
from gpukv.distributed import Leaves, Partials
from gpukv.distributed.engines.partials import check_partials, decode_leaves, sum_leaves
from gpukv.distributed.engines.server import same_compression
from gpukv.encoding.compressors import make_compressor

from .. import gpu_env
from .mpirun import ok, run


def _job(n: int, servers: int, scenario: str, expect_ok: bool = True):
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_DIST_CHUNK_BYTES=str(64 << 10), GPUKV_DIST_TIMEOUT="30")
    result = run("canonical.py", n, str(servers), scenario, env=env, timeout=180)
    return ok(result) if expect_ok else result


@pytest.mark.mpi
@pytest.mark.parametrize("n, servers", [(1, 0), (2, 0), (4, 0), (8, 0), (3, 1), (5, 1),
                                        (4, 2), (6, 2)],
                         ids=lambda v: str(v))
def test_every_layout_gives_the_tree_sum(n, servers):
    """Split, alone, packed and float16 keys, with one or several node partials per
    worker, without an updater, with one that assigns and with SGD: every worker's value
    is the NumPy tree sum of the 8 leaves (rounded once into the key's dtype)."""
    out = _job(n, servers, "canonical")
    assert len(re.findall(r"PASS worker \d+ of", out)) == n - servers, out


@pytest.mark.mpi
def test_the_default_order_differs_on_the_same_data():
    """The default engines sum 4 workers' float32 sums in rank order: the split key's
    bits differ from the tree sum, so the canonical test above can fail."""
    out = _job(4, 0, "default")
    assert len(re.findall(r"DIGESTS worker \d+ of 4: big=differs", out)) == 4, out


@pytest.mark.mpi
@pytest.mark.parametrize("n, servers", [(2, 0), (3, 1)], ids=["S=0", "S=1"])
def test_another_count_fails_every_worker(n, servers):
    """A worker pushing another count of values of a key fails the push on every worker
    with a PeerMismatchError naming the key and both counts."""
    result = _job(n, servers, "counts", expect_ok=False)
    out = result.stdout
    caught = re.findall(r"CAUGHT PeerMismatchError on worker (\d+): (.*?)(?=CAUGHT|$)",
                        out, re.S)
    assert sorted(w for w, _ in caught) == ["0", "1"], out + result.stderr
    for _, message in caught:
        assert "'odd_small'" in message and "3 value(s)" in message, message
        assert "2 value(s)" in message, message


def _leaves(n: int, size: int = 257) -> list:
    rng = np.random.default_rng(n)
    return [(rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3, size))
            .astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ranks, count", [(1, 1), (1, 5), (2, 3), (3, 2), (4, 2), (3, 5),
                                          (8, 1)])
def test_merging_every_ranks_nodes_is_the_tree_sum(ranks, count, dtype):
    """The merge of every rank's node partials, the root's add into the output, is the
    tree sum of the leaves (rounded once into a float16 output)."""
    values = _leaves(ranks * count, 300)
    parts = [((lo, hi), leaves_sum(values[lo:hi], np.add))
             for r in range(ranks) for lo, hi in rank_nodes(r, count, ranks)]
    scratch: list = []
    for size in (257, 100, 300):  # the scratch kept, then too small for a larger chunk
        out = np.empty(size, dtype)
        merge_into(out, [(rng, v[:size]) for rng, v in parts], ranks * count, scratch)
        want = leaves_sum([v[:size] for v in values], np.add).astype(dtype)
        assert out.tobytes() == want.tobytes()


def test_one_scratch_serves_merges_of_every_size_and_tree():
    """The temporaries a caller keeps serve its next merges, of any size and any number
    of nodes (more temporaries, or fewer than it holds)."""
    scratch: list = []
    for ranks, count, size in [(8, 1, 100), (2, 1, 300), (4, 2, 50), (3, 5, 400)]:
        values = _leaves(ranks * count, size)
        parts = [((lo, hi), leaves_sum(values[lo:hi], np.add))
                 for r in range(ranks) for lo, hi in rank_nodes(r, count, ranks)]
        out = np.empty(size, np.float32)
        merge_into(out, parts, ranks * count, scratch)
        assert out.tobytes() == leaves_sum(values, np.add).tobytes()


def test_a_push_alone_is_its_own_nodes_merged():
    """A worker's several node partials applied alone (dist_async) are its own leaves'
    nodes merged as far as the tree goes, then added in order."""
    values = _leaves(6)
    mine = rank_nodes(0, 3, 2)  # [0, 2) and [2, 3): no parent of both inside the rank
    rows = np.stack([leaves_sum(values[lo:hi], np.add) for lo, hi in mine])
    want = np.add(np.add(values[0], values[1]), values[2])
    assert own_sum(rows, mine, 6).tobytes() == want.tobytes()
    assert nodes(0, 3, 6) == mine


@pytest.mark.parametrize("grad, problem", [
    (np.zeros((1, 10), np.float32), "Partials"),
    (Partials(np.zeros((1, 10), np.float32), 0), "Partials"),
    (Partials(np.zeros((2, 10), np.float32), 4), "shape (1, 10)"),
    (Partials(np.zeros((1, 10), np.float16), 4), "float32"),
    (Partials(np.zeros((1, 20), np.float32)[:, ::2], 4), "not contiguous"),
])
def test_partials_are_checked_against_their_key(grad, problem):
    """Partials of a float16 key must be float32 rows, one per node of the worker's
    count: anything else is an ArgumentError naming the key."""
    with pytest.raises(ArgumentError, match=f"key 'w'.*{re.escape(problem)}"):
        check_partials(["w"], [grad], [(10, np.float16)], 0, 2)


@pytest.mark.parametrize("grad, problem", [
    (Partials(np.zeros((1, 10), np.float32), 1), "Leaves"),
    (Leaves(np.zeros((2, 10), np.float32), 3), "shape (3, 10)"),
    (Leaves(np.zeros((1, 10), np.float16), 1), "float32"),
    (Leaves(np.zeros((1, 20), np.float32)[:, ::2], 1), "not contiguous"),
])
def test_leaves_are_checked_against_their_key(grad, problem):
    """A key compressed on the wire takes Leaves: float32 rows, one per value pushed;
    anything else is an ArgumentError naming the key."""
    with pytest.raises(ArgumentError, match=f"key 'w'.*{re.escape(problem)}"):
        check_partials(["w"], [grad], [(10, np.float16)], 0, 2, [True])


@pytest.mark.parametrize("params", [{"type": "2bit", "threshold": 0.5},
                                    {"type": "fp16", "pre_divide": 3.0},
                                    {"type": "bf16", "pre_divide": 2.0}],
                         ids=lambda p: p["type"])
def test_decoded_leaves_sum_as_one_process(params):
    """Each of 8 values compressed with its own residual, three rounds: the payloads
    decoded and summed by `sum_leaves` are the bits a one-process deterministic store
    with the same compression assigns."""
    comp = make_compressor(params)
    assert comp is not None
    kv = gpukv.create("device", deterministic=True)
    kv.init("w", np.zeros(257, np.float32))
    kv.set_gradient_compression(params)
    residuals = [np.zeros(257, np.float32) for _ in range(8)]
    for r in range(3):
        values = _leaves(8 + r)[:8]  # another seed each round
        kv.push("w", values)
        got = np.empty(257, np.float32)
        kv.pull("w", out=got)
        payloads = [comp.compress(v, res)[0] for v, res in zip(values, residuals)]
        terms = np.empty((8, 257), np.float32)
        decode_leaves(comp, payloads, 257, terms)
        total = np.empty(257, np.float32)
        sum_leaves(comp, terms, total)
        assert total.tobytes() == got.tobytes(), r


def test_workers_that_compress_unlike_fail_the_round():
    """A server's round of leaves' payloads from workers that compressed a key unlike
    is a PeerMismatchError naming the key and each worker's compression."""
    two_bit = SimpleNamespace(comp=((("threshold", 0.5), ("type", "2bit")), 10))
    with pytest.raises(PeerMismatchError, match=r"key 'w'.*worker\(s\) 1: no compression"):
        same_compression("w", [two_bit, SimpleNamespace(comp=None)])
    same_compression("w", [two_bit, two_bit])  # alike: no error
