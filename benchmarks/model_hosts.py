"""A round's time on 64-1024 hosts: a model fitted to runs on emulated hosts, against
NCCL's own cost model of its ring and tree all-reduce.

    python benchmarks/bench_cluster.py --hosts 2,4,8,16 --rates 100mbit --sizes 4KB,4MB \\
        --ways s0,mpi --out /tmp/scale
    python benchmarks/model_hosts.py /tmp/scale/cluster_<machine>.json

The published table (docs/distributed.md) took the message cost measured with its runs:
`--message-us 36.36` with benchmarks/results/cluster_hosts_intel-r-xeon-r-processor.json
gives it again; without it the cost is measured on the machine that runs this.

The model of one push+pull round with num_servers=0 on N hosts, one process each:
- a small key (under 64 KB: one packed MPI allreduce beside the round's agreement) takes
  an allreduce plus gpukv's software cost per round, s: gpukv's round less MPI
  Allreduce's on 2 hosts of the runs (with more hosts than this machine has cores, the
  emulated hosts queue for the CPU, MPI's and gpukv's alike, and the figures say so
  more than they say anything about a real cluster);
- a split key of B bytes goes through the exchange (on 3 hosts or more; two processes
  take MPI's own allreduce): every process sends each other owner its share of each
  chunk (N - 1 messages per chunk) and each summed chunk on to the N - 1 others, so
  T = 2(N-1)/N x B / (e R) + c x 2(N-1) x chunks, where e is the share of the link R
  the bytes got on the fewest hosts above 2 in the runs and c the software cost of one
  message (its send, receive, tests and the sum of its chunk), measured here by two
  processes made to exchange an 8 MB key in 16 KB chunks against 1 MB chunks
  (`--message-us` skips it).

The prediction takes s, e and c as they are and the link at 100-400 Gb/s, and names the
cost per message at which the exchange, its bytes at the link's full rate, would take
what NCCL's best takes. NCCL's model is
the one in NCCL's src/graph/tuning.cc, one GPU and one NIC per host: ring (Simple)
latency 8.4 us + 2(N-1) x 9.6 us (x 1.9 for large messages), bus bandwidth the link's,
B x 2(N-1)/N over it; tree (Simple) latency 2 log2(N) x 50 us, half
of 0.9 x the link; ring (LL) 6.6 us + 2(N-1) x 2.7 us at a quarter of the link; tree (LL)
6.8 us + 2 log2(N) x 5 us at 1/3.8 of the tree's bandwidth; the best of the four.
Results: hosts_model_<machine>.json in --out DIR (default benchmarks/results/; '-' writes
nothing).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
from bench_dist import find_mpiexec  # noqa: E402

from gpukv.distributed.mpi.chunks import CHUNK_BYTES  # noqa: E402
from gpukv.tools import cluster as emulated  # noqa: E402

SMALL_MAX = 64 << 10  # keys below this travel packed, by one MPI allreduce
PREDICT_HOSTS = (64, 256, 1024)
PREDICT_GBITS = (100, 400)
PREDICT_BYTES = {"4 KB": 4096, "100 MB": 100_000_000}
#: NCCL's tuning.cc, network: (base latency, per-step latency in us, share of the link)
NCCL_RING_SIMPLE = (8.4, 9.6, 1.0)
NCCL_RING_LL = (6.6, 2.7, 0.25)
NCCL_TREE_SIMPLE = (0.0, 50.0, 0.45)
NCCL_TREE_LL = (6.8, 5.0, 0.45 / 3.8)
NCCL_RING_PLATEAU = 1.9  # the ring's latency for large messages (tuning.cc)
MESSAGE_KEY = 8 << 20  # the key and the small chunks of the per-message measurement
MESSAGE_CHUNK = 16 << 10


def messages(hosts: int, nbytes: int, chunk: int = CHUNK_BYTES) -> int:
    """The messages one process sends in the exchange of a split key (and receives)."""
    piece = nbytes / hosts
    return 2 * (hosts - 1) * max(1, math.ceil(piece / chunk))


def nccl_seconds(hosts: int, nbytes: int, link_bytes: float) -> dict:
    """NCCL's modelled all-reduce time per algorithm/protocol, and the best."""
    steps = 2 * (hosts - 1)
    spread = steps / hosts * nbytes
    base, step, share = NCCL_RING_SIMPLE
    ring = (base + steps * step) * 1e-6
    if nbytes >= hosts / 16 * 65536:
        ring *= NCCL_RING_PLATEAU
    times = {"ring": ring + spread / (share * link_bytes)}
    base, step, share = NCCL_RING_LL
    times["ring LL"] = (base + steps * step) * 1e-6 + spread / (share * link_bytes)
    base, step, share = NCCL_TREE_SIMPLE
    times["tree"] = (base + 2 * math.log2(hosts) * step) * 1e-6 + nbytes / (share * link_bytes)
    base, step, share = NCCL_TREE_LL
    times["tree LL"] = ((base + 2 * math.log2(hosts) * step) * 1e-6
                        + nbytes / (share * link_bytes))
    times["best"] = min(times.values())
    return times


def fitted(cases: list, message_s: float) -> dict:
    """The model's figures from a bench_cluster run's cases (one rate; ways s0 and mpi
    on 2 hosts, and whatever else they ran, kept for the record); ValueError saying what
    the runs lack."""
    rates = {c["rate"] for c in cases}
    if len(rates) != 1:
        raise ValueError(f"expected the runs of one link rate, got {sorted(rates)}")
    rate_bytes = emulated.rate_bits(rates.pop()) / 8
    ok = [c for c in cases if c["ok"] and c["keys"] == 1 and c["way"] in ("s0", "mpi")]

    def median(way: str, small: bool) -> float:
        found = [c for c in ok if c["way"] == way and c["hosts"] == 2
                 and (c["bytes"] < SMALL_MAX) == small]
        if not found:
            raise ValueError(f"expected way {way} on 2 hosts with a key "
                             f"{'under' if small else 'of at least'} 64 KB")
        return found[0]["median_s"]

    large = sorted((c for c in ok if c["way"] == "s0" and c["hosts"] > 2
                    and c["bytes"] >= SMALL_MAX), key=lambda c: c["hosts"])
    if not large:
        raise ValueError("expected way s0 on 3 hosts or more with a key of at least 64 KB")
    hosts, nbytes = large[0]["hosts"], large[0]["bytes"]
    exchange_s = large[0]["median_s"] - message_s * messages(hosts, nbytes)
    return {"rate_bytes_per_s": rate_bytes,
            "round_software_s": median("s0", small=True) - median("mpi", small=True),
            "link_share": (2 * (hosts - 1) / hosts * nbytes / rate_bytes) / exchange_s,
            "link_share_hosts": hosts,
            "message_s": message_s,
            "runs": [{k: c[k] for k in ("hosts", "way", "bytes", "median_s",
                                        "fraction_of_limit")} for c in ok]}


def measure_message_s() -> float:
    """Seconds of software per exchange message: 2 processes, an 8 MB key in 16 KB
    chunks against 1 MB chunks."""
    import subprocess
    import tempfile

    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for chunk in (MESSAGE_CHUNK, CHUNK_BYTES):
            out = Path(tmp) / f"{chunk}.json"
            subprocess.run([find_mpiexec(), "-n", "2", sys.executable, __file__, "--child",
                            "--result", str(out)], check=True, timeout=300,
                           env={**os.environ, "GPUKV_DIST_CHUNK_BYTES": str(chunk)})
            times[chunk] = json.loads(out.read_text())["median_s"]
    extra = messages(2, MESSAGE_KEY, MESSAGE_CHUNK) - messages(2, MESSAGE_KEY)
    return (times[MESSAGE_CHUNK] - times[CHUNK_BYTES]) / extra


def child(result: str) -> int:
    """One process of `measure_message_s`: push+pull of an 8 MB key, the median of 15, in
    the chunks GPUKV_DIST_CHUNK_BYTES says."""
    import time

    from mpi4py import MPI

    import gpukv
    from gpukv.distributed.engines import exchange
    exchange.MPI_FOR_TWO = False  # the exchange's messages, not MPI's allreduce
    kv = gpukv.create("dist_sync")
    grad = np.ones(MESSAGE_KEY // 4, np.float32)
    out = np.empty_like(grad)
    kv.init("w", np.zeros_like(grad))
    seconds = []
    for i in range(18):
        start = time.perf_counter()
        kv.push("w", grad)
        kv.pull("w", out=out)
        if i >= 3:
            seconds.append(time.perf_counter() - start)
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(result).write_text(json.dumps({"median_s": float(np.median(seconds))}))
    return 0


def predict(fits: dict) -> list[dict]:
    rows = []
    for hosts in PREDICT_HOSTS:
        for gbits in PREDICT_GBITS:
            link = gbits * 1e9 / 8
            for label, nbytes in PREDICT_BYTES.items():
                nccl = nccl_seconds(hosts, nbytes, link)
                if nbytes < SMALL_MAX:  # with an MPI allreduce as fast as NCCL's
                    gpukv = fits["round_software_s"] + nccl["best"]
                    messages_s = 0.0
                else:
                    messages_s = fits["message_s"] * messages(hosts, nbytes)
                    gpukv = 2 * (hosts - 1) / hosts * nbytes / (fits["link_share"] * link) \
                        + messages_s
                rows.append({"hosts": hosts, "gbit_s": gbits, "size": label,
                             "bytes": nbytes, "gpukv_s": gpukv, "messages_s": messages_s,
                             "nccl_s": nccl, "gpukv_over_nccl": gpukv / nccl["best"],
                             "message_s_to_match": _needed(hosts, nbytes, link,
                                                           nccl["best"])})
    return rows


def _needed(hosts: int, nbytes: int, link: float, target: float) -> float | None:
    """The cost per message at which the exchange, its bytes at the link's full rate
    (as NCCL's model has its ring's), would match `target` (None: not even at no cost,
    or a small key)."""
    if nbytes < SMALL_MAX:
        return None
    left = target - 2 * (hosts - 1) / hosts * nbytes / link
    return left / messages(hosts, nbytes) if left > 0 else None


def main(argv=None) -> int:
    p = C.ArgumentParser(description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="?", help="a bench_cluster.py JSON with ways s0 and mpi on "
                   "2 hosts, a key under 64 KB and one of 64 KB or more")
    p.add_argument("--message-us", type=C.nonnegative_float, default=None, metavar="US",
                   help="the software cost of one exchange message, in microseconds "
                        "(default: measured on this machine)")
    C.add_out_option(p, "hosts_model_<machine>.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.result)
    if not args.runs:
        p.error("the bench_cluster.py JSON is required")
    try:
        record = json.loads(Path(args.runs).read_text())
        cases = record["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        p.error(f"{args.runs}: not a bench_cluster.py JSON ({type(exc).__name__}: {exc})")
    message_s = (args.message_us * 1e-6 if args.message_us is not None
                 else measure_message_s())
    try:
        fits = fitted(cases, message_s)
    except ValueError as exc:  # (the runs lack what the model needs)
        p.error(f"{args.runs}: {exc}")
    rows = predict(fits)
    print(f"from the runs at {cases[0]['rate']}: a small round's software "
          f"{fits['round_software_s'] * 1e6:.0f} us over MPI Allreduce's; the exchange's "
          f"bytes at {fits['link_share']:.0%} of the link; {message_s * 1e6:.1f} us of "
          f"software per message")
    table = [[r["hosts"], r["gbit_s"], r["size"], C.format_seconds(r["gpukv_s"]),
              C.format_seconds(r["messages_s"]) if r["messages_s"] else "-",
              C.format_seconds(r["nccl_s"]["best"]),
              round(r["gpukv_over_nccl"], 1),
              f"{r['message_s_to_match'] * 1e6:.2f} us" if r["message_s_to_match"] else "-"]
             for r in rows]
    C.print_table(["hosts", "Gb/s", "size", "gpukv S=0", "of it messages", "NCCL (best)",
                   "x NCCL", "per message to match"], table)
    # The fits come from the runs' machine; the message cost, unless given, from this one.
    C.save_results({"benchmark": "model_hosts", "runs": str(args.runs),
                    "runs_machine": record.get("machine"),
                    "machine": C.machine_info(),
                    "versions": C.library_versions("gpukv", "numpy", "mpi4py"),
                    "message_us": {"value": message_s * 1e6,
                                   "how": "given" if args.message_us is not None
                                   else "measured on this machine"},
                    "fits": fits, "predictions": rows,
                    "nccl_model": {"ring_simple": NCCL_RING_SIMPLE, "ring_ll": NCCL_RING_LL,
                                   "tree_simple": NCCL_TREE_SIMPLE, "tree_ll": NCCL_TREE_LL,
                                   "ring_plateau": NCCL_RING_PLATEAU}},
                   args.out, C.result_name("hosts_model"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
