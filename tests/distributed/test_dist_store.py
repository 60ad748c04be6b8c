"""The dist stores across real MPI processes (tests/distributed/programs/scenarios.py under
`mpiexec`): MXNet's dist_sync expectations, async mode, every call, both server
placements, dist_device_sync on (emulated) GPUs, compression on the wire, checkpoints,
and failures that end in bounded time with typed errors on every rank."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.distributed.mpi.chunks import CHUNK_BYTES

from .. import gpu_env
from ..bfloat16 import needs_bfloat16
from ..gpu_gate import physical_gpus
from .mpirun import ok, require_mpi, run

pytestmark = pytest.mark.mpi

# (processes, dedicated servers): every rank serves, one server, two servers
PLACEMENTS = [(2, 0), (3, 0), (3, 1), (4, 2)]


def _scenario(n: int, servers: int, *args: str, store: str = "dist_sync", timeout: float = 30,
              gpus: bool = False, limit: float = 120,
              env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**gpu_env.subprocess_env(gpus=gpus), **(env or {})}
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT=str(timeout), STORE=store)
    return run("scenarios.py", n, *args, env=env, timeout=limit)


def _caught(out: str, error: str) -> list:
    """The messages of the `CAUGHT` lines for `error` (ranks print at once: lines may run
    into each other, so they are found by pattern, not by line)."""
    return re.findall(rf"CAUGHT {error} on worker \d+: (.*?)(?=CAUGHT|$)", out, re.M | re.S)


def _passes(result, workers: int) -> str:
    out = ok(result)
    for w in range(workers):
        assert f"PASS worker {w} of {workers}" in out, out
    return out


@pytest.mark.parametrize("n,servers", PLACEMENTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sync_sgd_follows_mxnet(n, servers, dtype):
    """After round i every worker pulls 1 - lr*n(n+1)/2*(i+1) (MXNet's dist_sync test),
    small and split keys, float32 and float16 (summed in float32)."""
    _passes(_scenario(n, servers, "sync_sgd", dtype), n - servers)


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_sync_without_updater_assigns_the_sum(n, servers):
    """No updater: a round assigns the sum over workers (and over each worker's devices)."""
    _passes(_scenario(n, servers, "sync_assign"), n - servers)


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1), (4, 2), (5, 2)])
def test_chunked_pushes_sum_in_worker_order(n, servers, monkeypatch):
    """Keys of many chunks (sizes no chunk divides, split or whole, float32 and float16)
    pull the bits of the sum in worker order, whatever order the pushes arrive in. (On
    one machine pieces move whole unless a chunk size is set, as here: the size a job
    across machines uses.)"""
    monkeypatch.setenv("GPUKV_DIST_CHUNK_BYTES", str(CHUNK_BYTES))
    _passes(_scenario(n, servers, "chunked_sums"), n - servers)


@pytest.mark.parametrize("n,servers", [(3, 1), (4, 2)])
def test_async_applies_every_push(n, servers):
    """dist_async: SGD applied once per push; after a barrier the value counts them all."""
    _passes(_scenario(n, servers, "async_sgd", store="dist_async"), n - servers)


def test_async_needs_an_optimizer():
    """dist_async refuses a push before set_optimizer, on every worker, naming the key."""
    out = _passes(_scenario(3, 1, "async_needs_optimizer", store="dist_async"), 2)
    lines = _caught(out, "ArgumentError")
    assert len(lines) == 2 and all("key 'w'" in ln and "set_optimizer" in ln
                                   for ln in lines), out


@pytest.mark.parametrize("n,servers", [(3, 0), (4, 1)])
def test_calls(n, servers):
    """pushpull, broadcast, str keys made in another order per worker, row_sparse_pull."""
    _passes(_scenario(n, servers, "calls"), n - servers)


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_pulls_into_tensors_keep_autograd_rules(n, servers):
    """A leaf tensor that requires grad is refused as an out outside torch.no_grad() on
    every worker, and a write into a tensor moves its version counter, as in one process."""
    pytest.importorskip("torch")
    _passes(_scenario(n, servers, "torch_outs"), n - servers)


@pytest.mark.gpu
@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_device_sync_on_gpus(n, servers):
    """dist_device_sync: each process sums on its GPUs, then across processes."""
    _passes(_scenario(n, servers, "device_sync", store="dist_device_sync", gpus=True),
            n - servers)


def test_dist_device_sync_says_once_that_host_arrays_are_reduced_on_the_host():
    out = _passes(_scenario(2, 0, "host_arrays_said_once", store="dist_device_sync"), 2)
    said = re.findall(r"NOTICE gpukv '(\w+)' store: only host arrays", out)
    assert said == ["dist_device_sync"] * 2, out


NCCL_SCENARIOS = [("sync_sgd", "float32"), ("sync_sgd", "float16"), ("sync_assign",),
                  ("calls",), ("changing_options",), ("updater_function",), ("lamb_split",)]


def _gpu_per_process(n: int) -> None:
    """NCCL's tests need a GPU of their own for each of the `n` processes."""
    physical_gpus(n, f"NCCL needs a GPU per process: {n} processes")


@pytest.mark.gpu
def test_processes_sharing_a_gpu_take_the_host_path():
    """Two processes on one GPU: NCCL refuses them, so the store crosses on the host (and
    nccl=True says why instead of NCCL's 'invalid usage')."""
    env = {"CUDAEMU_GPUS": "1"} if gpu_env.EMULATED else {}
    from gpukv.device.cuda.device import gpu_count
    if not gpu_env.EMULATED and gpu_count() != 1:
        pytest.skip("the test's processes share the one GPU of a machine or an emulation")
    result = _scenario(2, 0, "device_init", "0", store="dist_device_sync", gpus=True,
                       env=env)
    out = _passes(result, 2)
    assert "(NCCL)" not in out, out
    refused = _scenario(2, 0, "device_init", "1", store="dist_device_sync", gpus=True,
                        env=env)
    assert refused.returncode != 0
    assert "nccl=True: 2 processes of this machine would join NCCL on its GPU" in \
        refused.stdout + refused.stderr, refused.stdout + refused.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("scenario", NCCL_SCENARIOS, ids="-".join)
def test_nccl_rounds(n, scenario):
    """dist_device_sync with num_servers=0 on GPUs: every key on each process's GPU and
    the rounds through NCCL (bootstrapped over MPI), with the host path's results."""
    _gpu_per_process(n)
    out = _passes(_scenario(n, 0, *scenario, store="dist_device_sync", gpus=True), n)
    assert out.count("(NCCL)") == n, out


@pytest.mark.gpu
def test_nccl_checkpoint_loads_on_the_host_path(tmp_path):
    """A checkpoint a store on NCCL wrote loads into a host dist_sync store, exactly."""
    _gpu_per_process(3)
    path = str(tmp_path / "ckpt")
    out = _passes(_scenario(3, 0, "save", path, store="dist_device_sync", gpus=True), 3)
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="30", SAVED_WORKERS="3")
    again = _passes(run("scenarios.py", 1, "load", path, env=env), 1)
    assert set(_values(out).values()) == set(_values(again).values()), (out, again)


@pytest.mark.gpu
def test_nccl_refuses_compression_and_says_what_to_do():
    _gpu_per_process(2)
    result = _scenario(2, 0, "compression", "2bit", store="dist_device_sync", gpus=True)
    assert result.returncode != 0
    assert "create the dist_device_sync store with nccl=False" in result.stderr


@pytest.mark.parametrize("kind", ["2bit", "1bit", "fp16", "sign", "ternary"])
@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_compression_on_the_wire(n, servers, kind):
    """Compressed pushes equal a one-process store's with one source per worker."""
    _passes(_scenario(n, servers, "compression", kind, store="dist_device_sync"),
            n - servers)


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1), (4, 2)])
def test_powersgd_on_the_wire(n, servers):
    """PowerSGD's two allreduces among the workers give a one-process store's sums (one
    source per worker), without and with an updater, split keys included: with
    num_servers=0, and with servers, each taking the workers' shares of each sum."""
    _passes(_scenario(n, servers, "compression", "powersgd", store="dist_device_sync"),
            n - servers)


def test_powersgd_is_refused_by_dist_async():
    """dist_async refuses PowerSGD when it is set (its workers push apart, where the
    sums need them together), saying what to use."""
    result = _scenario(3, 1, "compression", "powersgd", store="dist_async")
    assert result.returncode != 0
    assert "use dist_sync" in result.stderr, result.stderr


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_updater_function_runs_where_keys_are_served(n, servers):
    out = _passes(_scenario(n, servers, "updater_function"), n - servers)
    assert len(_caught(out, "ArgumentError")) == (n - servers if servers else 0), out


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_a_load_of_dumped_options_reaches_every_workers_optimizer(n, servers, tmp_path):
    _passes(_scenario(n, servers, "dumped_options", str(tmp_path / "o.states")), n - servers)


@pytest.mark.parametrize("n,servers", [(3, 0), (4, 2)])  # one server splits nothing
def test_lamb_refuses_split_keys(n, servers, tmp_path):
    """At set_optimizer, and at every call that makes a key once LAMB is set."""
    out = _passes(_scenario(n, servers, "lamb_split", str(tmp_path / "w.npz")), n - servers)
    lines = _caught(out, "ArgumentError")
    assert len(lines) == n - servers, out
    assert all("key 'w': lamb needs each key whole" in ln for ln in lines), lines
    made = re.findall(r"MADE ArgumentError on worker \d+: (key 'w': lamb needs each key "
                      r"whole .*? split over (?:servers|processes))", out)
    assert len(made) == 3 * (n - servers), out  # init, broadcast, load


@pytest.mark.parametrize("optimizer,on_store", [("sgd", "1"), ("adam", "1"), ("sgd", "0")])
@pytest.mark.parametrize("n,servers", [(2, 0), (4, 2)])
def test_torch_trainer_on_a_dist_store(n, servers, optimizer, on_store):
    """gpukv.torch.Trainer over workers trains exactly as one process over all replicas."""
    pytest.importorskip("torch")
    _passes(_scenario(n, servers, "trainer", optimizer, on_store), n - servers)


@pytest.mark.parametrize("how,says", [
    ("width", r"at parameter '0.weight' \(the first of 3 that differ\): this worker \(rank "
              r"\d\) has it of shape \((16|32), 8\), float32"),
    ("depth", r"they have 4 to 6 trainable parameters \(this worker, rank \d: [46]\)")])
@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_a_trainer_over_models_that_differ_names_what_differs(n, servers, how, says):
    """Workers whose models differ in a layer's width or in depth: making the Trainer is a
    PeerMismatchError on every worker naming the first parameter that differs (its shape
    here), or how many each has, before any key is made."""
    pytest.importorskip("torch")
    result = _scenario(n, servers, "trainer_models_differ", how, timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers, result.stdout + result.stderr
    assert all(re.search(says, ln) for ln in lines), lines


@pytest.mark.parametrize("what", ["compression", "buckets"])
@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_trainer_arguments_one_worker_alone_refuses_fail_every_worker_at_once(
        n, servers, what):
    """Worker 1 alone refuses its Trainer's arguments: its own ArgumentError, and at once
    (well within the timeout) a PeerMismatchError naming the refusal on every other
    worker, rather than a wait for worker 1 in the Trainer's first collective call."""
    pytest.importorskip("torch")
    result = _scenario(n, servers, "trainer_arguments_refused", what, timeout=20, limit=90)
    out = result.stdout + result.stderr
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers - 1, out
    says = "unknown option 'bogus'" if what == "compression" else "bucket_bytes=-1"
    assert all("calls Trainer refused (ArgumentError): " in ln and says in ln
               for ln in lines), lines
    assert len(_caught(result.stdout, "ArgumentError")) == 1, out
    took = [float(s) for s in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == n - servers and max(took) < 10, out


def test_a_step_one_worker_alone_refuses_fails_every_worker_at_once():
    """Worker 1 alone steps with a batch size of 0 (num_servers=0, where pushes are
    collective): its own ArgumentError, and at once a PeerMismatchError carrying its
    words on every other worker, rather than a wait for it in their step's push."""
    pytest.importorskip("torch")
    result = _scenario(3, 0, "trainer_step_refused", timeout=20, limit=90)
    out = result.stdout + result.stderr
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == 2, out
    assert all("calls Trainer.step refused (ArgumentError): batch_size=0" in ln
               for ln in lines), lines
    took = [float(s) for s in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == 3 and max(took) < 10, out


@pytest.mark.parametrize("servers", [0, 1])
def test_an_exception_in_a_trainers_with_block_goes_on_as_raised(tmp_path, servers):
    """`with trainer:` left by an exception on worker 1 (the others in a step's push):
    worker 1 gets its own ValueError back, not a PeerMismatchError of a call its
    block's end made; the others a PeerError."""
    pytest.importorskip("torch")
    result = _scenario(2 + servers, servers, "trainer_raises_in_with", str(tmp_path),
                       timeout=10, limit=90)
    out = result.stdout + result.stderr
    assert [c.strip() for c in _caught(result.stdout, "ValueError")] == ["bad batch 2"], out
    others = _caught(result.stdout, "PeerError")
    assert len(others) == 1 and "finish_snapshots" not in others[0], out
    assert "PeerMismatchError" not in out, out


def test_a_sparse_table_goes_dense_to_a_dist_store_with_a_warning():
    """An nn.Embedding(sparse=True) trained on a dist store: warned of, pushed dense,
    and the weights of one process training every replica densely."""
    pytest.importorskip("torch")
    _passes(_scenario(2, 0, "trainer_sparse_table"), 2)


@pytest.mark.parametrize("n,servers,on_store", [(2, 0, "0"), (3, 1, "1")])
def test_torch_trainer_mean_losses_on_a_dist_store(n, servers, on_store):
    """DDP's convention on a dist store: mean losses and step() average over every
    worker's replicas, exactly as one process over all of them; num_replicas and
    replica_index count every worker's replicas."""
    pytest.importorskip("torch")
    _passes(_scenario(n, servers, "trainer", "sgd", on_store, "auto", "1mean"), n - servers)


# Every pair of a layout, a way of passing and where the update runs, in 8 of the 16 jobs
# (the CI's 2 cores start each job's 3 processes in about 4 s).
@pytest.mark.parametrize("n,servers,passes,on_store", [
    (3, 0, "1", "0"), (3, 0, "2", "1"), (3, 0, "2nosync", "0"), (3, 0, "1halve0", "1"),
    (3, 1, "1", "1"), (3, 1, "2", "0"), (3, 1, "2nosync", "1"), (3, 1, "1halve0", "0")])
def test_torch_trainer_overlap_on_a_dist_store(n, servers, passes, on_store):
    """Reductions started from backward (several buckets, every process in the same
    order), with gradient accumulation in and out of no_sync, and gradients changed after
    backward on one process only: the same weights as one process over all replicas."""
    pytest.importorskip("torch")
    _passes(_scenario(n, servers, "trainer", "sgd", on_store, "on", passes), n - servers)


@pytest.mark.parametrize("on_store", ["0", "1"])
def test_the_programs_own_calls_follow_the_reductions_backward_started(on_store):
    """With the overlap, a barrier, workers_max, an init and a pushpull the program makes
    between backward and step come after the reductions in flight on every worker: no
    PeerMismatchError, the same weights."""
    pytest.importorskip("torch")
    _passes(_scenario(2, 0, "trainer", "sgd", on_store, "on", "1calls"), 2)


def test_torch_trainer_with_uneven_replicas_needs_a_batch_size():
    """Workers with 1 and 2 replicas: num_replicas is refused on both, step(batch_size)
    trains."""
    pytest.importorskip("torch")
    _passes(_scenario(2, 0, "trainer_uneven"), 2)


@pytest.mark.parametrize("n,servers,on_store,overlap", [  # every pair of them
    (2, 0, "1", "off"), (2, 0, "0", "on"), (3, 1, "1", "on"), (3, 1, "0", "off")])
def test_torch_trainer_under_grad_scaler_on_a_dist_store(n, servers, on_store, overlap):
    """torch.amp.GradScaler's `scaler.step(trainer)`: an inf on one worker skips the step
    on every worker, and the weights are one process's over all replicas that skips it.
    On the store each worker's scale follows its own gradients (worker 1's backs off);
    with update_on_kvstore=False it follows the sums, the same on every worker."""
    pytest.importorskip("torch")
    out = _passes(_scenario(n, servers, "trainer_scaled", on_store, overlap), 2)
    scales = dict(re.findall(r"SCALE worker (\d) (\d+)", out))
    want = {"0": "1024", "1": "512"} if on_store == "1" else {"0": "512", "1": "512"}
    assert scales == want, out


@pytest.mark.parametrize("n,servers,on_store,overlap", [  # every pair of them
    (2, 0, "0", "off"), (2, 0, "1", "on"), (3, 1, "0", "on"), (3, 1, "1", "off")])
def test_torch_trainer_ignore_stale_grad_on_a_dist_store(n, servers, on_store, overlap):
    """A parameter without a gradient on one worker only, with ignore_stale_grad: every
    worker pushes the same keys, and trains as one process over all replicas."""
    pytest.importorskip("torch")
    _passes(_scenario(n, servers, "trainer_stale", on_store, overlap), n - servers)


@pytest.mark.parametrize("args", [(), ("--num-servers", "1"),
                                  ("--store", "dist_async", "--num-servers", "1")])
def test_example_trains_across_processes(args):
    """examples/dist_train.py, as the README launches it (4 processes)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "dist_train.py"
    env = gpu_env.subprocess_env(gpus=False)
    ok(run(example, 4, "--steps", "30", *args, env=env))


def test_the_torchrun_style_example_trains_resumes_and_exports(tmp_path):
    """examples/torch_dist_train.py as its docstring runs it: 2 workers under `gpukv run`
    train, a second run of 3 workers resumes from the snapshots at the epoch they
    reached (the third worker too), and `gpukv export` writes them."""
    pytest.importorskip("torch")
    require_mpi()
    example = Path(__file__).resolve().parents[2] / "examples" / "torch_dist_train.py"
    env = {**gpu_env.subprocess_env(gpus=False), "GPUKV_DIST_TIMEOUT": "60"}

    def launch(*args, n=2):
        done = subprocess.run([sys.executable, "-m", "gpukv", "run", "-n", str(n), str(example),
                               "--out", str(tmp_path / "run"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr
    first = launch()
    assert "workers hold the same weights: True; loss fell: True" in first, first
    second = launch("--epochs", "4", n=3)
    assert "resumed from" in second and "epoch 3:" in second and "epoch 2:" not in second
    export = subprocess.run([sys.executable, "-m", "gpukv", "export", str(tmp_path / "run" /
                             "checkpoints"), str(tmp_path / "model.safetensors")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert export.returncode == 0 and "4 tensors" in export.stdout, export.stderr


# ------------------------------------------------------------------------ checkpoints
def _values(out: str) -> dict:
    return dict(re.findall(r"VALUE worker (\d+) (\[[^]]*\])", out))


@pytest.mark.parametrize("saved,loaded", [((3, 0), (1, 0)), ((3, 1), (3, 2)),
                                          ((4, 2), (1, 0))])
def test_checkpoint_loads_onto_any_placement(tmp_path, saved, loaded):
    """A dist checkpoint (values and Adam's state gathered from every shard) loads onto
    another number of processes and servers, and training goes on exactly as it would
    have (the same values after the next round)."""
    path = str(tmp_path / "ckpt")
    out = _passes(_scenario(*saved, "save", path), saved[0] - saved[1])
    before = set(_values(out).values())
    assert len(before) == 1, out
    n, servers = loaded
    workers = n - servers
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="30",
               SAVED_WORKERS=str(saved[0] - saved[1]))
    assert workers == 1  # it pushes the saved workers' sum alone
    result = run("scenarios.py", n, "load", path, env=env)
    after = set(_values(_passes(result, workers)).values())
    assert after == before, (before, after)


def test_checkpoint_loads_into_a_local_store(tmp_path):
    """A dist checkpoint is the file a one-process store writes: 'local' loads it."""
    path = str(tmp_path / "ckpt")
    _passes(_scenario(3, 0, "save", path), 3)
    code = (
        "import numpy as np, gpukv\n"
        "kv = gpukv.create('local')\n"
        "kv.set_optimizer(gpukv.optim.create('adam', learning_rate=0.1))\n"
        f"kv.load({path + '.store'!r})\n"
        "kv.load_optimizer_states(" + repr(path + ".states") + ")\n"
        "print(sorted(kv.keys()))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=gpu_env.subprocess_env(gpus=False))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['a', 'b']"


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_states_of_another_optimizer_name_the_file_on_every_worker(n, servers, tmp_path):
    path = str(tmp_path / "ckpt")
    out = _passes(_scenario(n, servers, "load_states_of_another_optimizer", path), n - servers)
    lines = _caught(out, "CheckpointError")
    assert len(lines) == n - servers, out
    assert all(f"{path}.adam: holds the state of optimizer 'adam'" in ln for ln in lines), out


def test_bad_checkpoint_fails_on_every_worker_and_changes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    _passes(_scenario(2, 0, "save", path), 2)
    out = _passes(_scenario(3, 1, "load_bad", path), 2)
    lines = _caught(out, "CheckpointError")
    assert len(lines) == 2 and all("key 'a'" in ln for ln in lines), out


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("n,servers,rounds_first", [(3, 0, "0"), (3, 1, "0"), (3, 0, "5")])
def test_stalled_worker_is_named_on_every_rank(n, servers, rounds_first):
    """A worker that stops answering: the others raise PeerError naming it within a few
    timeouts, and the job ends (non-zero) instead of hanging. After five rounds the
    others wait in a sum that carries its agreement: the same."""
    start = time.monotonic()
    result = _scenario(n, servers, "stall", "1", "", rounds_first, timeout=3, limit=90)
    took = time.monotonic() - start
    assert result.returncode != 0
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == n - servers - 1, result.stdout + result.stderr
    assert all(re.search(r"(rank|worker)\(s\) 1 did not", ln) for ln in lines), lines
    assert took < 60, took


def test_a_stalled_rank_0_is_named_by_the_others():
    """Rank 0 names the ranks that did not arrive; when rank 0 itself stops answering,
    the others name it after waiting longer than it would have."""
    result = _scenario(3, 0, "stall", "0", "", "5", timeout=3, limit=90)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("rank 0 did not arrive, or cannot be reached" in ln for ln in lines), lines


@pytest.mark.parametrize("servers", [0, 1])
def test_a_process_stalled_in_create_is_named_on_every_rank(servers):
    """A process that does not come to create's GPU check (slow to find its GPU): the
    others raise PeerError from create naming it, instead of waiting for it."""
    start = time.monotonic()
    result = _scenario(3, servers, "stall_at_create", "1", timeout=3, limit=90)
    took = time.monotonic() - start
    lines = _caught(result.stdout, "PeerError")
    others = [ln for ln in lines if "rank(s) 1 did not arrive" in ln]
    assert len(others) == 2, result.stdout + result.stderr
    assert all("the GPUs of each machine's processes" in ln for ln in others), others
    assert took < 60, took


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_stalled_worker_is_named_with_the_call_the_others_are_in(n, servers):
    """Keys made before the call the others wait in are agreed on first: the PeerError
    names that call (a push), not the init that came before it."""
    result = _scenario(n, servers, "stall", "1", "v", timeout=3, limit=90)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == n - servers - 1, result.stdout + result.stderr
    assert all(ln.startswith("push of key 'w'") and "did not" in ln for ln in lines), lines


@pytest.mark.parametrize("servers", [0, 1])
def test_an_uncaught_error_ends_the_job_at_once(servers):
    """Under a bare `mpiexec -n N python prog.py` (no `-m mpi4py`), a worker that dies of
    an uncaught ShapeError prints it and aborts the job: the others do not wait out their
    timeout for it."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="20")
    start = time.monotonic()
    result = run("scenarios.py", 2 + servers, "uncaught_error", "1", env=env, timeout=90,
                 bare=True)
    took = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "PASS" not in result.stdout, out
    assert "ShapeError: key 'w': push expects shape (4,), got (5,)" in result.stderr, out
    assert "aborting the MPI job: an uncaught ShapeError ended this process" in out, out
    assert took < 10, (took, out)


@pytest.mark.parametrize("n,servers,at", [(3, 0, "1"), (3, 1, "1"), (3, 0, "5")])
def test_killed_worker_ends_the_job(n, servers, at):
    """A worker killed mid-training ends the whole job with a non-zero status and
    mpiexec's message naming the dead rank, in bounded time (mpiexec aborts the job);
    at step 5 the others wait in a sum that carries its agreement."""
    result = _scenario(n, servers, "kill", "1", at, timeout=5, limit=90)
    assert result.returncode != 0, result.stdout
    assert "PASS" not in result.stdout
    assert "BAD TERMINATION" in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("n,servers", [(3, 1), (4, 2)])
def test_worker_stopped_mid_push_is_named(n, servers, monkeypatch):
    """A worker stopped while its chunks are on the wire: every other worker raises a
    PeerError naming it within twice the timeout, and the job ends."""
    monkeypatch.setenv("GPUKV_DIST_CHUNK_BYTES", str(CHUNK_BYTES))
    result = _scenario(n, servers, "stop_mid_push", "1", timeout=3, limit=90)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) >= n - servers - 1, result.stdout + result.stderr
    assert any(re.search(r"worker\(s\) 1 did not", ln) for ln in lines), lines
    waited = [float(w) for w in re.findall(r"WAITED ([\d.]+) on worker [02-9]", result.stdout)]
    assert len(waited) == n - servers - 1 and max(waited) < 6, result.stdout


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_shape_mismatch_names_key_and_workers(n, servers):
    result = _scenario(n, servers, "shape_mismatch", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers, result.stdout + result.stderr
    assert all("key 'w'" in ln and "(4,)" in ln and "(5,)" in ln for ln in lines), lines


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_optimizers_that_differ_are_refused(n, servers):
    result = _scenario(n, servers, "optimizer_mismatch", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers, result.stdout + result.stderr
    # each worker's options in words, and which worker each rank is
    assert all("set_optimizer(sgd(" in ln and "learning_rate=0.1," in ln
               and "learning_rate=0.2," in ln for ln in lines), lines
    assert all(("(worker W is rank 1+W of the job)" in ln) == (servers == 1)
               for ln in lines), lines


def test_optimizer_options_that_differ_at_a_push_are_named():
    """num_servers=0 (each worker runs its own optimizer on its shard): a push whose
    rescale_grad differs between workers is a PeerMismatchError saying each one's."""
    result = _scenario(2, 0, "options_differ_at_push", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("rank(s) 0 calls push updating with sgd(" in ln and "rescale_grad=0.125" in ln
               and "rank(s) 1 calls" in ln and "rescale_grad=1.0" in ln for ln in lines), lines


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_compressions_that_differ_are_refused(n, servers):
    """Workers that set other compressions each get a PeerMismatchError naming both."""
    result = _scenario(n, servers, "compression_mismatch", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers, result.stdout + result.stderr
    assert all("'sign'" in ln and "'ternary'" in ln for ln in lines), lines


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_a_push_refused_by_one_worker_alone_fails_on_every_worker(n, servers):
    """Refused alike everywhere, a push changes nothing, even where each worker's error
    says it in words of its own; refused by worker 1 alone (num_servers=0), worker 1
    raises its ShapeError and every other worker a PeerMismatchError naming the refusal
    and what worker 1's error says, at once."""
    result = _scenario(n, servers, "refusals")
    if servers:
        out = _passes(result, n - servers)
    else:  # the store failed on every worker: the job ends non-zero
        out = result.stdout + result.stderr
        assert result.returncode != 0 and all(
            f"PASS worker {w} of {n}" in result.stdout for w in range(n)), out
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == (0 if servers else n - 1), out
    assert all("rank(s) 1 calls push refused (ShapeError): key 1: push expects shape (3,), "
               "got (4,)" in ln for ln in lines), lines
    assert len(_caught(result.stdout, "ShapeError")) == (0 if servers else 1), out


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_a_setting_refused_by_one_worker_alone_fails_on_every_worker_at_once(n, servers):
    """Settings refused alike change nothing and the store goes on; compression options
    worker 1 alone refuses are its own ArgumentError and a PeerMismatchError naming the
    refusal on every other worker, well within their timeout (not a PeerError after it)."""
    result = _scenario(n, servers, "settings_refusals", timeout=20, limit=90)
    out = result.stdout + result.stderr
    assert all(f"PASS worker {w} of {n - servers}" in out for w in range(n - servers)), out
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers - 1, out
    assert all("rank(s) " in ln and "calls set_gradient_compression refused (ArgumentError)"
               in ln and "unknown option 'x'" in ln for ln in lines), lines
    assert len(_caught(result.stdout, "ArgumentError")) == 1, out
    took = [float(s) for s in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == n - servers and max(took) < 10, out


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_an_optimizer_another_store_of_the_process_runs_is_refused(n, servers):
    """A store of a worker given the optimizer another store of that process runs (a
    'local' one, or a second dist store, on every worker) is an ArgumentError, and a
    copy counts apart; worker 1 alone refusing it is agreed on as set_optimizer's other
    refusals are: a PeerMismatchError naming the refusal on the others, at once."""
    result = _scenario(n, servers, "shared_optimizer", timeout=20, limit=90)
    out = result.stdout + result.stderr  # (a store a refusal ended aborts the job at exit)
    assert all(f"PASS worker {w} of {n - servers}" in out for w in range(n - servers)), out
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == n - servers - 1, out
    assert all("calls set_optimizer refused (ArgumentError)" in ln
               and "runs this optimizer object already" in ln for ln in lines), lines
    assert len(_caught(result.stdout, "ArgumentError")) == 1, out
    took = [float(s) for s in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == n - servers and max(took) < 10, out


#: what worker 1 alone refuses (refused_on_one), and the words of its refusal the others'
#: PeerMismatchError says (None: the others' calls go on)
REFUSED_ON_ONE = {
    "init": ("ShapeError", "rank(s) 1 calls init refused (ShapeError): key 5: init values "
                           "disagree in shape: (3,) and (4,)"),
    "broadcast": ("ReadOnlyError", "rank(s) 1 calls broadcast refused (ReadOnlyError): "
                                   "key 6: out array is read-only"),
    "pull": ("ShapeError", None),
}


@pytest.mark.parametrize("n,servers,call", [(3, 0, "init"), (3, 0, "broadcast"),
                                            (3, 0, "pull"), (3, 1, "pull")])
def test_init_broadcast_and_pull_refused_by_one_worker_alone(n, servers, call):
    """Refused alike everywhere, an init, a broadcast or a pull (with keys made just
    before it or not) changes nothing and the store goes on. Refused by worker 1 alone
    with num_servers=0, an init or a broadcast is worker 1's own error and a
    PeerMismatchError naming the refusal, in worker 1's words, on every other worker
    (for an init, at the next collective call, where the others agree on its keys), well
    within the timeout rather than after it; a pull refused by worker 1 alone (right
    after an init, whose agreement it takes part in) is its own error there, and every
    other worker's pull and the store go on."""
    workers = n - servers
    error, says = REFUSED_ON_ONE[call]
    result = _scenario(n, servers, "refused_on_one", call, timeout=20, limit=90)
    out = result.stdout + result.stderr
    assert all(f"PASS worker {w} of {workers}" in out for w in range(workers)), out
    assert len(_caught(result.stdout, error)) == 1, out
    assert "uncaught" not in out, out
    took = [float(t) for t in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == (1 if says is None else workers) and max(took) < 10, out
    lines = _caught(result.stdout, "PeerMismatchError")
    if says is None:
        assert result.returncode == 0 and not lines, out
        return
    expected = workers if call == "init" else workers - 1  # (worker 1's next call too)
    assert len(lines) == expected and all(says in ln for ln in lines), out


@pytest.mark.parametrize("servers", [0, 1])
@pytest.mark.parametrize("call", ["save", "load", "save_optimizer_states",
                                  "load_optimizer_states"])
def test_checkpoint_paths_that_differ_are_refused_on_every_worker(tmp_path, servers, call):
    """Every worker gives a checkpoint call the same path (worker 0 alone writes or reads
    it): workers that give different ones (a file each, or one that names no file) get a
    PeerMismatchError naming the call and each worker's path, well within the timeout,
    before anything is written or read."""
    workers = 3 - servers
    path = str(tmp_path / "c")
    result = _scenario(3, servers, "checkpoint_paths_differ", call, path, timeout=20,
                       limit=90)
    out = result.stdout + result.stderr
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == workers, out
    ending = ".states" if "optimizer" in call else ".store"
    first = f"{path}.{call}.worker0{ending}" if call.startswith("save") else path + ending
    other = f"{path}.{call}.worker1{ending}" if call.startswith("save") \
        else f"{path}.worker1{ending}"
    assert all(ln.startswith(f"{call} of ") and "processes disagree" in ln
               and f"calls {call} of {first!r}" in ln and f"calls {call} of {other!r}" in ln
               for ln in lines), lines
    took = [float(t) for t in re.findall(r"REFUSED on worker \d+ after ([\d.]+) s", out)]
    assert len(took) == workers and max(took) < 10, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.states", "c.store"], out


def test_with_servers_an_init_one_worker_never_made_is_named():
    """The servers name the key whose init worker 1 never made, on every worker, rather
    than the push that waits behind worker 0's init of it."""
    result = _scenario(3, 1, "init_missing", timeout=2, limit=60)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("init of key 3: worker(s) 1 did not init it" in ln for ln in lines), lines
    # (gpukv run's lines number the job's ranks, the servers first)
    assert all("(worker W is rank 1+W of the job)" in ln for ln in lines), lines


def test_an_updater_error_on_a_keys_owner_reaches_every_process_at_once():
    """num_servers=0: the owner of the key raises the updater's ValueError, the others a
    PeerError carrying it, well within their 20 s timeout."""
    result = _scenario(3, 0, "updater_raises", timeout=20, limit=90)
    raised = re.findall(r"RAISED (\w+) on worker \d after ([\d.]+) s", result.stdout)
    assert sorted(kind for kind, _ in raised) == ["PeerError", "PeerError", "ValueError"], (
        result.stdout + result.stderr)
    assert all(float(took) < 10 for _, took in raised), raised


def test_an_updater_that_calls_the_store_is_refused_on_every_process():
    """num_servers=0: a push from inside the updater is an ArgumentError on the key's
    owner and a PeerError carrying it on the others (before, the two pushes' messages
    crossed: garbage values on one process, a timeout on the other)."""
    result = _scenario(2, 0, "updater_calls_the_store", timeout=20, limit=90)
    raised = re.findall(r"RAISED (\w+) on worker \d", result.stdout)
    assert sorted(raised) == ["ArgumentError", "PeerError"], result.stdout + result.stderr


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1), (4, 2)])
def test_optimizer_changes_reach_the_shards(n, servers):
    """set_learning_rate, rescale_grad and lr_mult changed between pushes count; momentum
    turned on after the first push is an ArgumentError on every worker, changing nothing."""
    _passes(_scenario(n, servers, "changing_options"), n - servers)


@pytest.mark.parametrize("n,servers,kinds", [(2, 0, "int,str"), (4, 2, "str")])
def test_keys_pushed_unequally_take_one_processs_rates(n, servers, kinds, tmp_path):
    """Under a schedule, keys served by different processes or servers, one pushed at
    every step and one at two steps only, take the rates one process gives them (its
    bits and update counts, str keys counted in the order they were made); a save and
    load mid-way redo the last steps to the same bits, here and in a 'local' store; and
    update_counts='restart' starts every count over as one process's load does."""
    _passes(_scenario(n, servers, "unequal_pushes", str(tmp_path / "c"), kinds),
            n - servers)


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_a_loaded_16_bit_value_is_what_the_next_step_starts_from(n, servers, tmp_path):
    """The shards' float32 master copies follow a loaded value: the step after a load
    starts from it, not from the master copy of before."""
    path = tmp_path / "values.npz"
    source = gpukv.create("local")
    source.init("w", np.full(32, 100, np.float16))
    source.save(path)
    _passes(_scenario(n, servers, "load_16_bit", str(path)), n - servers)


@pytest.mark.parametrize("n,servers,seeds", [(3, 0, "own"), (3, 1, "same"), (3, 1, "own")])
def test_frozen_parameters_and_buffers_start_as_worker_0s(n, servers, seeds):
    """Frozen parameters (float32 and bfloat16) and buffers start as worker 0's replica
    0's on every replica of every worker, as trainable ones do: workers made alike agree
    at once (nothing said); workers seeded apart get worker 0's, one warning each."""
    pytest.importorskip("torch")
    result = _scenario(n, servers, "trainer_frozen", seeds)
    out = ok(result)
    found = re.findall(r"FROZEN worker (\d) (\w+) (\w+) worker0 (\w+) warned (\d)", out)
    assert len(found) == n - servers, out
    for _, first, second, worker0, warned in found:
        assert first == second == worker0, out
        assert warned == ("0" if seeds == "same" else "1"), out


def test_a_rank_that_ended_is_named_as_ended():
    """A rank whose program ended (its exit's word is there) is named as ended without
    making the call, not as one that did not arrive in time."""
    result = _scenario(3, 0, "ends_early", "1", timeout=3, limit=60)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("rank(s) 1 ended (reached the program's end or sys.exit) without making "
               "this call; rank(s) 0, 2 did" in ln for ln in lines), lines


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_a_normal_exit_leaves_keep_snapshots(tmp_path, n, servers):
    """Snapshots still being written when the program ends (no finish_snapshots): every
    process's writes end, and worker 0 prunes once the newest is complete, leaving the
    `keep` newest, as finish_snapshots would (it used to leave one more)."""
    from gpukv.checkpoints import snapshots
    _passes(_scenario(n, servers, "snapshots_left_at_exit", str(tmp_path), timeout=10),
            n - servers)
    assert [s.step for s in snapshots.complete_snapshots(tmp_path)] == [2, 3]
    assert len(list(tmp_path.iterdir())) == 2


def test_dropped_stores_give_their_communicators_back():
    """More stores than MPI has communicators (2048 in MPICH) made, used and dropped one
    after another beside a store kept throughout, which still sums right after them."""
    out = _passes(_scenario(2, 0, "stores_made_and_dropped", "2100", timeout=10), 2)
    assert re.findall(r"KEPT worker \d (\d+)", out) == ["2", "2"], out


def test_a_forked_child_leaves_the_job_alone_at_its_end():
    """A child forked from a worker (a data loader's) runs the exit handlers: they neither
    wait for the job's other processes nor for the parent's snapshot writes (which
    would never end in the child), and the parent's store goes on."""
    out = _passes(_scenario(2, 0, "a_forked_child_ends", timeout=10), 2)
    code, seconds = re.search(r"CHILD ended (-?\d+) after ([\d.]+) s", out).groups()
    assert code == "0" and float(seconds) < 5, out
    assert re.findall(r"SUM worker \d (\d+)", out) == ["2", "2"], out


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_python_runs_while_a_push_waits_for_a_peer(n, servers):
    """A push waiting on a late peer leaves the GIL to the process's other threads: a
    thread's Python loop keeps most of its speed meanwhile (about all of it on a quiet
    machine; a wait holding the GIL would leave it near 0)."""
    out = _passes(_scenario(n, servers, "python_runs_while_waiting", timeout=20), n - servers)
    rate, waited = re.search(r"RATE ([\d.]+) waited (True|False)", out).groups()
    assert waited == "True", out  # the loop ran while the push waited
    assert float(rate) > 0.5, out


def test_small_sums_carry_their_agreement_and_a_call_of_ones_own_is_still_named():
    """Loops of small pushpulls sum right with their agreement inside the sum (most
    rounds one allreduce: counted in the program), through changes of key, packing,
    a barrier and a new key; a worker making a key alone before a foretold round is a
    PeerMismatchError naming both calls on every worker, not mixed data or a hang."""
    result = _scenario(3, 0, "fused_rounds", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == 3, result.stdout + result.stderr
    assert all("rank(s) 0 calls init of key 'z'" in ln
               and "rank(s) 1, 2 calls push assigning the sum of key 'a'" in ln
               for ln in lines), lines


def test_different_keys_in_one_round_are_refused():
    result = _scenario(2, 0, "key_mismatch", timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("key 'a'" in ln and "key 'b'" in ln for ln in lines), lines
    again = re.findall(r"AGAIN Peer\w*Error on worker \d after ([\d.]+) s", result.stdout)
    assert len(again) == 2 and max(map(float, again)) < 1, result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("nccl", ["0", "1"])
def test_device_store_pull_after_init_gives_rank0s_value(nccl):
    if nccl == "1":
        _gpu_per_process(3)
    _passes(_scenario(3, 0, "device_init", nccl, store="dist_device_sync", gpus=True), 3)


@pytest.mark.parametrize("setting,other", [("bigarray_bound", "1000"), ("timeout", "1000"),
                                           ("GPUKV_DIST_CHUNK_BYTES", "unset")])
def test_create_with_other_settings_is_refused(setting, other):
    result = _scenario(2, 0, "settings_differ", setting, timeout=10)
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == 2 and all("create" in ln and setting in ln and "8" in ln
                                   and other in ln for ln in lines), \
        result.stdout + result.stderr


@pytest.mark.parametrize("n,servers,name,value", [
    (2, 0, "GPUKV_BIGARRAY_BOUND", "-1"), (3, 1, "GPUKV_BIGARRAY_BOUND", "-1"),
    (2, 0, "GPUKV_HOST_JIT", "x"), (2, 0, "GPUKV_HOST_THREADS", "0")])
def test_a_setting_one_process_refuses_is_heard_by_the_others_at_once(n, servers, name,
                                                                      value):
    """A malformed GPUKV_* setting in one process's environment (a dist store's own, or
    one every store reads): that process raises its ArgumentError, and every other one a
    PeerMismatchError naming it, at once rather than after the timeout (20 s here)."""
    result = _scenario(n, servers, "setting_refused_on_one", "1", name, value, timeout=20,
                       limit=60)
    out = result.stdout
    own = _caught(out, "ArgumentError")
    assert len(own) == 1 and f"{name}={value!r}" in own[0], out + result.stderr
    others = _caught(out, "PeerMismatchError")
    assert len(others) == n - 1, out + result.stderr
    assert all("rank(s) 1 has refused=" in ln and name in ln for ln in others), others
    took = [float(t) for t in re.findall(r"TOOK ([\d.]+) s", out)]
    assert len(took) == n and max(took) < 10, out


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_an_option_given_wins_over_a_malformed_setting_on_every_process(n, servers):
    result = _scenario(n, servers, "option_wins_over_a_malformed_setting", "1",
                       timeout=20, limit=60)
    assert result.stdout.count("PASS worker") == n - servers and \
        result.stdout.count("True") == n - servers, result.stdout + result.stderr


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_a_process_that_never_creates_is_named(n, servers):
    result = _scenario(n, servers, "absent", "1", timeout=3, limit=60)
    lines = _caught(result.stdout, "PeerError")
    assert len(lines) == n - 1, result.stdout + result.stderr
    assert all("rank(s) 1 did not arrive" in ln for ln in lines), lines


def test_one_store_with_dedicated_servers_per_job():
    out = _passes(_scenario(3, 1, "second_served_store"), 2)
    assert len(_caught(out, "ArgumentError")) == 2, out


@pytest.mark.parametrize("scenario,error", [("updater_on_one", "PeerMismatchError"),
                                            ("options_differ", "PeerMismatchError")])
def test_processes_that_update_unlike_are_refused(scenario, error):
    result = _scenario(2, 0, scenario, timeout=10)
    assert len(_caught(result.stdout, error)) == 2, result.stdout + result.stderr


MISMATCHED_CALLS = [("save", "push"), ("push", "save"), ("save", "load"),
                    ("load", "save_optimizer_states"), ("load_optimizer_states", "barrier"),
                    ("save_optimizer_states", "load_optimizer_states")]


@pytest.mark.parametrize("servers", [0, 1])
@pytest.mark.parametrize("first,other", MISMATCHED_CALLS,
                         ids=[f"{a}-{b}" for a, b in MISMATCHED_CALLS])
def test_mismatched_collective_calls_are_named(tmp_path, servers, first, other):
    """Worker 0 on one collective call (a checkpoint call among them) while the others
    make another: a PeerMismatchError naming both on every worker, before any message of
    either call moves, and the store failed on every worker from then on."""
    workers = 3 - servers
    result = _scenario(3, servers, "mismatched_calls", first, other, str(tmp_path / "c"),
                       timeout=5, limit=90)
    out = result.stdout + result.stderr
    lines = _caught(result.stdout, "PeerMismatchError")
    assert len(lines) == workers, out

    def named(call):  # with servers a push is no collective call: the barrier after it is
        return "barrier" if call == "push" and servers else call
    assert all(re.search(rf"calls {named(first)}(?![a-z_])", ln)  # lines may run on
               and re.search(rf"calls {named(other)}(?![a-z_])", ln) for ln in lines), lines
    assert len(re.findall(r"AGAIN Peer\w*Error on worker \d+ after 0\.0 s", result.stdout)
               ) == workers, out


@pytest.mark.parametrize("point,code", [("push1", "0"), ("push3", "1"), ("later", "0"),
                                        ("later", "1")])
def test_a_server_that_dies_is_a_peer_error(point, code):
    """A dedicated server that exits mid-training (the launcher leaving the workers to
    find out): each worker gets a PeerError, never MPI's own exception; its next call
    raises one at once, and the job ends, non-zero, in bounded time."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="1", GPUKV_DIST_TIMEOUT="2")
    start = time.monotonic()
    result = run("scenarios.py", 3, "server_dies", point, code, env=env, timeout=60,
                 options=("-disable-auto-cleanup",))
    took = time.monotonic() - start
    out = result.stdout + result.stderr
    assert "MPI.Exception" not in out, out
    assert len(_caught(result.stdout, "PeerError")) == 2, out
    assert len(re.findall(r"AGAIN PeerError on worker \d after 0\.0 s", result.stdout)) == 2, out
    assert result.returncode != 0 and took < 30, (took, out)


@pytest.mark.parametrize("kind", ["truncated", "no_such_rank"])
def test_mpi_errors_become_peer_errors(kind):
    """An error MPI raises under a transport (a receive cut short, a send to a rank that
    is not there) is a PeerError that fails the transport, and the job then ends."""
    result = _scenario(2, 0, "mpi_error", kind, timeout=5, limit=60)
    out = result.stdout + result.stderr
    assert "mpi4py.MPI.Exception" not in out and "MPI.Exception" not in out, out
    (line,) = _caught(result.stdout, "PeerError")
    assert "rank 0" in line and "MPI failed" in line, line
    assert "AGAIN PeerError on worker 0" in result.stdout, out
    assert result.returncode != 0, out


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_save_right_after_init(tmp_path, n, servers):
    _passes(_scenario(n, servers, "save_right_after_init", str(tmp_path / "s")), n - servers)


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_failed_load_makes_no_key(tmp_path, n, servers):
    path = str(tmp_path / "ckpt")
    _passes(_scenario(2, 0, "save", path), 2)  # keys 'a', 'b' and Adam's state
    out = _passes(_scenario(n, servers, "load_wrong_optimizer", path), n - servers)
    lines = _caught(out, "CheckpointError")
    assert len(lines) == n - servers and all("CheckpointError" not in ln for ln in lines), out


@needs_bfloat16
@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1), (4, 2)])
def test_bfloat16_keys(n, servers):
    _passes(_scenario(n, servers, "bfloat16"), n - servers)


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 0), (3, 1)])
def test_a_process_sums_16_bit_values_in_float32(n, servers):
    """SPEC: a narrow type never silently overflows: a process's own sum past float16's
    range is not rounded to it before the other processes' are added."""
    _passes(_scenario(n, servers, "narrow_local_sums"), n - servers)


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_a_push_the_optimizer_refuses_changes_nothing(n, servers):
    out = _passes(_scenario(n, servers, "refused_by_the_optimizer"), n - servers)
    assert len(_caught(out, "DTypeError")) == n - servers, out


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_empty_calls(n, servers):
    _passes(_scenario(n, servers, "empty_calls"), n - servers)


# ------------------------------------------------------------------ one process, options
def _single(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a plain python process (MPI starts as a singleton, no mpiexec)."""
    require_mpi()
    full = gpu_env.subprocess_env(gpus=False)
    full.update(env)
    return subprocess.run([sys.executable, "-c", "import numpy as np, gpukv\n" + code],
                          capture_output=True, text=True, timeout=120, env=full)


def test_one_process_is_a_whole_job():
    """Without mpiexec a dist store is one worker serving every key."""
    result = _single(
        "kv = gpukv.create('dist_sync')\n"
        "kv.init(1, np.ones(3)); kv.push(1, [np.ones(3), np.ones(3)])\n"
        "out = np.zeros(3); kv.pull(1, out=out); kv.barrier()\n"
        "print(kv.rank, kv.num_workers, kv.num_servers, out.tolist(), kv.type)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "0 1 0 [2.0, 2.0, 2.0] dist_sync"


@pytest.mark.parametrize("code,error,words", [
    ("gpukv.create('dist_async')", "ArgumentError", "needs dedicated servers"),
    ("gpukv.create('dist_sync', num_servers=1)", "ArgumentError", "num_servers=1"),
    ("gpukv.create('dist_sync', num_servers='1')", "ArgumentKindError", "num_servers"),
    ("gpukv.create('dist_sync', timeout=0)", "ArgumentError", "timeout=0"),
    ("gpukv.create('dist_sync', timeout=float('inf'))", "ArgumentError", "timeout=inf"),
    ("gpukv.create('dist_sync', bigarray_bound=0)", "ArgumentError", "bigarray_bound=0"),
    ("gpukv.create('dist_sync', timeout='5')", "ArgumentKindError", "timeout: expected"),
    ("gpukv.create('dist_sync', bigarray_bound='10')", "ArgumentKindError",
     "bigarray_bound: expected an int"),
    ("gpukv.create('dist_sync', bigarray_bound=np.int64(0))", "ArgumentError",
     "bigarray_bound=0"),
    ("print(gpukv.create('dist_sync', num_servers=np.int64(0), bigarray_bound=np.int64(10), "
     "timeout=np.float32(5)).num_servers)", "0", ""),
    ("gpukv.create('dist_sync', servers=2)", "ArgumentKindError", "'servers': unknown"),
    ("gpukv.create('dist_sync', nccl=True)", "ArgumentError", "nccl=True"),
    ("gpukv.create('dist_device_sync', nccl='yes')", "ArgumentKindError", "nccl"),
    ("gpukv.create('dist_device_sync', nccl=True)", "BackendError", "sees no GPU"),
])
def test_bad_options_are_typed_errors(code, error, words):
    result = _single(f"try:\n    {code}\nexcept gpukv.GpukvError as e:\n"
                     f"    print(type(e).__name__, e)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(error) and words in result.stdout, result.stdout


@pytest.mark.parametrize("var,value", [("GPUKV_NUM_SERVERS", "two"),
                                       ("GPUKV_DIST_TIMEOUT", "soon"),
                                       ("GPUKV_DIST_TIMEOUT", "inf"),
                                       ("GPUKV_BIGARRAY_BOUND", "-1"),
                                       ("GPUKV_DIST_CHUNK_BYTES", "1MB")])
def test_malformed_environment_is_named(var, value):
    result = _single("try:\n    gpukv.create('dist_sync')\nexcept gpukv.ArgumentError as e:\n"
                     "    print(e)\n", **{var: value})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{var}={value!r}"), result.stdout


def test_bad_push_is_refused_before_anything_moves():
    """A wrong shape is the usual typed error, raised before any message is sent: the
    store goes on working."""
    result = _single(
        "kv = gpukv.create('dist_sync')\n"
        "kv.init('w', np.ones(3))\n"
        "try:\n    kv.push('w', np.ones(4))\nexcept gpukv.ShapeError as e:\n    print(e)\n"
        "kv.push('w', np.ones(3)); out = np.zeros(3); kv.pull('w', out=out)\n"
        "print(out.tolist())\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["key 'w': push expects shape (3,), got (4,)",
                                             "[1.0, 1.0, 1.0]"]


def test_trainer_benchmark_against_ddp(tmp_path):
    """benchmarks/bench_trainer_dist.py runs its ways on 2 processes, with buckets of 1 MiB
    (--bucket-mb: the Trainer's and DDP's), and every Trainer way ends with DDP's weights
    (the benchmark's own check; it exits 1 otherwise)."""
    pytest.importorskip("torch")
    require_mpi()
    script = Path(__file__).parents[2] / "benchmarks" / "bench_trainer_dist.py"
    proc = subprocess.run([sys.executable, str(script), "--models", "mlp,1000-params",
                           "--warmup", "0", "--iters", "2", "--bucket-mb", "1",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = tmp_path.glob("trainer_dist_*.json")
    payload = json.loads(result.read_text())
    assert payload["bucket_mb"] == 1
    records = payload["results"]
    assert [r["model"] for r in records] == ["mlp", "1000-params"]
    for record in records:
        assert record["mpi_allreduce_s"] > 0
        ways = record["ways"]
        assert set(ways) == {"compute", "ddp", "trainer", "trainer overlap",
                             "trainer on store", "trainer on store overlap"}
        for way in ("trainer", "trainer overlap", "trainer on store",
                    "trainer on store overlap"):
            assert ways[way]["relative_difference_from_ddp"] < 1e-5, (way, ways[way])
        for way, r in ways.items():  # backward is timed inside the iteration
            assert 0 < r["backward_s"] < r["iteration_s"], (way, r)
            assert r["backward_over_compute"] == pytest.approx(
                r["backward_s"] / ways["compute"]["backward_s"])


@pytest.mark.parametrize("n,servers", [(2, 0), (3, 1)])
def test_jax_trees_on_a_dist_store(n, servers):
    """gpukv.jax across workers of 2 JAX devices each: mean_tree is the mean over every
    device of every worker, and a tree sharded over a worker's devices pushes one value
    per shard; without servers, a push_tree one worker refuses alone fails on every
    worker at once (the job then ends non-zero, its store failed)."""
    pytest.importorskip("jax")
    env = gpu_env.subprocess_env()
    env.update(GPUKV_NUM_SERVERS=str(servers),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = run("jax_trees.py", n, env=env, timeout=120)
    if servers:
        _passes(result, n - servers)
    else:
        assert result.returncode != 0 and all(
            f"PASS worker {w} of {n}" in result.stdout for w in range(n)), (
            result.stdout + result.stderr)
        assert "rank(s) 1 calls gpukv.jax.push_tree refused (ShapeError)" in result.stderr
