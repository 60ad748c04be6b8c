"""Predicted push+pull time of every reduction strategy on machines we may not have.

Runs the alpha-beta model of `gpukv.comm.plan.simulate` (no GPU needed) for each machine
profile x strategy x key size x device count, prints a table with the tree/home ratio,
and writes simulated_topologies.json and .png into --out DIR (default benchmarks/results/;
'-' writes nothing). `--warmup` and `--iters` are accepted, as by every benchmark, and
ignored: the model is deterministic.

    python benchmarks/simulate_topologies.py
    python benchmarks/simulate_topologies.py --sizes 4K,1M,64M --devices 2,8 --machines dgx1-v100

The numbers are model predictions, not measurements: the JSON records the model's
constants so that a later measured benchmark can be compared with them.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from gpukv.comm.plan import simulate, topology  # noqa: E402

DEFAULT_SIZES = "4K,64K,1M,4M,16M,64M,256M,1G"
DEFAULT_DEVICES = "2,4,8"
RESULT_NAME = "simulated_topologies"


def build_parser() -> argparse.ArgumentParser:
    p = _common.ArgumentParser(prog=Path(__file__).name,
                               description=__doc__.splitlines()[0])
    _common.add_sizes_option(p, DEFAULT_SIZES, "key sizes per device")
    _common.add_devices_option(p, DEFAULT_DEVICES, "devices of the simulated machine "
                               "(counts above a profile's GPUs are left out)")
    p.add_argument("--machines", type=_common.name_list(simulate.MACHINES, "machine"),
                   default=",".join(simulate.MACHINES), metavar="NAMES",
                   help=f"machine profiles among {', '.join(simulate.MACHINES)}, "
                        "comma-separated (default: all)")
    _common.add_timing_options(p, 0, 1, unit="run",
                               note="accepted and ignored: the model is deterministic")
    _common.add_out_option(p, f"{RESULT_NAME}.json and .png")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def run(sizes, devices, machines) -> list:
    rows = []
    for name in machines:
        full = simulate.machine(name)
        for n in devices:
            if n > full.n:
                continue
            for size in sizes:
                times = simulate.predict_all(size, n, name)
                rows.append({
                    "machine": name, "devices": n, "bytes": size,
                    "seconds": times,
                    "best": min(times, key=times.get),
                    "tree_over_home": times["tree"] / times["home"],
                    "home_over_tree": times["home"] / times["tree"],
                })
    return rows


def print_rows(rows) -> None:
    headers = ["machine", "n", "size"] + [f"{s} (us)" for s in simulate.STRATEGIES] \
        + ["tree/home", "best"]
    table = [[r["machine"], r["devices"], _common.format_size(r["bytes"])]
             + [round(r["seconds"][s] * 1e6, 1) for s in simulate.STRATEGIES]
             + [round(r["tree_over_home"], 3), r["best"]] for r in rows]
    _common.print_table(headers, table)


def plot(rows, path: Path) -> None:
    plt = _common.pyplot()

    machines = list(dict.fromkeys(r["machine"] for r in rows))
    fig, axes = plt.subplots(2, len(machines), figsize=(5 * len(machines), 8), squeeze=False)
    for col, name in enumerate(machines):
        mine = [r for r in rows if r["machine"] == name]
        n_max = max(r["devices"] for r in mine)
        top = [r for r in mine if r["devices"] == n_max]
        ax = axes[0][col]
        for s in simulate.STRATEGIES:
            ax.loglog([r["bytes"] for r in top], [r["seconds"][s] for r in top],
                      marker="o", ms=3, label=s)
        ax.set_title(f"{name}, {n_max} devices")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("predicted push+pull (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        for n in sorted({r["devices"] for r in mine}):
            sel = [r for r in mine if r["devices"] == n]
            ax.semilogx([r["bytes"] for r in sel], [r["home_over_tree"] for r in sel],
                        marker="o", ms=3, label=f"{n} devices")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{name}: tree speed-up over home")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("home time / tree time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    _common.save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes, devices, machines = args.sizes, args.devices, args.machines
    rows = run(sizes, devices, machines)
    print_rows(rows)
    profiles = {}
    for name in machines:
        m = simulate.machine(name)
        profiles[name] = {
            "matrix": m.matrix.tolist(),
            "links": {str(w): dataclasses.asdict(c) for w, c in m.links.items()},
            "staged": dataclasses.asdict(m.staged),
            "ports_gbps": m.ports, "buses_gbps": m.buses, "hbm_gbps": m.hbm_gbps,
            "host_gbps": m.host_gbps, "host_total_gbps": m.host_total_gbps,
            "host_sum_gbps": m.host_sum_gbps,
            "ring": topology.plan_ring(m.matrix),
            "tree_link_usage": topology.usage_summary(topology.plan_trees(m.matrix), m.matrix),
        }
    payload = {
        "kind": "simulated (alpha-beta model, no hardware timed)",
        "machine": _common.machine_info(),
        "versions": _common.library_versions("gpukv", "numpy"),
        "model_constants": dataclasses.asdict(simulate.COSTS),
        "tree_options": topology.tree_options(),
        "profiles": profiles,
        "results": rows,
    }
    print()
    _common.save_results(payload, args.out, RESULT_NAME, plot=lambda png: plot(rows, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
