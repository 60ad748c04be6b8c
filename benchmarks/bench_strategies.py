"""Push+pull of every reduction strategy against a per-key loop and PyTorch.

A thin wrapper: the benchmark lives in `gpukv.tools.bench` so that `python -m gpukv bench`
runs the same code from an installed package. Unlike `gpukv bench`, this script writes its
JSON and chart into benchmarks/results/ unless `--out DIR` (or `--out -`) says otherwise.
See `--help` for the options, e.g.

    python benchmarks/bench_strategies.py --sizes 4K..256M --devices 2,4,8 --iters 20
    python benchmarks/bench_strategies.py --host --sizes 4K,1M --devices 2,4 --cases sweep
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the gpukv package of this checkout

from gpukv.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=Path(__file__).name, out_default=HERE / "results"))
