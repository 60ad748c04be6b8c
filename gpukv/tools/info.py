"""`python -m gpukv info`: what gpukv sees on this machine and what it would do there.

Versions, GPUs (or "no GPU: host only"), logical/virtual devices, the peer-access and
link matrices, the reduction trees and ring the planner picks, NCCL and MPI
availability, the default strategy, and whether its cost model uses a calibration file
(`python -m gpukv bench --calibrate`) or the default constants. Works without CuPy, a
driver or a GPU.
`--simulate dgx1|nvswitch|pcie` prints the planner's choices for a machine we do not
have (`--gpus N` sizes the nvswitch and pcie ones); `--json` prints everything as one
JSON object instead. `--kernels` prints, instead, each CUDA kernel's registers, shared
memory, spills and occupancy on sm_80, sm_90 and sm_100, with the bytes it moves per
element (kernel_resources.py): no GPU needed, only the NVRTC and nvcc (ptxas) wheels.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

from .._env import malformed, name_unknown, unknown_settings

SIMULATED = ("dgx1", "nvswitch", "pcie")
RESIZABLE = ("nvswitch", "pcie")  # simulations whose GPU count --gpus sets (dgx1 has 8)
# The planner's time grows steeply with the GPU count (about 0.4 s at 32, 8 s at 64).
MAX_SIMULATED_GPUS = 32
# gpukv is installed from its source tree, so the CUDA extra is named by path, not by name.
INSTALL_HINT = ("pip install cupy-cuda12x (or cupy-cuda13x); in a gpukv checkout, "
                "pip install '.[cuda12]' (or '.[cuda13]')")


def _err(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


# ------------------------------------------------------------------------- pieces
def cupy_info() -> dict:
    """CuPy's version and the CUDA versions it sees; `error` when CuPy is unusable."""
    from ..device.cuda.probe import cupy_versions
    return cupy_versions()


def gpu_info(cupy: dict | None = None) -> dict:
    """Physical GPUs (name, memory, compute capability) and the logical devices over them;
    `cupy` is `cupy_info()` when already known."""
    from ..device.cuda import probe
    from ..device.cuda.device import gpu_devices
    gpus = probe.gpu_properties()
    out: dict = {"count": len(gpus), "gpus": gpus, "logical": []}
    if not gpus:
        cupy = cupy_info() if cupy is None else cupy
        # Without CuPy the reason is plain; how to install it is said once, with CuPy's line.
        out["reason"] = (probe.no_gpu_reason() if cupy["installed"]
                         else "CuPy is not installed")
        return out
    try:
        devices = gpu_devices()
        out["logical"] = [{"index": i, "physical": d.physical, "slot": d.slot}
                          for i, d in enumerate(devices)]
    except Exception as exc:
        out["logical_error"] = _err(exc)
    out["virtual_gpus_env"] = os.environ.get("GPUKV_VIRTUAL_GPUS") or None
    return out


def plan(matrix) -> dict:
    """The planner's trees (one per root) and ring for a link matrix."""
    from ..comm.plan import topology
    out: dict = {"matrix": np.asarray(matrix, dtype=float).tolist()}
    try:
        trees = topology.plan_trees(matrix)
        out["trees"] = [{"root": t.root, "parent": list(t.parent),
                         "levels": [[list(e) for e in level] for level in t.levels],
                         "staged": sorted(list(e) for e in t.staged)}
                        for t in trees]
        try:
            out["link_usage"] = topology.usage_summary(trees, matrix)
            out["link_usage"]["by_weight"] = {
                str(k): v for k, v in out["link_usage"]["by_weight"].items()}
        except Exception as exc:
            out["link_usage_error"] = _err(exc)
    except Exception as exc:
        out["trees_error"] = _err(exc)
    try:
        out["ring"] = [int(i) for i in topology.plan_ring(matrix)]
    except Exception as exc:
        out["ring_error"] = _err(exc)
    return out


def topology_info(gpus: dict) -> dict:
    """Peer access, link matrix, trees and ring of this machine's logical GPUs."""
    if not gpus["count"]:
        return {"available": False, "reason": "no GPU"}
    from ..comm.plan import topology
    from ..device.cuda import probe
    out: dict = {"available": True}
    physical = list(range(gpus["count"]))
    try:
        out["peer_access"] = probe.peer_access(physical)
    except Exception as exc:
        out["peer_access_error"] = _err(exc)
    logical = [d["physical"] for d in gpus["logical"]] or physical
    out["devices"] = [f"{d['physical']}.{d['slot']}" if d["slot"] else str(d["physical"])
                      for d in gpus["logical"]] or [str(p) for p in physical]
    try:
        matrix = topology.link_matrix_from_ranks(logical, probe.p2p_ranks(logical))
    except Exception as exc:
        out["link_error"] = _err(exc)
        return out
    out.update(plan(matrix))
    return out


def simulated_matrix(name: str, n: int | None = None):
    """The link matrix of a machine we do not have: dgx1 (8 V100), nvswitch, pcie."""
    from ..comm.plan import topology
    if name == "dgx1":
        return topology.dgx1_v100(), "DGX-1 V100 hybrid cube-mesh (8 GPUs, NVLink weights 1-3)"
    if name == "nvswitch":
        n = n or 8
        return topology.nvswitch_h100(n), f"NVSwitch box ({n} GPUs, all pairs equal)"
    if name == "pcie":
        n = n or 8
        return (topology.pcie_two_socket(n),
                f"PCIe-only two-socket box ({n} GPUs; 2: same switch, 1: same socket, "
                "0: staged through the host)")
    raise ValueError(f"simulate {name!r}: expected one of {', '.join(SIMULATED)}")


def nccl_info() -> dict:
    """Whether CuPy's NCCL binding loads, and the NCCL version."""
    from ..device.cuda.probe import nccl_versions
    return nccl_versions()


def mpi_info() -> dict:
    """mpi4py (without initialising MPI), the MPI library it links, and mpiexec."""
    out: dict = {}
    try:
        import mpi4py
        out["mpi4py"] = mpi4py.__version__
        mpi4py.rc.initialize = False  # only ask; never start MPI from `gpukv info`
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        out["library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        out["standard"] = "{}.{}".format(*MPI.Get_version())
        out["available"] = True
    except Exception as exc:
        out["available"] = False
        out.setdefault("mpi4py", None)
        out["reason"] = _err(exc)
    launcher = shutil.which("mpiexec")
    if launcher is None:
        beside = Path(sys.executable).parent / "mpiexec"
        launcher = str(beside) if beside.exists() else None
        out["mpiexec_note"] = ("next to this Python, not on PATH" if launcher
                               else "not found")
    out["mpiexec"] = launcher
    return out


def strategy_info(on_gpu: bool) -> dict:
    """The strategy a GPU store uses by default, and what the names resolve to here."""
    from ..comm.registry import STRATEGIES, env_strategy, make_strategy
    env = os.environ.get("GPUKV_STRATEGY", "").strip() or None
    out = {"names": list(STRATEGIES), "env": env, "default": env or "auto",
           "deterministic": os.environ.get("GPUKV_DETERMINISTIC", "").strip() == "1"}
    try:
        env_strategy()  # (checked without a GPU too: a GPU store would refuse it)
        chosen = make_strategy(None, on_gpu=on_gpu)
        out["resolves_to"] = chosen.name
    except Exception as exc:
        out["resolves_to_error"] = _err(exc)
    if not on_gpu:
        out["note"] = "no GPU: every store reduces on the host ('cpu')"
    return out


def refused_by(name: str) -> str:
    """Who refuses GPUKV_* setting `name` when it is malformed, in words."""
    from ..distributed import store as dist_store
    from ..launcher.run_rank import VERBOSE_ENV
    from ..store.settings import GPU_ONLY, TREE_CHECKS
    from .gpucheck.machine import EMULATION_ENV
    if name == VERBOSE_ENV:
        return "gpukv run refuses it"
    if name == EMULATION_ENV:
        return "gpukv gpucheck refuses it"
    if name in TREE_CHECKS:
        return "the tree and auto strategies refuse it"
    if name in GPU_ONLY:
        return "GPU stores refuse it"
    if name in dist_store.setting_checks():
        return "dist stores refuse it"
    return "stores refuse it"


def settings_errors() -> dict:
    """{variable: why it is refused} for each malformed GPUKV_* setting, checked by the
    readers the stores (and `gpukv run`) use, so that `info` names each one `create`
    would refuse."""
    from ..distributed import store as dist_store
    from ..launcher import run_rank
    from ..store import settings as store_settings
    from .gpucheck import machine
    checks = {**store_settings.setting_checks(), **store_settings.TREE_CHECKS,
              **dist_store.setting_checks(), run_rank.VERBOSE_ENV: run_rank.verbose,
              machine.EMULATION_ENV: machine.wants_emulation}
    return {name: str(exc) for name, exc in malformed(checks).items()}


def calibration_info() -> dict:
    """Whether the cost model uses a calibration file (which, when measured) or defaults."""
    from ..comm.plan import simulate
    try:
        return simulate.calibration_status()
    except Exception as exc:  # never let a calibration problem break `info`
        return {"in_use": False, "path": None, "reason": _err(exc)}


def collect(simulate: str | None = None, simulate_n: int | None = None) -> dict:
    """Everything `gpukv info` reports, as a dict."""
    import gpukv
    cupy = cupy_info()
    gpus = gpu_info(cupy)
    info = {
        "gpukv": gpukv.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cupy": cupy,
        "gpus": gpus,
        "topology": topology_info(gpus),
        "nccl": nccl_info(),
        "mpi": mpi_info(),
        "strategy": strategy_info(gpus["count"] > 0),
        "calibration": calibration_info(),
        "setting_errors": settings_errors(),
        "unknown_settings": unknown_settings(),
    }
    torch = _module_version("torch")
    if torch is not None:
        info["torch"] = torch
    if simulate:
        matrix, text = simulated_matrix(simulate, simulate_n)
        info["simulated"] = {"name": simulate, "description": text, **plan(matrix)}
    return info


def _module_version(name: str):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------ output
def _matrix_lines(matrix, labels, fmt) -> list:
    width = max(3, max(len(fmt(v)) for row in matrix for v in row), max(map(len, labels)))
    head = " " * (width + 1) + " ".join(lab.rjust(width) for lab in labels)
    lines = [head]
    for lab, row in zip(labels, matrix):
        lines.append(lab.rjust(width) + " " + " ".join(fmt(v).rjust(width) for v in row))
    return lines


def _plan_lines(p: dict, labels) -> list:
    lines = []
    if "matrix" in p:
        lines.append("link matrix (0: no direct link; higher: faster):")
        lines += ["  " + s for s in _matrix_lines(p["matrix"], labels,
                                                  lambda v: f"{v:g}")]
    if "trees" in p:
        lines.append("reduction trees (one per root; steps leaves first, child->parent):")
        for t in p["trees"]:
            steps = " | ".join(", ".join(f"{labels[c]}->{labels[q]}" for c, q in level)
                               for level in t["levels"])
            staged = f"  staged: {t['staged']}" if t.get("staged") else ""
            lines.append(f"  root {labels[t['root']]}: {steps or '(single device)'}{staged}")
        use = p.get("link_usage")
        if use:
            lines.append(f"  links used: {use['used']} of {use['links']}, uses per link "
                         f"{use['min']}..{use['max']}, staged edges {use['staged_edges']}")
    elif "trees_error" in p:
        lines.append(f"reduction trees: unavailable ({p['trees_error']})")
    if "ring" in p:
        lines.append("ring: " + " -> ".join(labels[i] for i in p["ring"] + p["ring"][:1]))
    elif "ring_error" in p:
        lines.append(f"ring: unavailable ({p['ring_error']})")
    return lines


def render(info: dict) -> str:
    lines = [f"gpukv {info['gpukv']}  (Python {info['python']}, NumPy {info['numpy']}, "
             f"{info['platform']})"]
    if info.get("torch"):
        lines[0] = lines[0].rstrip(")") + f", PyTorch {info['torch']})"
    cp = info["cupy"]
    if cp["installed"]:
        lines.append(f"CuPy {cp['version']}: CUDA runtime {cp.get('cuda_runtime') or '-'}, "
                     f"driver {cp.get('cuda_driver') or '-'}"
                     + (f"  ({cp['error']})" if cp.get("error") else ""))
    else:
        lines.append(f"CuPy: not installed ({cp['error']})")
        lines.append(f"  for GPUs, {INSTALL_HINT}")
    gpus = info["gpus"]
    lines.append("")
    if not gpus["count"]:
        lines.append(f"devices: no GPU: host only ({gpus.get('reason', 'no GPU')})")
        lines.append("  stores reduce on the host (NumPy); any number of host arrays act as "
                     "devices")
    else:
        lines.append(f"devices: {gpus['count']} GPU(s)")
        for g in gpus["gpus"]:
            lines.append(f"  GPU {g['id']}: {g['name']}, {g['memory_GiB']} GiB, "
                         f"compute capability {g['compute_capability']}")
        logical = gpus.get("logical") or []
        virtual = gpus.get("virtual_gpus_env")
        lines.append(f"logical devices: {len(logical)}"
                     + (f" (GPUKV_VIRTUAL_GPUS={virtual})" if virtual else "")
                     + ": " + ", ".join(f"{d['index']}=GPU {d['physical']}"
                                        + (f" slot {d['slot']}" if d["slot"] else "")
                                        for d in logical))
        if gpus.get("logical_error"):
            lines.append(f"  ({gpus['logical_error']})")
    topo = info["topology"]
    if topo.get("available"):
        if "peer_access" in topo:
            lines.append("peer access (row reads column):")
            labels = [str(i) for i in range(len(topo["peer_access"]))]
            lines += ["  " + s for s in _matrix_lines(topo["peer_access"], labels,
                                                      lambda v: "yes" if v else "-")]
        elif "peer_access_error" in topo:
            lines.append(f"peer access: unavailable ({topo['peer_access_error']})")
        if "link_error" in topo:
            lines.append(f"link matrix: unavailable ({topo['link_error']})")
        else:
            lines += _plan_lines(topo, topo["devices"])
    lines.append("")
    n = info["nccl"]
    lines.append("NCCL: " + (f"available, version {n.get('version', '?')}" if n["available"]
                             else f"not available ({n['reason']})"))
    m = info["mpi"]
    if m["available"]:
        lines.append(f"MPI: mpi4py {m['mpi4py']}, {m['library']} (MPI {m['standard']})")
    else:
        lines.append(f"MPI: not available ({m['reason']})")
    lines.append(f"mpiexec: {m['mpiexec'] or 'not found'}"
                 + (f" ({m['mpiexec_note']})" if m.get("mpiexec_note") and m["mpiexec"] else ""))
    s = info["strategy"]
    lines.append(f"default strategy: {s['default']}"
                 + (" (from GPUKV_STRATEGY)" if s.get("env") else "")
                 + (f" -> {s['resolves_to']}" if s.get("resolves_to") else "")
                 + (f" -> error: {s['resolves_to_error']}" if s.get("resolves_to_error")
                    else "")
                 + (f"; {s['note']}" if s.get("note") else ""))
    lines.append(f"strategies: {', '.join(s['names'])}")
    lines.append("sum order: " + ("canonical, the same bits for every layout "
                                  "(GPUKV_DETERMINISTIC=1)" if s.get("deterministic") else
                                  "each strategy's own (deterministic=True or "
                                  "GPUKV_DETERMINISTIC=1: the canonical order)"))
    lines += [f"malformed setting ({refused_by(name)}): {why}"
              for name, why in info.get("setting_errors", {}).items()]
    if info.get("unknown_settings"):
        lines.append("not a setting gpukv reads (without effect): "
                     + name_unknown(info["unknown_settings"]))
    c = info.get("calibration")
    if c:
        if c["in_use"]:
            lines.append(f"cost model: calibrated from {c['path']} (measured "
                         f"{c['created_utc']} on {c.get('measured_on') or '?'}; "
                         f"{len(c['constants'])} constants, {len(c['links'])} link classes)")
        else:
            where = f" at {c['path']}" if c.get("path") else ""
            lines.append(f"cost model: default constants ({c['reason']}{where}; "
                         "`python -m gpukv bench --calibrate` measures this machine's)")
    sim = info.get("simulated")
    if sim:
        lines.append("")
        lines.append(f"simulated {sim['name']}: {sim['description']}")
        labels = [str(i) for i in range(len(sim["matrix"]))]
        lines += _plan_lines(sim, labels)
    return "\n".join(lines)


def _simulated_gpus(text: str) -> int:
    """An argparse type: a GPU count the planner handles in well under a second."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= n <= MAX_SIMULATED_GPUS:
        raise argparse.ArgumentTypeError(
            f"must be in 1..{MAX_SIMULATED_GPUS}, got {n} (planning takes much longer "
            "beyond that)")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpukv info",
        description="Show versions, devices, links, NCCL/MPI and the strategies gpukv picks.")
    p.add_argument("--simulate", choices=SIMULATED,
                   help="also print the planner's trees and ring for a simulated machine")
    p.add_argument("--gpus", type=_simulated_gpus, default=None, metavar="N",
                   help="GPUs of the simulated nvswitch or pcie machine, 1.."
                        f"{MAX_SIMULATED_GPUS} (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--kernels", action="store_true",
                   help="instead, compile every CUDA kernel for sm_80/sm_90/sm_100 and print "
                        "registers, shared memory, spills, occupancy and bytes per element "
                        "(needs the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 wheels, "
                        "no GPU)")
    return p


def kernels_main(as_json: bool) -> int:
    """`gpukv info --kernels`: 0, or 2 with one line when NVRTC or ptxas is missing, 1 when
    a kernel does not compile."""
    from . import kernel_resources as kr
    from .nvrtc import NvrtcError
    try:
        rows = kr.report_rows(kr.measure(kr.kernel_cases()))
    except kr.KernelToolMissing as exc:
        print(f"gpukv info: error: --kernels needs NVRTC and ptxas: {exc}", file=sys.stderr)
        return 2
    except (NvrtcError, RuntimeError) as exc:
        print(f"gpukv info: error: a kernel did not compile: {_err(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if as_json else kr.render(rows))
    return 0


def main(argv=None) -> int:
    """`gpukv info [--simulate dgx1|nvswitch|pcie [--gpus N]] [--json]`, or
    `gpukv info --kernels [--json]`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kernels:
        if args.simulate or args.gpus is not None:
            parser.error("argument --kernels: reports the kernels alone (no --simulate or "
                         "--gpus)")
        return kernels_main(args.json)
    if args.gpus is not None and args.simulate not in RESIZABLE:
        given = f"--simulate {args.simulate} always has 8 GPUs" if args.simulate else \
            "without --simulate, info shows this machine's"
        parser.error(f"argument --gpus: sets the GPUs of --simulate "
                     f"{' or '.join(RESIZABLE)} only ({given})")
    info = collect(args.simulate, args.gpus)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
