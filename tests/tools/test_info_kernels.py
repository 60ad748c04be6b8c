"""`gpukv info --kernels`: each kernel's registers, shared memory, spills and occupancy on
sm_80, sm_90 and sm_100 from NVRTC and ptxas (no GPU), CUDA's occupancy rules, and one
clear line with status 2 when a tool is missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.tools import info as _info
from gpukv.tools import kernel_resources as kr

from .. import gpu_env

REPO = Path(__file__).resolve().parents[2]
H100 = kr.ARCH_BY_NAME["sm_90"]


# ------------------------------------------------------------------ occupancy rules
@pytest.mark.parametrize("registers, smem, threads, blocks, limiter", [
    (32, 0, 256, 8, "threads per SM"),      # 32 x 32 = 1024 registers a warp: 16 per quarter
    (40, 0, 256, 6, "registers"),           # 1280 a warp: 12 warps per quarter, 2 a block
    (64, 0, 256, 4, "registers"),
    (255, 0, 256, 1, "registers"),          # 8192 a warp: 2 per quarter
    (16, 0, 64, 32, "blocks per SM"),       # two warps a block: the 32-block cap binds
    (32, 100 * 1024, 256, 2, "shared memory"),  # 101 KiB a block with the reserved 1 KiB
    (32, 4096, 1024, 2, "threads per SM"),
])
def test_occupancy_follows_cudas_rules(registers, smem, threads, blocks, limiter):
    """Resident blocks per SM on sm_90 are the least of the register, shared memory,
    thread and block limits, with registers given per warp in units of 256 per quarter
    of the register file and shared memory per block plus 1 KiB, in units of 128 bytes."""
    occ = kr.occupancy(H100, registers, smem, threads)
    assert (occ.blocks, occ.limiter) == (blocks, limiter)
    assert occ.warps == blocks * -(-threads // 32)
    assert occ.fraction == occ.warps / 64


def test_occupancy_refuses_an_impossible_block():
    """A block of more than 1024 threads has no occupancy: ValueError."""
    with pytest.raises(ValueError, match="1..1024"):
        kr.occupancy(H100, 32, 0, 2048)


def test_hbm_fraction_is_littles_law_capped_at_one():
    """The bandwidth estimate is bytes in flight over bandwidth x latency per SM, at most 1."""
    need = H100.hbm_gbs * 1e9 * kr.DRAM_LATENCY_S / H100.sms
    assert kr.hbm_fraction(H100, 16, 4.0) == pytest.approx(16 * 32 * 4.0 / need)
    assert kr.hbm_fraction(H100, 64, 1e6) == 1.0


def test_ptxas_log_is_parsed_with_spills_and_local_memory():
    """Registers, shared memory, stack, spills and lmem come out of a ptxas -v log, and any
    local memory use is a problem."""
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    24 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, 16 bytes lmem
"""
    a, b = kr.parse_ptxas(log)
    assert (a.kernel, a.arch, a.registers, a.smem, a.barriers) == ("a", "sm_90", 40, 4096, 1)
    assert a.problems() == []
    assert (b.registers, b.stack, b.spill_stores, b.spill_loads, b.lmem) == (255, 24, 8, 4, 16)
    assert b.problems() == ["8 bytes spill stores", "4 bytes spill loads",
                            "24 bytes stack frame", "16 bytes lmem"]


# ------------------------------------------------------------------- the command
def _tools_or_skip():
    try:
        kr.find_nvrtc()
        kr.find_ptxas()
    except kr.KernelToolMissing as exc:
        if os.environ.get("GPUKV_TEST_NVRTC", "") == "1":
            pytest.fail(f"GPUKV_TEST_NVRTC=1 but {exc}", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def report():
    """`gpukv info --kernels --json`, run once in a child process (no GPU, emulated or real)."""
    _tools_or_skip()
    env = gpu_env.subprocess_env(gpus=False)
    done = subprocess.run([sys.executable, "-m", "gpukv", "info", "--kernels", "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_info_kernels_covers_every_kernel_on_three_architectures(report):
    """Every kernel case is reported on sm_80, sm_90 and sm_100, with registers, occupancy
    and bytes per element, and none uses local memory."""
    labels = {c.label for c in kr.kernel_cases()}
    assert {(r["kernel"], r["arch"]) for r in report} == {
        (label, arch) for label in labels for arch in ("sm_80", "sm_90", "sm_100")}
    for r in report:
        assert 0 < r["registers"] <= 255 and r["threads"] == 256, r
        assert 0 < r["occupancy"] <= 1 and r["blocks_per_sm"] >= 1, r
        assert r["bytes_read"] + r["bytes_written"] > 0, r
        assert r["spills"] == [], r
    lamb = {r["arch"]: r for r in report if r["kernel"] == "lamb step phase 1"}
    assert all(r["smem"] == 2 * 256 * 8 for r in lamb.values())  # two double per thread


def test_info_kernels_prints_a_table(capsys):
    """Without --json the report is a table with a header and a note on the estimate."""
    _tools_or_skip()
    cases = [c for c in kr.kernel_cases() if c.label == "sgd step"]
    rows = kr.report_rows(kr.measure(cases))
    text = kr.render(rows)
    assert text.splitlines()[0].split()[:3] == ["kernel", "arch", "regs"]
    assert sum(line.startswith("sgd step") for line in text.splitlines()) == 3
    assert "memory-bound" in text and "Little's" in text


@pytest.mark.parametrize("missing", ["nvrtc", "ptxas"])
def test_info_kernels_says_what_is_missing_in_one_line(missing, monkeypatch, capsys):
    """Without NVRTC or ptxas, `info --kernels` prints one line naming the missing tool
    and how to install it, and exits with status 2."""
    if missing == "nvrtc":
        monkeypatch.setenv("GPUKV_NVRTC_LIB", "/nonexistent/libnvrtc.so.12")
        monkeypatch.setattr(kr.nvrtc, "load", kr.nvrtc.load.__wrapped__)
    else:
        monkeypatch.setenv("GPUKV_PTXAS", "/nonexistent/ptxas")
    assert _info.main(["--kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("gpukv info: error: --kernels needs NVRTC and ptxas: ")
    assert ("GPUKV_NVRTC_LIB" if missing == "nvrtc" else "GPUKV_PTXAS") in err


def test_info_kernels_refuses_simulate(capsys):
    """--kernels with --simulate is a usage error (status 2)."""
    with pytest.raises(SystemExit) as exc:
        _info.main(["--kernels", "--simulate", "dgx1"])
    assert exc.value.code == 2
    assert "--kernels" in capsys.readouterr().err


# ------------------------------------------------------------- CUDA 13 wheel layout
@pytest.mark.parametrize("layout", ["cuda_nvrtc", "cu13"])
def test_the_tools_are_found_in_cuda_12_and_cuda_13_wheels(layout, tmp_path, monkeypatch):
    """NVRTC and ptxas are found where CUDA 12's wheels put them (cuda_nvrtc/lib,
    cuda_nvcc/bin) and where CUDA 13's do (cu13/lib, cu13/bin)."""
    import importlib.machinery
    import importlib.util

    from gpukv.tools import nvrtc
    lib = tmp_path / layout / "lib" / "libnvrtc.so.13"
    ptxas = tmp_path / ("cuda_nvcc" if layout == "cuda_nvrtc" else "cu13") / "bin" / "ptxas"
    for path in (lib, ptxas):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    ptxas.chmod(0o755)
    spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "nvidia" else real(name, *a))
    monkeypatch.delenv("GPUKV_NVRTC_LIB", raising=False)
    monkeypatch.delenv("GPUKV_PTXAS", raising=False)
    assert nvrtc._library_path() == str(lib)
    assert kr.find_ptxas() == str(ptxas)
