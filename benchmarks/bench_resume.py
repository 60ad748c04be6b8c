"""Time to resume after a host is lost, on hosts emulated on this machine.

    python benchmarks/bench_resume.py                     # 3 hosts, 1 Gb/s, 25.6M parameters
    python benchmarks/bench_resume.py --params 1M --timeout 5 --out -

A Trainer over a `dist_sync` store (one worker per host, num_servers=0) trains a model of
--params float32 parameters (ResNet-50's count by default: square Linear layers), with a
snapshot every --every steps, under `gpukv run --max-restarts 1 --min-workers N-1`. Once a
snapshot is complete and two more steps are done, the last host is powered off (its
processes killed, its link down). Measured from that moment: when the launcher's attempt
line says the job ended (the survivors' timeout, --timeout, plus its grace), when the
restarted job says it resumed, the reload the resume line reports (reading the snapshot,
sharing it, loading it), and when the first step after the resume is done; and the steps
lost. Needs root and `ip`/`tc`. Results go to resume_<machine>.json in --out DIR.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gpukv.tools import benchutil as U  # noqa: E402
from gpukv.tools import cluster as emulated  # noqa: E402

_RESUMED = re.compile(r"gpukv: resumed from \S+ \(step (\d+),.* in ([0-9.]+) s")
#: a worker's step line, as `gpukv run` shows it: after its rank, "[R] "
_STEP = re.compile(r"^(?:\[\d+\] )?step (\d+) of (\d+) workers")


# ------------------------------------------------------------------------ the worker
def worker(folder: str, steps: int, every: int, params: int) -> None:
    """Train under the launcher; print one line per step."""
    import torch
    from torch import nn

    import gpukv
    import gpukv.torch as gt
    kv = gpukv.create("dist_sync", num_servers=0)
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    trainer = gt.Trainer([model], "sgd", {"learning_rate": 1e-4, "momentum": 0.9},
                         kvstore=kv, checkpoint_dir=folder, checkpoint_every=every)
    x = torch.randn(8, width)
    for step in range(trainer.steps, steps):
        trainer.zero_grad()
        model(x).square().mean().backward()
        trainer.step(8 * kv.num_workers)
        print(f"step {step + 1} of {kv.num_workers} workers {time.time():.3f}", flush=True)
    trainer.finish_snapshots()


# ------------------------------------------------------------------------ the controller
class Lines:
    """A process's output lines, each with when it came."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        for stream in (process.stdout, process.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern, after: float = 0.0):
        for when, line in list(self.lines):
            match = re.search(pattern, line)
            if when >= after and match:
                return when, match
        return None


def _wait(lines: Lines, pattern, after: float, limit: float, process):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = lines.first(pattern, after)
        if found:
            return found
        if process.poll() is not None:
            break
        time.sleep(0.05)
    text = "\n".join(line for _, line in lines.lines[-40:])
    raise SystemExit(f"bench_resume: no line matching {pattern!r}:\n{text}")


def measure(args, folder: Path) -> dict:
    hosts = args.hosts
    with emulated.EmulatedCluster(hosts, args.rate) as made:
        env = made.env()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent),
                                                          env.get("PYTHONPATH")]))
        env["GPUKV_DIST_TIMEOUT"] = str(args.timeout)
        steps = 1000
        command = [sys.executable, "-m", "gpukv", "run", "-n", str(hosts), "--hosts",
                   ",".join(made.addresses), "--ppn", "1", "--max-restarts", "1",
                   "--min-workers", str(hosts - 1), str(Path(__file__).resolve()),
                   "--worker", str(folder), str(steps), str(args.every), str(args.params)]
        job = made.popen(0, command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        lines = Lines(job)
        try:
            _wait(lines, rf"^(?:\[\d+\] )?step {args.every + 2} of", 0, 600, job)
            before = [int(m[1]) for _, line in list(lines.lines)
                      if (m := _STEP.match(line))]
            made.power_off(hosts - 1)
            struck = time.monotonic()
            last = max(int(m[1]) for _, line in list(lines.lines) if (m := _STEP.match(line)))
            ended, _ = _wait(lines, r"gpukv run: attempt 0 .*ended", struck, 120, job)
            resumed, match = _wait(lines, _RESUMED.pattern, struck, 300, job)
            first, _ = _wait(lines, rf"^(?:\[\d+\] )?step \d+ of {hosts - 1} workers",
                             resumed, 300, job)
        finally:
            if job.poll() is None:  # (a job that ended by itself has no group left)
                os.killpg(job.pid, 9)
            job.wait()
    return {"hosts": hosts, "rate": args.rate, "params": args.params,
            "every": args.every, "timeout_s": args.timeout,
            "steps_before_fault": max(before), "last_step_seen": last,
            "resumed_step": int(match[1]), "steps_lost": last - int(match[1]),
            "fault_to_job_ended_s": ended - struck, "fault_to_resumed_s": resumed - struck,
            "reload_s": float(match[2]), "fault_to_first_step_s": first - struck,
            "goal_s": args.timeout + 10}


def _rate(text: str) -> str:
    """A link rate `tc` takes (argparse names the option in the error)."""
    try:
        emulated.rate_bits(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _hosts(text: str) -> int:
    """2 hosts or more: one is powered off, and a job of one goes on (see `gpukv.tools.cluster`
    for the most it makes)."""
    value = U.positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def _seconds(text: str) -> float:
    value = U.nonnegative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be above 0, got 0")
    return value


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        folder, steps, every, params = argv[1:5]
        worker(folder, int(steps), int(every), int(params))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=_hosts, default=3, metavar="N",
                   help="emulated hosts, one worker each; the last is powered off, and the "
                        "job goes on with the others (default 3)")
    p.add_argument("--rate", type=_rate, default="1gbit",
                   help="each host's link rate, e.g. 100mbit, 1gbit (default 1gbit)")
    p.add_argument("--params", type=U.parse_size, default=25_557_032,
                   help="parameters of the model (default ResNet-50's 25.6M)")
    p.add_argument("--every", type=U.positive_int, default=5, metavar="STEPS",
                   help="the Trainer's checkpoint_every (default 5)")
    p.add_argument("--timeout", type=_seconds, default=10.0,
                   help="GPUKV_DIST_TIMEOUT of the job, seconds > 0 (default 10)")
    U.add_out_option(p, "benchmarks/results/", "resume_<machine>.json")
    args = p.parse_args(argv)
    why = emulated.unavailable()
    if why:
        print(f"bench_resume: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="gpukv-resume-") as folder:
        result = measure(args, Path(folder))
    for name, value in result.items():
        print(f"{name:24} {value:.2f}" if isinstance(value, float) else f"{name:24} {value}")
    out = U.out_folder(args.out, HERE / "results")
    if out is not None:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = U.write_record(out / f"resume_{U.slug(U.cpu_model('cpu'))}.json",
                              {"benchmark": "resume", "cpu": U.cpu_model(""),
                               "versions": U.versions(), "result": result}, created)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
