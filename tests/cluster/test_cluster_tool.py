"""gpukv.tools.cluster: hosts with their own network stacks, shaped links, cuts, and
nothing left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpukv.tools import cluster as tool

from .hosts import REPO, cluster, require_cluster

pytestmark = [pytest.mark.cluster]

# A TCP echo across two hosts: host 1 listens, host 0 connects and reads the reply.
SERVE = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,"
         "socket.SO_REUSEADDR,1); s.bind((sys.argv[1],7000)); s.listen(); print('up',"
         "flush=True); c,_=s.accept(); c.sendall(b'hello from '+sys.argv[1].encode())")
ASK = ("import socket,sys,time\n"
       "for attempt in range(int(sys.argv[2])):\n"
       "    try: c=socket.create_connection((sys.argv[1],7000),timeout=2); break\n"
       "    except OSError:\n"
       "        if attempt == int(sys.argv[2]) - 1: raise\n"
       "        time.sleep(0.5)\n"
       "print(c.recv(64).decode())")


def _namespaces(owner: int | None = None) -> set:
    """The network namespaces, or those of the clusters process `owner` made (other runs
    may make and remove their own meanwhile)."""
    listing = subprocess.run(["ip", "-o", "netns", "list"], capture_output=True,
                             text=True).stdout
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    return names if owner is None else {n for n in names if n.startswith(f"gpukv-{owner}-")}


def _serve(made, host: int) -> subprocess.Popen:
    server = made.popen(host, [sys.executable, "-c", SERVE, made.addresses[host]],
                        stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "up"
    return server


def _ask(made, host: int, target: int, attempts: int = 5) -> subprocess.CompletedProcess:
    """Connect from host to target's echo (a few tries: a link just restored may drop
    the first packets, as a real one does while it comes up) and read its reply."""
    return made.run(host, [sys.executable, "-c", ASK, made.addresses[target], str(attempts)],
                    capture_output=True, text=True, timeout=30)


def test_hosts_reach_each_other_over_their_own_interfaces():
    """Each host has its own address on eth0, and a connection from one to another's
    address crosses the switch (no shortcut through a shared loopback)."""
    with cluster(3) as made:
        assert made.addresses == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        shown = made.run(2, ["ip", "-o", "-4", "addr", "show"], capture_output=True,
                         text=True).stdout
        assert "198.18.0.3/15" in shown and "198.18.0.1" not in shown
        server = _serve(made, 1)
        asked = _ask(made, 0, 1)
        server.wait(timeout=10)
        assert asked.stdout.strip() == "hello from 198.18.0.2", asked.stderr


def test_every_link_is_shaped_both_ways():
    """tbf at each host's rate on the host's eth0 and on its port of the switch."""
    with cluster(2, "1gbit", h1="100mbit") as made:
        for host, rate in ((0, "1Gbit"), (1, "100Mbit")):
            for argv in (made.command(host, ["tc", "qdisc", "show", "dev", "eth0"]),
                         ["ip", "netns", "exec", made.switch, "tc", "qdisc", "show", "dev",
                          f"h{host}"]):
                shown = subprocess.run(argv, capture_output=True, text=True).stdout
                assert "tbf" in shown and f"rate {rate}" in shown, (argv, shown)


def test_a_cut_link_stops_traffic_and_a_restored_one_carries_it_again():
    """cut() takes a host off the network; restore() brings it back with its address."""
    with cluster(2) as made:
        made.cut(1)
        refused = _ask(made, 0, 1, attempts=1)
        assert refused.returncode != 0
        made.restore(1)
        server = _serve(made, 1)
        asked = _ask(made, 0, 1)
        server.wait(timeout=10)
        assert asked.stdout.strip() == "hello from 198.18.0.2", asked.stderr


def _sleepers(made) -> list:
    """A `sleep 60` on hosts 0 and 1, once host 1's has entered its namespace."""
    sleepers = [made.popen(h, ["sleep", "60"]) for h in (0, 1)]
    deadline = time.monotonic() + 10
    while not made.pids(1) and time.monotonic() < deadline:
        time.sleep(0.05)  # (until `ip netns exec` has entered the host)
    return sleepers


def test_kill_ends_every_process_of_a_host_only():
    """kill(host) is the host dying: its processes go, the others' stay."""
    with cluster(2) as made:
        sleepers = _sleepers(made)
        assert made.pids(1)
        made.kill(1)
        assert sleepers[1].wait(timeout=10) == -signal.SIGKILL
        assert sleepers[0].poll() is None
        assert made.pids(1) == []


def _ssh(made, host: int, target: int) -> subprocess.CompletedProcess:
    """The launcher script MPICH calls, run from host as MPICH runs it: `ssh -x TARGET
    COMMAND`."""
    return made.run(host, [made.env()["HYDRA_LAUNCHER_EXEC"], "-x", made.addresses[target],
                           "echo from $(hostname -I)"], capture_output=True, text=True,
                    timeout=30)


@pytest.mark.parametrize("down,words", [
    (1, "ssh: connect to host 198.18.0.2 port 22: No route to host"),
    (0, "ssh: connect to host 198.18.0.2 port 22: Network is unreachable"),
])
def test_the_launcher_fails_as_ssh_over_a_link_that_is_down(down, words):
    """With the target's link (or the caller's own) down, the launcher script does not run
    the command: it exits 255 with ssh's words; once the link is back it runs it there."""
    with cluster(2) as made:
        assert _ssh(made, 0, 1).stdout.strip() == "from 198.18.0.2"
        made.cut(down)
        refused = _ssh(made, 0, 1)
        assert (refused.returncode, refused.stdout, refused.stderr.strip()) == (255, "", words)
        made.restore(down)
        assert _ssh(made, 0, 1).stdout.strip() == "from 198.18.0.2"


def test_power_off_kills_a_host_and_takes_it_off_the_network():
    """power_off(host) is a machine that dies: its processes are killed, the launcher
    cannot reach it, the other host goes on; restore() brings it back, empty."""
    with cluster(2) as made:
        sleepers = _sleepers(made)
        assert made.power_off(1)
        assert sleepers[1].wait(timeout=10) == -signal.SIGKILL
        assert sleepers[0].poll() is None and made.pids(1) == []
        assert _ssh(made, 0, 1).returncode == 255
        made.restore(1)
        assert _ssh(made, 0, 1).stdout.strip() == "from 198.18.0.2"
        sleepers[0].kill()


def test_everything_is_removed_at_the_end_even_after_an_error():
    """The namespaces and the launcher script go when the `with` ends by an exception;
    two clusters at once have names of their own."""
    require_cluster()
    with pytest.raises(KeyError), tool.EmulatedCluster(2) as first, \
            tool.EmulatedCluster(2) as second:
        assert not set(first.namespaces) & set(second.namespaces)
        script = first.env()["HYDRA_LAUNCHER_EXEC"]
        assert os.access(script, os.X_OK)
        first.popen(1, ["sleep", "60"])
        raise KeyError("stop here")
    assert _namespaces(os.getpid()) == set()
    assert not os.path.exists(script)


def test_sweep_removes_what_a_killed_run_left():
    """A run killed with SIGKILL cannot clean up: the next cluster's start removes its
    namespaces (their owner's process is gone), and leaves a live owner's alone."""
    require_cluster()
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from gpukv.tools.cluster import EmulatedCluster; "
            "c = EmulatedCluster(2); c.start(); print(c.switch, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(REPO)], stdout=subprocess.PIPE,
                             text=True)
    assert owner.stdout is not None
    left = owner.stdout.readline().strip()
    assert left in _namespaces()
    with cluster(2):
        assert left in _namespaces()  # its owner lives
    tag = left.rsplit("-", 1)[0]
    folders = list(Path(tempfile.gettempdir()).glob(f"{tag}-*"))
    assert [f.name for f in folders if (f / "netns-ssh").is_file()], folders
    owner.kill()
    owner.wait()
    tool.sweep()  # (another cluster's start, in a run beside this one, may sweep first)
    assert not [n for n in _namespaces() if n.startswith(tag)]
    assert not [f for f in folders if f.exists()]  # its launcher's folder too


@pytest.mark.parametrize("argv, words", [
    (["--hosts", "0", "true"], "hosts: expected 1 to 250"),
    (["--rate", "fast", "true"], "link rate 'fast'"),
    (["--host-rate", "x", "true"], "--host-rate 'x'"),
    (["--host-rate", "5=1gbit", "true"], "host: expected 0 to 1"),
    ([], "no COMMAND given"),
])
def test_the_command_refuses_bad_options_before_making_anything(argv, words, capsys):
    """Usage errors name the option and make no namespace."""
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err
    if not tool.unavailable():
        assert _namespaces(os.getpid()) == set()


def test_a_command_that_does_not_exist_is_127_before_any_host_is_made(capsys):
    """As a shell answers it: status 127 and the command named, with no cluster made
    (a typo costs no set-up)."""
    assert tool.main(["--hosts", "2", "--", "no-such-command-here", "x"]) == 127
    assert "no-such-command-here: command not found" in capsys.readouterr().err
    assert _namespaces(os.getpid()) == set()


def test_the_command_runs_in_host_0_and_cleans_up_on_sigterm():
    """`gpukv cluster -- CMD` gives CMD host 0's network and the hosts' list, returns its
    status; SIGTERM to it removes the hosts."""
    require_cluster()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "gpukv", "cluster", "--hosts", "2", "--",
                           "sh", "-c", "ip -o -4 addr show eth0; echo $GPUKV_CLUSTER_HOSTS; "
                           "exit 3"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "198.18.0.1/15" in done.stdout and "198.18.0.1,198.18.0.2" in done.stdout
    running = subprocess.Popen([sys.executable, "-m", "gpukv", "cluster", "--hosts", "2",
                                "--", "sleep", "60"], env=env, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 30
    while len(_namespaces(running.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_namespaces(running.pid)) == 3  # the switch and two hosts, up
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=30) == 130
    assert _namespaces(running.pid) == set()


def test_bad_rates_are_refused():
    """A rate tc would not read fails before anything is made."""
    with pytest.raises(ValueError, match="link rate '10 gigabit'"):
        tool.EmulatedCluster(2, "10 gigabit")
    assert tool.rate_bits("1gbit") == 1e9 and tool.rate_bits("125mbps") == 1e9


def test_cut_restore_and_list_act_on_a_running_cluster_by_its_name():
    """Inside `gpukv cluster -- CMD`, `gpukv cluster cut 1` takes host 1's link down
    (GPUKV_CLUSTER names the cluster), `restore 1` brings it back, and `list` shows every
    host's namespace, address and link; the start line names the namespaces too."""
    require_cluster()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    gpukv = f"{sys.executable} -m gpukv cluster"
    script = (f"{gpukv} cut 1 && {gpukv} list && {gpukv} restore 1 && {gpukv} list && "
              f"{gpukv} cut 5; echo status $?")
    done = subprocess.run([sys.executable, "-m", "gpukv", "cluster", "--hosts", "2", "--",
                           "sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    tag = done.stderr.split("gpukv cluster ")[1].split(":")[0]
    assert f"{tag}-h1" in done.stderr  # the start line lists the namespaces
    listings = done.stdout.split(tag + "\n")[1:]
    assert len(listings) == 2, done.stdout
    assert f"host 1  198.18.0.2       {tag}-h1  link down" in listings[0]
    assert f"host 1  198.18.0.2       {tag}-h1  link up" in listings[1]
    assert f"host 5: cluster {tag} has hosts 0 to 1" in done.stderr
    assert "status 2" in done.stdout


@pytest.mark.parametrize("argv, words", [
    (["cut", "1"], "no cluster"),
    (["restore", "1", "--cluster", "gpukv-1-abcdef"], "no such cluster is running here"),
])
def test_cut_and_restore_say_which_cluster_they_need(argv, words, capsys, monkeypatch):
    require_cluster()
    monkeypatch.delenv("GPUKV_CLUSTER", raising=False)
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("rate", ["0bit", "0gbit", "7bit"])
def test_rates_too_slow_to_send_are_usage_errors(rate, capsys):
    """--rate 0bit is a usage error naming the rate, not tc's CalledProcessError."""
    with pytest.raises(SystemExit) as exited:
        tool.main(["--rate", rate, "true"])
    assert exited.value.code == 2
    assert f"link rate {rate!r}: expected at least 8bit" in capsys.readouterr().err
