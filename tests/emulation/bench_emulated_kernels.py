"""Costs of the CPU emulation of CUDA kernels: compiling gpukv's sources, and launching.

    python -m tests.emulation.bench_emulated_kernels             # launches (warm cache)
    python -m tests.emulation.bench_emulated_kernels --compile   # + every source, cold cache

--compile builds every source of tests/test_cuda_compile.py's VARIANTS in a fresh cache
folder, one at a time and then with one worker per CPU. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def _median_time(fn, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_compile(kernels, variants) -> None:
    start = time.perf_counter()
    kernels._load_runtime()
    middle = time.perf_counter()
    kernels._precompiled_header()
    print(f"once per cache: launcher library {middle - start:.2f} s, precompiled header "
          f"{time.perf_counter() - middle:.2f} s")

    def build(variant):
        begin = time.perf_counter()
        kernels.RawModule(code=variant.source, options=variant.options).compile()
        return time.perf_counter() - begin

    items = list(variants.values())
    half = len(items) // 2
    serial = [build(v) for v in items[:half]]
    print(f"{len(serial)} sources one at a time: mean {statistics.mean(serial) * 1e3:.0f} ms, "
          f"max {max(serial) * 1e3:.0f} ms")
    workers = os.cpu_count() or 1
    begin = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(build, items[half:]))
    wall = time.perf_counter() - begin
    print(f"{len(items) - half} sources on {workers} workers: {wall:.1f} s "
          f"({wall / (len(items) - half) * 1e3:.0f} ms each)")
    kernels._modules.clear()  # forget the loaded ones: what a new process finds on disk
    begin = time.perf_counter()
    for v in items:
        kernels.RawModule(code=v.source, options=v.options).compile()
    print(f"all {len(items)} from the disk cache: {time.perf_counter() - begin:.2f} s")


def bench_launches(kernels, device, iters: int) -> None:
    import numpy as np

    from gpukv import optim
    from gpukv.device.cuda import kernels as _kernels
    from gpukv.device.cuda import optim_kernels as _optim_kernels

    n = 1 << 20
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        xs = [rng.standard_normal(n).astype(dtype) for _ in range(3)]
        out = np.zeros(n, dtype)
        name, source = _kernels.sum_source(dtype, dtype)
        kernel = kernels.RawKernel(source, name, options=_kernels.COMPILE_OPTIONS)
        table, blocks = _kernels.build_table([out.ctypes.data], [n],
                                             [[x.ctypes.data for x in xs]], [[]])
        args = (device(table), np.int32(1))
        t = _median_time(lambda: kernel((blocks,), (_kernels.THREADS,), args), iters)
        print(f"sum kernel, 2**20 {np.dtype(dtype).name} x 3 sources ({blocks} blocks of "
              f"{_kernels.THREADS}): {t * 1e3:.2f} ms, {t / (blocks * _kernels.THREADS) * 1e9:.1f} "
              f"ns per thread")

    empty = kernels.RawKernel('extern "C" __global__ void empty(int* x) {}', "empty")
    sync = kernels.RawKernel('extern "C" __global__ void sync(int* x) { __syncthreads(); }',
                             "sync")
    z = device(np.zeros(1, np.int32))
    t = _median_time(lambda: empty((1,), (1,), (z,)), 50 * iters)
    print(f"empty kernel, one thread: {t * 1e6:.1f} us per launch")
    for kernel, what in ((empty, "plain calls"), (sync, "fibers, one __syncthreads")):
        t = _median_time(lambda: kernel((1024,), (1024,), (z,)), max(3, iters // 3))
        print(f"1024 x 1024 threads, {what}: {t * 1e3:.1f} ms, {t / 2 ** 20 * 1e9:.1f} ns per "
              f"thread")

    opt = optim.LAMB(learning_rate=0.01)
    for total in (4 * _optim_kernels.CHUNK, 128 * _optim_kernels.CHUNK):
        w, g = (device(rng.standard_normal(total).astype(np.float32)) for _ in range(2))
        states = [device(np.zeros(total, np.float32)) for _ in range(2)]
        tables = _optim_kernels.plan([(w, g, None, states, opt.next_scalars(0))])
        ptrs, sizes, chunk_start, toff, chunk_tensor, scal = tables
        args = (device(ptrs), device(sizes), device(chunk_start), device(toff),
                device(chunk_tensor), device(scal),
                device(_optim_kernels.hyper_vector(opt, opt.hyper())),
                device(np.zeros(2)), device(np.zeros(total, np.float32)))
        grid = (len(chunk_tensor),)
        times = []
        for phase in (1, 2):
            kernel = kernels.RawKernel(_optim_kernels.kernel_source(opt, np.float32, phase),
                                       "gpukv_optim_step", options=("--fmad=false",))
            times.append(_median_time(lambda: kernel(grid, (_optim_kernels.BLOCK,), args),
                                      iters))
        print(f"LAMB float32, {total} elements ({grid[0]} blocks of {_optim_kernels.BLOCK}): "
              f"phase 1 {times[0] * 1e3:.2f} ms, phase 2 {times[1] * 1e3:.2f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true",
                        help="also compile every gpukv source into a fresh cache folder")
    parser.add_argument("--iters", type=int, default=10, help="timed launches per case")
    args = parser.parse_args(argv)
    if args.compile:  # before the emulation is imported: it reads the folder once
        os.environ["CUDAEMU_CACHE_DIR"] = tempfile.mkdtemp(prefix="cudaemu-bench-")
    from tests.device.cuda.test_cuda_compile import VARIANTS

    from .support import device, kernels
    print(f"cache: {kernels.CACHE_DIR}")
    if args.compile:
        bench_compile(kernels, VARIANTS)
    bench_launches(kernels, device, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
