"""Formatting, file and version helpers, and the command-line options, shared by
`python -m gpukv bench`, its `--calibrate` mode and benchmarks/*.py.

Standard library only and no package-relative imports: benchmarks/_common.py loads this
file by its path, also under interpreters where gpukv is not installed (the MXNet one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BadArgument(ValueError, argparse.ArgumentTypeError):
    """A malformed command-line value. A ValueError for callers; as the `type` of an
    argparse option it becomes 'argument --x: <message>' and exit status 2."""


_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?")


def parse_size(text: str) -> int:
    """'4K' / '4KB' / '4KiB' -> 4096, '1G' -> 2**30, '300' / '300B' -> 300 (binary units)."""
    match = _SIZE.fullmatch(text.strip().upper())
    if match is None and text.strip().startswith("-"):
        raise BadArgument(f"size {text.strip()!r} is negative: a size is a count of bytes, "
                          "e.g. 300, 4K, 16M, 1GiB")
    if match is None:
        raise BadArgument(f"size {text.strip()!r}: expected a number with an optional "
                          "K, M or G suffix (binary), e.g. 300, 4K, 16M, 1GiB")
    return int(match.group(1)) * SUFFIX[match.group(2)]


def size_at_least(minimum: int, what: str, item: int = 1):
    """An argparse type: a size (`parse_size`) of at least `minimum` bytes, else an error
    saying it is below `what`, and a whole number of `item`-byte items (argparse names
    the option)."""
    def parse(text: str) -> int:
        size = parse_size(text)
        if size < minimum:
            raise BadArgument(f"size {text.strip()!r}: below {what}")
        if size % item:
            raise BadArgument(f"size {text.strip()!r}: not a whole number of {item}-byte "
                              f"items; give a multiple of {item}")
        return size
    parse.__name__ = f"size >= {minimum}"
    return parse


def parse_sizes(text: str, minimum: int = 1) -> list[int]:
    """'4K,1M' -> [4096, 1048576]; 'A..B' -> A, 4A, 16A, ... up to B (both included).
    There must be one, and every size a whole number of `minimum`-byte items (a float32
    key's sizes: minimum 4), so that the size timed is the size asked for."""
    sizes: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if ".." in part:
            sizes += _size_range(part)
        elif part:
            sizes.append(parse_size(part))
    if not sizes:
        raise BadArgument(f"sizes {text!r}: expected one or more, e.g. 4K,1M or 4K..1M")
    small = [s for s in sizes if s < minimum]
    if small:
        raise BadArgument(f"sizes {text!r}: {small[0]} is below the smallest size, {minimum}")
    odd = [s for s in sizes if s % minimum]
    if odd:
        raise BadArgument(f"sizes {text!r}: {odd[0]} is not a whole number of "
                          f"{minimum}-byte items; give a multiple of {minimum}")
    return sizes


def _size_range(part: str) -> list[int]:
    lo, hi = (parse_size(t) for t in part.split("..", 1))
    if lo <= 0 or hi < lo:
        raise BadArgument(f"size range {part!r}: expected A..B with 0 < A <= B")
    sizes = []
    while lo < hi:
        sizes.append(lo)
        lo *= 4
    return sizes + [hi]


def parse_ints(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8]: one or more positive integers."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if not p.isdigit() or int(p) < 1]
    if bad or not parts:
        raise BadArgument(f"{bad[0] if bad else text!r}: expected comma-separated "
                          "positive integers, e.g. 2,4,8")
    return [int(p) for p in parts]


def name_list(valid, what: str, allow_empty: bool = False):
    """An argparse `type` for comma-separated names among `valid` (a sequence, or a
    callable returning one, for names known only once imported), lower-cased."""
    def parse(text: str) -> list[str]:
        known = list(valid() if callable(valid) else valid)
        names = [s.strip().lower() for s in text.split(",") if s.strip()]
        unknown = [n for n in names if n not in known]
        choices = ", ".join(known)
        if unknown:
            raise BadArgument(f"unknown {what} {', '.join(map(repr, unknown))}: "
                              f"choose from {choices}")
        if not (names or allow_empty):
            raise BadArgument(f"no {what} given: choose from {choices}")
        return names
    return parse


def format_size(n: int) -> str:
    """The inverse of parse_size for round numbers: 1048576 -> '1M', 1000 -> '1000'."""
    for suffix in ("G", "M", "K"):
        unit = SUFFIX[suffix]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def format_seconds(s: float | None) -> str:
    """1.5e-5 -> '15.0 us', 0.0123 -> '12.3 ms'."""
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def cell(v, digits: int = 3) -> str:
    """A table cell: '-' for None, floats to `digits` significant digits below 1000."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(headers, rows, left, *, file=None) -> None:
    """A plain aligned text table; the columns whose index is in `left` left-aligned,
    the others right-aligned."""
    file = file or sys.stdout
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)


def slug(text: str) -> str:
    """'AMD EPYC 7B13' -> 'amd-epyc-7b13' ('unknown' when nothing is left)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def cpu_model(default: str = "") -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux), else platform's guess,
    else `default`. The twin of `gpukv.device.cuda.probe.cpu_model`: this file imports
    nothing of the package, and the layers below `tools` cannot import it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or default


def module_version(name: str) -> str | None:
    """The version of module `name`: its `__version__` when it is imported, else its
    installed distribution's; None when neither is there."""
    version = getattr(sys.modules.get(name), "__version__", None)
    return str(version) if version is not None else _distribution_version(name)


CUPY_DISTRIBUTIONS = ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy")


def versions(gpu: dict | None = None) -> dict:
    """The versions a measurement ran with: Python, NumPy, gpukv, PyTorch (when imported,
    with its thread count) and tqdm, then `gpu` (CuPy, CUDA and NCCL versions from the
    device layer) for a run on GPUs; without `gpu`, the CuPy distribution installed
    but not used."""
    out = {"python": platform.python_version(), "numpy": module_version("numpy"),
           "gpukv": module_version("gpukv")}
    torch = sys.modules.get("torch")
    out["torch"] = getattr(torch, "__version__", None) if torch is not None else None
    if torch is not None:
        out["torch_threads"] = torch.get_num_threads()
    out["tqdm"] = module_version("tqdm")
    if gpu is not None:
        out.update(gpu)
        return out
    out["cupy"] = None
    for dist in CUPY_DISTRIBUTIONS:  # installed, even if unusable here (no driver or GPU)
        version = _distribution_version(dist)
        if version is not None:
            out["cupy"] = f"{version} ({dist}, not used: no GPU)"
            break
    return out


def _distribution_version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment_settings() -> dict[str, str]:
    """The GPUKV_* (and MXNet's MXNET_KVSTORE_*) environment variables set: what a store
    made by the measured run read, e.g. GPUKV_DETERMINISTIC or GPUKV_HOST_THREADS."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(("GPUKV_", "MXNET_KVSTORE_"))}


def command_line() -> str:
    """The command that runs this process again: `python -m gpukv ...` for the `gpukv`
    command (whose argv[0] is its __main__.py, which cannot run as a file)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py":
        argv[0:1] = ["-m", Path(argv[0]).parent.name]
    return " ".join([Path(sys.executable).name] + argv)


def write_record(path: Path, payload: dict, created_utc: str) -> Path:
    """Write `payload` after its creation time, the command line and the environment's
    settings it ran with (under "environment_variables": a payload's "settings" are its options) as
    pretty JSON, through a temporary file renamed over `path`. Returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"created_utc": created_utc, "command": command_line(),
              "environment_variables": environment_settings(), "source": source_revision(),
              "numba": _version_of("numba")}
    record.update(payload)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def source_revision() -> dict | None:
    """The git commit of the gpukv source that ran, and whether its tracked files had
    changes beside it (a result is read against the code that made it); None outside a
    git checkout, or without git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                  "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode or changes.returncode:
        return None
    return {"commit": commit.stdout.strip(), "modified": bool(changes.stdout.strip())}


def _version_of(distribution: str) -> str | None:
    """The installed version of `distribution` (the host codecs compile with Numba: its
    version changes their speed), None when it is missing."""
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------- the command line
# The options every benchmark script and `gpukv bench` share, built here so that they
# are spelled, parsed and explained the same way everywhere.
OUT_NONE = "-"
_NEGATIVE = re.compile(r"-\.?\d")


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser that takes a value starting with '-' and a digit ('--sizes -4K',
    '--lr -1e-3') as the value of the option before it, as it takes '-1'. Plain argparse
    takes '-4K' for an unknown option and says only "expected one argument"; here the
    option's own parser says what is wrong with the value. No option of these commands
    starts with '-' and a digit."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        for arg in args:
            last = joined[-1] if joined else ""
            if (_NEGATIVE.match(arg) and last.startswith("--") and last != "--"
                    and "=" not in last):
                joined[-1] = f"{last}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)


def _at_least(minimum: int):
    """An argparse type: an integer >= `minimum` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise BadArgument(f"expected an integer, got {text.strip()!r}") from None
        if value < minimum:
            raise BadArgument(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = _at_least(1)
nonnegative_int = _at_least(0)


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (argparse names the option in its error)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise BadArgument(f"expected a number, got {text.strip()!r}") from None
    if not math.isfinite(value) or value < 0:
        raise BadArgument(f"must be a finite number >= 0, got {text.strip()!r}")
    return value


def out_dir(text: str) -> str:
    """An argparse type for --out: '-', or a path that is a folder or can become one
    (nothing on the way to it is a file); the text as given."""
    if text == OUT_NONE:
        return text
    path = Path(text)
    for place in (path, *path.parents):
        if place.exists() or place.is_symlink():
            if not place.is_dir():
                why = ("is a file, not a folder" if place == path
                       else f"cannot be a folder: {str(place)!r} is a file")
                raise BadArgument(f"{text!r} {why}; give a folder for the results (made "
                                  f"if need be), or '{OUT_NONE}' for none")
            break
    return text


def add_sizes_option(p: argparse.ArgumentParser, default: str | None, what: str,
                     minimum: int = 1, default_text: str | None = None) -> None:
    """--sizes: byte counts with binary units, parsed by `parse_sizes`."""
    p.add_argument("--sizes", type=lambda text: parse_sizes(text, minimum), default=default,
                   metavar="BYTES",
                   help=f"{what}: bytes with K/M/G units (binary), '4KB,1MB', or 'A..B' "
                        f"in x4 steps, e.g. 4K..16M (default {default_text or default})")


def add_devices_option(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """--devices: a list of device counts; every count is a case of its own."""
    p.add_argument("--devices", type=parse_ints, default=default, metavar="COUNTS",
                   help=f"comma-separated device counts, e.g. 1,2,4, each a case of its "
                        f"own: {what} (default {default})")


def add_timing_options(p: argparse.ArgumentParser, warmup: int, iters: int,
                       unit: str = "call", note: str = "", iters_note: str = "") -> None:
    """--warmup and --iters: untimed runs first, then timed runs whose median is reported,
    for every case. `unit` names what is repeated; `note` is added to both help texts,
    `iters_note` to --iters' only."""
    warmup_notes = "".join(f"; {n}" for n in (note,) if n)
    iters_notes = "".join(f"; {n}" for n in (note, iters_note) if n)
    p.add_argument("--warmup", type=nonnegative_int, default=warmup, metavar="N",
                   help=f"untimed {unit}s before timing each case (default {warmup})"
                        f"{warmup_notes}")
    p.add_argument("--iters", type=positive_int, default=iters, metavar="N",
                   help=f"timed {unit}s per case, reported as their median "
                        f"(default {iters}){iters_notes}")


def add_place_options(p: argparse.ArgumentParser, default: str) -> None:
    """--host / --gpu: where to run; `default` says what neither flag means."""
    place = p.add_mutually_exclusive_group()
    place.add_argument("--host", action="store_true",
                       help=f"run on the host (NumPy arrays) only; without --host or "
                            f"--gpu: {default}")
    place.add_argument("--gpu", action="store_true",
                       help="run on GPUs only (needs CuPy and a GPU; exits 1 without one)")


def add_out_option(p: argparse.ArgumentParser, default: str | None, files: str) -> None:
    """--out DIR: the folder for the result files (`files` names them); '-' for none.
    `default` is the folder used without --out, None for none."""
    where = (f"default {default}" if default is not None
             else "default: none, the results are only printed")
    p.add_argument("--out", type=out_dir, default=None, metavar="DIR",
                   help=f"folder for {files} ({where}); '{OUT_NONE}' writes nothing")


def out_folder(value: str | None, default: str | os.PathLike | None) -> Path | None:
    """The folder --out names: `default` without --out, None for '-' (write nothing)."""
    if value == OUT_NONE:
        return None
    if value is None:
        return None if default is None else Path(default)
    return Path(value)


def elements(nbytes: int, itemsize: int) -> int:
    """How many items of `itemsize` bytes fit in `nbytes` (at least one)."""
    return max(1, nbytes // itemsize)


def pyplot():
    """matplotlib's pyplot drawing to files only (ImportError without matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out `fig`, write it as `path` (its folder made if need be) and free it. The
    command that made it is written under it, so that a plot met alone says how to make
    it again."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.text(0.005, -0.005, command_line(), fontsize=6, color="0.35", ha="left", va="top")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
