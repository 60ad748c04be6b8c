"""Helpers of the optimizer reference generators (run under the MXNet interpreter)."""
import json

import mxnet as mx
import numpy as np


def values(a):
    """The floats of `a`, flattened, each written with repr (float32 values survive)."""
    return [repr(float(x)) for x in np.asarray(a, dtype=np.float64).reshape(-1)]


def write_cases(out, cases, steps):
    """Write the cases, with the MXNet and NumPy versions and the step count, to `out`."""
    doc = {"mxnet": mx.__version__, "numpy": np.__version__, "steps": steps, "cases": cases}
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}")
