"""Golden digests of every kernel case, made on the CUDA emulation, and the kernels section
that checks a GPU against them.

A case's digest is SHA-256 over its outputs (name, dtype, shape, bytes). Beside it the
goldens keep a canonical digest, taken after two documented differences between a GPU and
the emulation are taken out of the outputs:
- NaN payloads: a GPU's arithmetic returns its canonical NaN where the CPU carries an
  input's payload, so every NaN counts as one NaN;
- flush-to-zero edges: CuPy compiles with -ftz=true and the emulation runs the project's
  kernels with the CPU's DAZ/FTZ switches on, which flush float32 subnormals as a GPU does
  but float64 ones too (a GPU keeps them), and may round differently at the smallest
  normal; so every value of magnitude up to the smallest normal counts as +0 (float32,
  bfloat16, float64; float16 arithmetic runs in float32 and keeps its own subnormals).
  The cases hold no float64 subnormal inputs, whose later arithmetic no rule covers.
An output named "... (bfloat16 bits)" holds bfloat16 values as uint16 and is compared as
bfloat16.
A GPU output that matches the exact digest is bit-identical; one that matches only the
canonical digest differs only within these exceptions, which the section reports as such;
anything else is a mismatch, named with the outputs and elements that differ from the
host's NumPy twin run in the same check.

Remake the goldens after changing a kernel or a case, on the emulation, from a checkout:
    GPUKV_CUDA_EMULATION=1 python -m gpukv.tools.gpucheck.goldens
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from ..._errors import ArgumentError
from .budget import Deadline
from .kernel_cases import KernelCase, all_cases, bfloat16, needs_bfloat16
from .section import Section

GOLDENS = Path(__file__).with_name("kernel_goldens.json")
FORMAT = 1

# dtype name -> (exponent mask, mantissa mask, canonical NaN, largest magnitude flushed)
_FLOATS = {
    "float32": (0x7F800000, 0x007FFFFF, 0x7FFFFFFF, 0x00800000),
    "float16": (0x7C00, 0x03FF, 0x7FFF, None),
    "bfloat16": (0x7F80, 0x007F, 0x7FFF, 0x0080),
    "float64": (0x7FF0000000000000, 0x000FFFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF,
                0x0010000000000000),
}


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


BFLOAT16_BITS = "(bfloat16 bits)"


def canonical_bits(a: np.ndarray, as_float: str | None = None) -> np.ndarray:
    """The bits of `a` with the documented exceptions taken out (see the module);
    `as_float`: the float dtype whose bit patterns `a` holds as unsigned integers."""
    bits = _bits(a)
    spec = _FLOATS.get(as_float or a.dtype.name)
    if spec is None:
        return bits
    word = bits.dtype.type
    exponent, mantissa, nan, flushed = spec
    bits = bits.copy()
    is_nan = ((bits & word(exponent)) == word(exponent)) & ((bits & word(mantissa)) != 0)
    if flushed is not None:
        bits[(bits & word(exponent | mantissa)) <= word(flushed)] = 0
    bits[is_nan] = word(nan)
    return bits


def digest(outputs: dict, canonical: bool = False) -> str:
    h = hashlib.sha256()
    for name in sorted(outputs):
        a = np.asarray(outputs[name])
        bits = canonical_bits(a, _holds(name)) if canonical else _bits(a)
        h.update(f"{name}\0{a.dtype.name}\0{a.shape}\0".encode())
        h.update(bits.tobytes())
    return h.hexdigest()[:32]


def _holds(name: str) -> str | None:
    return "bfloat16" if name.endswith(BFLOAT16_BITS) else None


def exceptions_seen(outputs: dict) -> list:
    """Which documented exceptions the outputs hold values of."""
    kinds = set()
    for name, a in outputs.items():
        a = np.asarray(a)
        spec = _FLOATS.get(_holds(name) or a.dtype.name)
        if spec is None:
            continue
        bits = _bits(a)
        exponent, mantissa, _, flushed = spec
        if (((bits & exponent) == exponent) & ((bits & mantissa) != 0)).any():
            kinds.add("NaN payloads")
        if flushed is not None and ((bits & (exponent | mantissa)) <= flushed).any():
            kinds.add("flush-to-zero")
    return sorted(kinds)


def record(outputs: dict) -> dict:
    return {"exact": digest(outputs), "canonical": digest(outputs, canonical=True),
            "outputs": {k: f"{np.asarray(v).dtype.name}{list(np.shape(v))}"
                        for k, v in sorted(outputs.items())}}


def load(path: Path = GOLDENS) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: golden format {data.get('format')!r}, expected {FORMAT}")
    return data["cases"]


def differences(got: dict, want: dict) -> list:
    """Per output: how `got` differs from `want` once the exceptions are taken out."""
    found = []
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            found.append(f"{name}: only in {'the GPU' if name in got else 'the host twin'}")
            continue
        g, w = np.asarray(got[name]), np.asarray(want[name])
        if g.dtype != w.dtype or g.shape != w.shape:
            found.append(f"{name}: {g.dtype}{list(g.shape)} against {w.dtype}{list(w.shape)}")
            continue
        differ = np.flatnonzero(canonical_bits(g, _holds(name)) != canonical_bits(w, _holds(name)))
        if differ.size:
            i = int(differ[0])
            found.append(f"{name}: {differ.size} of {g.size} elements, first at {i}: "
                         f"{g.reshape(-1)[i]!r} against {w.reshape(-1)[i]!r}")
    return found


def run_case(case: KernelCase, device) -> dict:
    """The case's outputs on `device`; its infinities and NaNs are meant, so NumPy's
    warnings about them (in the host twins and the emulation) are not shown."""
    with np.errstate(all="ignore"):
        return case.run(device)


def run(deadline: Deadline, cases: list | None = None, goldens: dict | None = None) -> Section:
    """The kernels section: every case on GPU 0 against its golden."""
    from ...device.cuda.device import cuda_device
    from ...device.host import host_device
    section = Section("kernels")
    cases = all_cases() if cases is None else cases
    try:
        goldens = load() if goldens is None else goldens
    except (OSError, ValueError) as exc:
        section.fail(f"the goldens could not be read: {exc}")
        section.line = section.failed[0]
        return section
    gpu, host = cuda_device(0), host_device()
    matched: list = []
    documented: list = []
    mismatched: list = []
    not_run: list = []
    for done, case in enumerate(cases):
        # what is known so far, kept before each case: a case that hangs is named
        _summarise(section, len(cases), done, matched, documented, mismatched, not_run)
        section.progress(running=case.name)
        if deadline.passed():
            section.cut = f"the budget ran out after {done} of {len(cases)} cases"
            not_run += [c.name for c in cases[done:]]
            break
        golden = goldens.get(case.name)
        if golden is None:
            section.fail(f"{case.name}: no golden (remake them: python -m "
                         "gpukv.tools.gpucheck.goldens)")
            continue
        if needs_bfloat16(case) and bfloat16() is None:
            not_run.append(case.name)
            continue
        try:
            got = run_case(case, gpu)
        except Exception as exc:
            section.fail(f"{case.name}: {type(exc).__name__}: {exc}")
            continue
        if digest(got) == golden["exact"]:
            matched.append(case.name)
        elif digest(got, canonical=True) == golden["canonical"]:
            documented.append({"case": case.name, "exceptions": exceptions_seen(got)})
        else:
            details = _against_host(case, got, host)
            mismatched.append({"case": case.name, "family": case.family, "details": details})
            section.fail(f"{case.name}: differs from the emulation's golden; against the "
                         f"host twin: {'; '.join(details) or 'no difference'}")
    _summarise(section, len(cases), len(cases), matched, documented, mismatched, not_run)
    if not_run and section.cut is None:
        section.data["not_run_reason"] = "ml_dtypes (bfloat16) is not installed"
    return section


def _summarise(section: Section, cases: int, done: int, matched: list, documented: list,
               mismatched: list, not_run: list) -> None:
    """The section's data and line after `done` of `cases` cases."""
    section.data.update(cases=cases, identical=len(matched), documented=documented,
                        mismatches=mismatched, not_run=not_run, goldens=str(GOLDENS.name))
    section.line = ((f"{cases} cases" if done == cases else f"{done} of {cases} cases run")
                    + f": {len(matched)} bit-identical, {len(documented)} within the "
                    f"documented exceptions, {len(mismatched)} mismatched"
                    + (f", {len(not_run)} not run" if not_run else ""))


def _against_host(case: KernelCase, got: dict, host) -> list:
    try:
        return differences(got, run_case(case, host))
    except Exception as exc:
        return [f"the host twin failed: {type(exc).__name__}: {exc}"]


def make(cases: list | None = None) -> dict:
    """Goldens of every case, run on GPU 0 of the CUDA emulation."""
    from ...device.cuda.device import cuda_device
    gpu = cuda_device(0)
    return {case.name: record(run_case(case, gpu)) for case in (cases or all_cases())}


def write(path: Path = GOLDENS) -> Path:
    from ... import __version__
    data = {"format": FORMAT,
            "made_on": "the CUDA emulation of tests/cuda_emulation (GPU 0)",
            "gpukv": __version__, "cases": make()}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return Path(path)


def main(argv: list | None = None) -> int:
    from .machine import open_machine, wants_emulation
    try:
        emulated = wants_emulation()
    except ArgumentError as exc:
        print(f"gpukv goldens: {exc}", file=sys.stderr)
        return 2
    if not emulated:
        print("goldens are made on the CUDA emulation: run with GPUKV_CUDA_EMULATION=1 "
              "from a checkout", file=sys.stderr)
        return 2
    machine = open_machine()
    if isinstance(machine, str):
        print(f"gpukv goldens: {machine}", file=sys.stderr)
        return 2
    path = write()
    print(f"wrote {len(load(path))} golden digests to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
