"""Split keys of an S = 0 store summed by the chunked exchange (gpukv.distributed.engines.exchange)
across real MPI processes: the sum is the workers' gradients added in rank order, bit for
bit, for pieces and chunks of every length and every dtype, and a worker that stops in the
middle of an exchange is named in a PeerError within the timeout."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from .. import gpu_env
from ..bfloat16 import needs_bfloat16
from .mpirun import ok, require_mpi, run

pytestmark = pytest.mark.mpi


def _split_sums(n: int, dtype: str, sizes: str, updater: bool, chunk_bytes: int):
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="30")
    out = ok(run("scenarios.py", n, "split_sums", dtype, sizes, "1" if updater else "0",
                 str(chunk_bytes), env=env, timeout=120))
    assert len(re.findall(r"PASS worker \d+ of", out)) == n, out


@pytest.mark.parametrize("updater", [False, True], ids=["sum", "updater"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_short_chunks_sum_in_rank_order(n, dtype, updater):
    """Keys whose last piece is 1 element (pieces start at multiples of 128) or 7, and
    of lengths that neither the processes nor the 10-element chunks divide, are summed
    in rank order, bit for bit, on every worker."""
    _split_sums(n, dtype, f"{128 * (n - 1) + 1},263,1001,3001", updater, 40)


@pytest.mark.parametrize("updater", [False, True], ids=["sum", "updater"])
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bfloat16),
                                   "float64", "int8", "uint8", "int64"])
def test_every_dtype_sums_in_rank_order(dtype, updater):
    """Every dtype the store takes (16-bit floats summed in float32) gets the rank-order
    sum through short chunks."""
    _split_sums(3, dtype, "3,1001,3001", updater, 64)


@pytest.mark.parametrize("updater", [False, True], ids=["sum", "updater"])
@pytest.mark.parametrize("n", [3, 4])
def test_big_key_is_the_same_bits_whatever_the_order_of_arrival(n, updater):
    """A key split in pieces of several default-sized chunks is the rank-order sum, bit
    for bit: the same on every worker whichever contribution arrived first."""
    _split_sums(n, "float32", "1300003", updater, 0)


@pytest.mark.parametrize("n", [3, 2])
def test_worker_stalled_in_an_exchange_is_named_within_the_timeout(n):
    """A worker that stops in the middle of an exchange (its first chunks sent), or of
    MPI's allreduce between two: every other worker raises PeerError naming it within
    the timeout, and the job ends."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="3")
    start = time.monotonic()
    result = run("scenarios.py", n, "stall_in_exchange", "1", env=env, timeout=90)
    took = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    lines = re.findall(r"CAUGHT PeerError on worker (\d+): (.*?)(?=CAUGHT|$)",
                       result.stdout, re.M | re.S)
    assert sorted(w for w, _ in lines) == [str(w) for w in range(n) if w != 1], out
    for _, line in lines:
        assert "push of key 'w': reduce-scatter" in line or "allreduce" in line, line
        # rank 1 named (a loaded machine may find a rank waiting on it late as well)
        named = re.search(r"no data from rank\(s\) ([\d, ]+) within 3 s", line)
        assert named and "1" in named.group(1).split(", "), line
        after = float(re.search(r"after ([\d.]+) s", line).group(1))  # type: ignore
        assert after < 3 * 2, line
    assert took < 60, took


# A wait of 0.2 s, four times the spin of a rank with a core of its own, counting its naps.
_NAPS = """
import time
from mpi4py import MPI
from gpukv.distributed.mpi.transport import Transport
naps = []
time.sleep = naps.append  # the waits' naps, recorded instead of slept
t = Transport(MPI.COMM_SELF, 5.0)
start, tests = time.monotonic(), [0]
def done():
    tests[0] += 1
    return True if time.monotonic() - start > 0.2 else None
t.poll(done, "a transfer", moved={moved})
print(len(naps))
"""


@pytest.mark.parametrize("moved, napped", [("lambda: tests[0]", False), ("None", True)])
def test_wait_keeps_testing_while_messages_move(moved, napped):
    """A wait whose messages keep moving (MPI moves them on only while they are tested)
    never naps, however long it lasts; a wait where nothing moves naps past its spin."""
    require_mpi()
    proc = subprocess.run([sys.executable, "-c", _NAPS.format(moved=moved)],
                          capture_output=True, text=True, timeout=60, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert (int(proc.stdout) > 0) == napped, proc.stdout


def test_a_job_ends_cleanly_right_after_an_exchange():
    """Two workers end right after an exchange of 8 KB messages, which MPICH moves between
    processes of one machine by a single copy the receiver acks. With one cell in its
    shared-memory queue an ack often has to wait; a receiver that reached MPI_Finalize
    still owing it would leave the sender to time out (7 of 10 such jobs without the wait
    at exit). Each process waits at exit until every other has reached its own, and MPI
    sends the ack on meanwhile."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="5", GPUKV_DIST_CHUNK_BYTES="8192",
               MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS="1")
    for _ in range(4):
        out = ok(run("scenarios.py", 2, "end_after_an_exchange", "4", env=env, timeout=60))
        assert len(re.findall(r"PASS worker \d+ of 2", out)) == 2, out


def test_a_process_that_ends_late_finds_the_others_words_at_exit():
    """Three workers; worker 2 ends three timeouts after the others. They wait for its word
    at exit no longer than the timeout, then end (MPI_Finalize); worker 2, last to its
    exit, finds both words there and ends at once, where a barrier's later rounds would
    have waited out its timeout on processes already in MPI_Finalize."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="2")
    out = ok(run("scenarios.py", 3, "end_late", "2", env=env, timeout=90))
    said = re.findall(r"EXIT WAIT worker (\d+): ([\d.]+) s", out)
    waits = {int(w): float(s) for w, s in said}
    assert sorted(waits) == [0, 1, 2], out
    assert 1.9 < waits[0] < 5 and 1.9 < waits[1] < 5, waits  # bounded by the timeout
    assert waits[2] < 1, waits
