"""The device verbs strategies, sparse values and optimizers are written against: the host
device's, the ordering joins built on them, and the rule that nothing above the device
layer imports CuPy or asks which kind a device is."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.comm import ordering
from gpukv.comm.plan import links
from gpukv.device import host_device
from gpukv.device.base import Term

from ..fake_gpu import FakeGpu

PACKAGE = Path(gpukv.__file__).resolve().parent


def test_host_device_has_nothing_to_order():
    """The host device queues nothing: activating it changes nothing, it records no event,
    waits for none, and entering or leaving a call does nothing."""
    host = host_device(1)
    assert host.host_memory and not host.asynchronous
    with host.activate():
        pass
    host.enter()
    host.leave()
    assert host.record() is None
    host.wait_event(None)
    host.wait_for(host_device(0))


def test_host_sum_into_sums_every_job():
    """sum_into sums each job's terms into its out (16-bit terms in float32, the out itself
    as a term, terms of two dtypes) and zero-fills an out with no terms."""
    host = host_device(0)
    plain = np.full(5, 7, np.float32)
    in_place = np.arange(5, dtype=np.float32)
    mixed = np.full(5, 7, np.float32)
    empty = np.full(5, 7, np.float32)
    big = np.full(5, 60000, np.float16)
    host.sum_into([
        (plain, [Term(big, False), Term(big, False)]),
        (in_place, [Term(np.ones(5, np.float16), False), Term(in_place, True)]),
        (mixed, [Term(np.ones(5, np.float16), False), Term(np.full(5, 2.0), False)]),
        (empty, []),
    ])
    np.testing.assert_array_equal(plain, 120000)
    np.testing.assert_array_equal(in_place, np.arange(5) + 1)
    np.testing.assert_array_equal(mixed, 3)
    np.testing.assert_array_equal(empty, 0)


def test_host_sum_into_reads_device_terms_through_to_host(monkeypatch):
    """A term the host cannot read where it lies is brought over by `to_host` first."""
    from gpukv.device import host as host_mod

    class Remote:
        """An array of another device: only `to_host` can read it."""
        dtype = np.dtype(np.float32)

    remote = Remote()
    monkeypatch.setattr(host_mod, "_gpu_to_numpy",
                        lambda a: np.full(3, 5, np.float32) if a is remote else None)
    out = np.zeros(3, np.float32)
    host_device(0).sum_into([(out, [Term(np.ones(3, np.float32), False),
                                    Term(remote, False)])])
    np.testing.assert_array_equal(out, 6)


def test_host_copy_many_casts_every_pair():
    """copy_many copies every pair into its destination's dtype."""
    dst = [np.zeros(4, np.float16), np.zeros(3, np.int64)]
    host_device(0).copy_many(list(zip(dst, [np.arange(4.0), np.arange(3, dtype=np.int8)])))
    assert dst[0].tolist() == [0, 1, 2, 3] and dst[1].tolist() == [0, 1, 2]


def test_host_segment_sum_adds_runs_in_float32():
    """segment_sum adds each run's rows (float16 rows in float32)."""
    data = np.array([[60000, 1], [60000, 2], [5, 5]], np.float16)
    sums = host_device(0).segment_sum(data, np.array([0, 2, 3]))
    assert sums.dtype == np.float32 and sums.tolist() == [[120000, 3], [5, 5]]


def test_a_host_device_waits_for_a_gpu_by_synchronising_it():
    """The host waiting for a device that queues work synchronises that device; a device
    waiting for the host has nothing to wait for."""
    log = []
    gpu = FakeGpu(0, log, {})
    host_device(0).wait_for(gpu)
    ordering.wait_all(gpu, [host_device(0)])
    assert log == [("synchronize", gpu.name)]


def test_finish_joins_on_a_gpu_when_the_home_is_the_host():
    """A call homed on the host joins its GPUs through one of them (events, no host
    synchronisation) and makes every GPU's caller wait for the call."""
    log, current = [], {}
    a, b = FakeGpu(0, log, current), FakeGpu(1, log, current)
    ordering.finish([host_device(0), a, b], host_device(0))
    assert ("synchronize", a.name) not in log and ("synchronize", b.name) not in log
    assert log == [("wait_for", a.name, b.name), ("record", a.name),
                   ("wait_event", b.name, a.name), ("leave", a.name), ("leave", b.name)]


def test_finish_of_host_devices_does_nothing():
    """A call on host devices only has nothing to join."""
    ordering.finish([host_device(1), host_device(2)], host_device(0))


def test_link_rows_of_a_full_matrix_follow_link_index():
    """A full link matrix is cut by each device's link index (a host slot, a GPU ordinal)."""
    full = np.arange(16.0).reshape(4, 4)
    hosts = [host_device(3), host_device(1)]
    np.testing.assert_array_equal(links.link_matrix_for(hosts, full), [[15, 13], [7, 5]])
    gpus = [FakeGpu(2, [], {}, slot=1), FakeGpu(0, [], {})]
    np.testing.assert_array_equal(links.link_matrix_for(gpus, full), [[10, 8], [2, 0]])


# ------------------------------------------------------------------ the layering rule
#: what only gpukv/device/ may write: a CuPy import or a test of the device kind
_DEVICE_ONLY = re.compile(r"import cupy|from cupy|kind [!=]= \"gpu\"|is_gpu\(|\.cuda_device\b"
                          r"|isinstance\([^)]*cupy")
#: packages written against device verbs only
_VERB_USERS = ["comm", "encoding", "optim"]


@pytest.mark.parametrize("package", _VERB_USERS)
def test_only_the_device_layer_knows_device_kinds(package):
    """Strategies, compression, sparse values and optimizers never import CuPy nor branch
    on the device kind: each such line names a device verb that is missing."""
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _DEVICE_ONLY.search(code):
                found.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
