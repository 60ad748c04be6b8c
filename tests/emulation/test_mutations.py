"""A small mutation suite: each edit of `mutations.MUTATIONS` (a wait between streams
deleted, a kernel's bound dropped), made to a copy of gpukv, makes at least one of the
tests named for it fail, under the adversarial schedule with the race checker on; the
same tests pass on the sources as they are."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .. import gpu_env
from .mutations import MUTATIONS, ROOT, apply

pytestmark = [
    pytest.mark.skipif(not gpu_env.EMULATED, reason="runs on the CUDA emulation"),
    pytest.mark.slow,
]


def _run(tests, package_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    """pytest on `tests` (node ids under the checkout) with the gpukv of `package_dir`."""
    env = gpu_env.subprocess_env()
    paths = [str(package_dir)] + [p for p in env["PYTHONPATH"].split(":") if p != str(ROOT)]
    env.update(PYTHONPATH=":".join(paths), GPUKV_CUDA_EMULATION="1", GPUKV_TEST_GPU="1",
               GPUKV_EMU_RACES="1",
               GPUKV_EMU_SCHEDULE="adversarial")
    # --import-mode=append: the checkout goes last on sys.path, the copy stays first
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
         "--rootdir", str(ROOT), "-c", str(ROOT / "setup.cfg")]
        + [str(ROOT / t) for t in tests],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_chosen_tests_pass_on_the_sources(tmp_path):
    """Every test the mutations rely on passes on an unedited copy of gpukv."""
    import shutil
    shutil.copytree(ROOT / "gpukv", tmp_path / "gpukv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    tests = sorted({t for m in MUTATIONS for t in m.tests})
    proc = _run(tests, tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name.replace(" ", "-"))
def test_each_mutation_fails_a_test(mutation, tmp_path):
    """The edited copy fails at least one of the mutation's tests (and only because a
    test failed: the run itself worked)."""
    assert mutation.tests, f"{mutation.name}: no test is named to catch it"
    proc = _run(mutation.tests, apply(mutation, tmp_path), tmp_path)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 1 and " failed" in tail, (
        f"{mutation.name}: its tests did not fail (exit {proc.returncode}):\n{tail}"
        f"{proc.stderr[-2000:]}")
