"""benchmarks/model_hosts.py: NCCL's cost model as tuning.cc states it, the model's
figures from a bench_cluster record, and its per-message measurement over MPI."""
from __future__ import annotations

import json
import math
import socket

import pytest

from ..distributed.mpirun import require_mpi
from .test_bench_cli import _load

MB = 1 << 20


def _case(hosts, way, nbytes, seconds):
    return {"hosts": hosts, "rate": "100mbit", "way": way, "bytes": nbytes, "keys": 1,
            "ok": True, "median_s": seconds, "fraction_of_limit": 0.5}


def test_nccl_ring_and_tree_follow_tuning_cc():
    m = _load("model_hosts.py")
    link = 50e9  # 400 Gb/s
    big = m.nccl_seconds(64, 100_000_000, link)
    steps = 2 * 63
    assert big["ring"] == pytest.approx((8.4 + steps * 9.6) * 1e-6 * 1.9
                                        + steps / 64 * 100_000_000 / link)
    assert big["tree"] == pytest.approx(2 * 6 * 50e-6 + 100_000_000 / (0.45 * link))
    small = m.nccl_seconds(1024, 4096, link)
    assert small["tree LL"] == pytest.approx((6.8 + 2 * 10 * 5.0) * 1e-6
                                             + 4096 / (0.45 / 3.8 * link))
    assert small["best"] == min(v for k, v in small.items() if k != "best")
    assert small["best"] == small["tree LL"]  # small messages: the tree's log latency wins


def test_the_model_takes_its_figures_from_the_runs():
    """A small round's software from 2 hosts; the exchange's share of the link from the
    fewest hosts above 2 (two processes take MPI's own allreduce)."""
    m = _load("model_hosts.py")
    rate = 100e6 / 8
    exchange_s = 2 * 3 / 4 * 4 * MB / rate / 0.8  # the bytes at 80% of the link on 4 hosts
    message_s = 40e-6
    sent = m.messages(4, 4 * MB)
    cases = [_case(2, "s0", 4096, 300e-6), _case(2, "mpi", 4096, 100e-6),
             _case(2, "s0", 4 * MB, 0.3), _case(4, "s0", 4 * MB, exchange_s + message_s * sent),
             _case(8, "s0", 4 * MB, 9.0), _case(2, "mpi", 4 * MB, 0.4),
             _case(16, "s0", 4096, 9e-3)]
    fits = m.fitted(cases, message_s)
    assert fits["round_software_s"] == pytest.approx(200e-6)
    assert fits["link_share"] == pytest.approx(0.8) and fits["link_share_hosts"] == 4
    rows = {(r["hosts"], r["gbit_s"], r["size"]): r for r in m.predict(fits)}
    row = rows[1024, 400, "100 MB"]
    link = 400e9 / 8
    assert row["gpukv_s"] == pytest.approx(2 * 1023 / 1024 * 1e8 / (0.8 * link)
                                           + message_s * m.messages(1024, 100_000_000))
    # at the cost per message it names, the exchange (its bytes at the link's rate) would
    # take what NCCL's best takes
    needed = row["message_s_to_match"]
    assert needed is not None and needed < message_s
    assert (2 * 1023 / 1024 * 1e8 / link + needed * m.messages(1024, 100_000_000)
            == pytest.approx(row["nccl_s"]["best"]))
    assert rows[64, 100, "4 KB"]["gpukv_s"] == pytest.approx(
        200e-6 + rows[64, 100, "4 KB"]["nccl_s"]["best"])


def test_exchange_messages_grow_with_hosts_and_chunks():
    m = _load("model_hosts.py")
    assert m.messages(2, 4 * MB) == 2 * 1 * 2       # 2 MB pieces: two 1 MB chunks
    assert m.messages(16, 4 * MB) == 2 * 15 * 1     # 256 KB pieces: one chunk each
    assert m.messages(2, 8 * MB, 16 << 10) == 2 * 256
    assert m.messages(1024, 100_000_000) == 2 * 1023 * math.ceil(100_000_000 / 1024 / MB)


def test_the_message_cost_is_measured_over_mpi():
    require_mpi()
    m = _load("model_hosts.py")
    seconds = m.measure_message_s()
    assert 0 < seconds < 0.01  # a message's software: microseconds, not a stall


def test_a_negative_message_cost_is_a_usage_error(capsys):
    """--message-us below zero would predict faster than free: exit 2 naming it."""
    m = _load("model_hosts.py")
    with pytest.raises(SystemExit) as exit_:
        m.main(["runs.json", "--message-us", "-1"])
    assert exit_.value.code == 2
    assert "argument --message-us: must be a finite number >= 0" in capsys.readouterr().err


def test_the_record_names_this_machine_and_the_runs_machine_apart(tmp_path, monkeypatch):
    """The fits come from the runs' machine, the message cost from this one: the record
    keeps both machines, the versions, and how the message cost was had."""
    m = _load("model_hosts.py")
    runs = {"machine": {"hostname": "the-runs-host"},
            "cases": [_case(2, "s0", 4096, 400e-6), _case(2, "mpi", 4096, 100e-6),
                      _case(4, "s0", 4 * MB, 0.8), _case(4, "mpi", 4 * MB, 0.9)]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(runs))
    assert m.main([str(path), "--message-us", "3", "--out", str(tmp_path)]) == 0
    record = json.loads(next(tmp_path.glob("hosts_model_*.json")).read_text())
    assert record["runs_machine"] == {"hostname": "the-runs-host"}
    assert record["machine"]["hostname"] == socket.gethostname()
    assert record["versions"]["gpukv"]
    assert record["message_us"] == {"value": pytest.approx(3.0), "how": "given"}


@pytest.mark.parametrize("runs,says", [
    ("missing.json", "not a bench_cluster.py JSON (FileNotFoundError"),
    ("other.json", "not a bench_cluster.py JSON (KeyError: 'cases')"),
    ("rates.json", "expected the runs of one link rate, got ['100mbit', '1gbit']"),
])
def test_a_file_that_is_no_cluster_run_is_a_usage_error(tmp_path, monkeypatch, capsys, runs,
                                                        says):
    """A missing file, another benchmark's JSON, or runs the model cannot take: status 2
    and one line naming the file and why, before anything is measured."""
    m = _load("model_hosts.py")
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "accuracy"}))
    (tmp_path / "rates.json").write_text(json.dumps({"cases": [
        {**_case(2, "s0", 4096, 1e-3), "rate": "100mbit"},
        {**_case(2, "mpi", 4096, 1e-3), "rate": "1gbit"}]}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        m.main([runs, "--message-us", "36", "--out", "-"])
    assert info.value.code == 2
    assert says in capsys.readouterr().err
