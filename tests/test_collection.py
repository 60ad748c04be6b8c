"""The test command collects every test file of the tree, and refuses a malformed setting
of where its GPUs come from."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_every_test_file_is_collected(request):
    """A folder pytest skips by default (`dist`, `build`, ...) would silently drop its
    tests from the suite: every tests/**/test_*.py is in the collection. The run this
    test is in answers when it collected every file (the whole suite); else (a part of
    the suite chosen, or a file skipped whole for a missing optional library) a
    collection of the whole tree is asked for."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert "tests/distributed/test_dist_store.py" in files
    here = {pathlib.Path(str(item.path)).relative_to(ROOT).as_posix()
            for item in request.session.items}
    if files <= here:
        return
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    # a test's id, or (a file skipped whole: a missing optional library) its skip line
    missed = sorted(f for f in files if f not in listing.stdout)
    assert not missed, missed


def test_a_malformed_emulation_setting_stops_the_run_naming_it():
    """GPUKV_CUDA_EMULATION=yes is neither 1 (the emulation) nor 0 (a real GPU): the run
    stops before collecting, naming it, rather than taking it for unset."""
    env = {**os.environ, "GPUKV_CUDA_EMULATION": "yes"}
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider", "tests/test_collection.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert listing.returncode != 0, listing.stdout
    assert "GPUKV_CUDA_EMULATION='yes': expected 1 (on) or 0 (off)" in (
        listing.stdout + listing.stderr), listing.stdout + listing.stderr
