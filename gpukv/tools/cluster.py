"""Several hosts emulated on one Linux machine, to run an MPI job across real network stacks.

Each host is a network namespace with one interface, `eth0`, and its own address in
198.18.0.0/15 (the range set aside for benchmarking networks); the hosts' links meet on a
bridge in a namespace of its own, the switch. Each link is shaped to a rate with `tc`'s
token-bucket filter in both directions (the host's egress on `eth0`, its ingress on the
switch's port), so a host sends and receives at most that rate, as on a full-duplex NIC.
`tbf` shapes bandwidth only: this kernel may have no `netem`, and the links add no latency
beyond the kernel's own.

MPI runs across the hosts with MPICH's own launcher: `env()` points `HYDRA_LAUNCHER=ssh` at
a script that runs the proxy's command inside the host's namespace instead of over ssh, and
turns shared memory off so that every byte crosses a link. Programs start in host 0 (the
first address), as a job is started from one machine of a cluster.

Needs root and `ip`/`tc` (iproute2). Names are unique per run (they carry the process id),
everything is removed at the end, and `sweep()` removes what a killed run left behind.

    with EmulatedCluster(4, rate="1gbit") as cluster:
        cluster.run(0, ["python", "-m", "gpukv", "run", "-n", "4",
                        "--hosts", ",".join(cluster.addresses), "python", "train.py"],
                    env=cluster.env())

or from a shell: `python -m gpukv cluster --hosts 4 --rate 1gbit -- gpukv run -n 4 ...`.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: the benchmarking range (RFC 2544); host i gets the (i + 1)-th address
NETWORK = ipaddress.ip_network("198.18.0.0/15")
#: the interface of each host, as on a one-NIC machine
IFACE = "eth0"
_PREFIX = "gpukv"
#: `ip netns exec NS` mounts the files of /etc/netns/NS over those of /etc
_ETC = Path("/etc/netns")
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-([0-9a-f]+)-(sw|h\d+)$")
#: a cluster's temporary folder: its tag, then mkdtemp's own letters
_FOLDER = re.compile(rf"^{_PREFIX}-(\d+)-([0-9a-f]{{6}})-")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


class ClusterUnavailable(RuntimeError):
    """This machine cannot emulate hosts: not root, or no `ip`/`tc`, or no namespaces."""


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9 bits per second ('125mbps' is bytes, as `tc` reads it)."""
    match = _RATE.match(rate.strip())
    if match is None:
        raise ValueError(f"link rate {rate!r}: expected a number with kbit, mbit or gbit "
                         f"(or kbps, mbps, gbps for bytes), e.g. 1gbit")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    bits = value * (8 if match.group(3).lower() == "bps" else 1)
    if bits < 8:  # tc's token bucket cannot run slower (and 0 would never send)
        raise ValueError(f"link rate {rate!r}: expected at least 8bit (1bps); to take a "
                         f"host off the network, cut its link")
    return bits


def burst_bytes(rate: str) -> int:
    """The bytes a link shaped to `rate` passes at once, unshaped, from a full token
    bucket: 2 ms at the rate, at least 64 KiB (one segment the kernel may send whole)."""
    return max(65536, int(rate_bits(rate) / 8 * 0.002))


def unavailable() -> str | None:
    """Why hosts cannot be emulated here, or None when they can."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    listing = _ip("-o", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _pids(namespace: str) -> list[int]:
    listing = _ip("netns", "pids", namespace, check=False).stdout
    return [int(pid) for pid in listing.split()]


def _kill_all(namespace: str) -> None:
    for pid in _pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove the namespaces of emulated clusters whose process is gone (a run that was
    killed before it could clean up), and their launcher's temporary folders; the
    namespaces removed."""
    removed = []
    for namespace in _namespaces():
        match = _NAME.match(namespace)
        if match and not _alive(int(match.group(1))):
            _kill_all(namespace)
            _ip("netns", "delete", namespace, check=False)
            shutil.rmtree(_ETC / namespace, ignore_errors=True)
            removed.append(namespace)
    for folder in Path(tempfile.gettempdir()).glob(f"{_PREFIX}-*-*-*"):
        match = _FOLDER.match(folder.name)  # (named after its cluster's tag)
        if match and (folder / "netns-ssh").is_file() and not _alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


class EmulatedCluster:
    """`hosts` hosts, each linked to the switch at `rate` (per host in `rates`)."""

    def __init__(self, hosts: int, rate: str = "1gbit", rates: dict | None = None):
        if not isinstance(hosts, int) or not 1 <= hosts <= 250:
            raise ValueError(f"hosts: expected 1 to 250, got {hosts!r}")
        self.hosts = hosts
        self.rates = [rate] * hosts
        for host, host_rate in (rates or {}).items():
            self._check_host(host)
            self.rates[host] = host_rate
        for host_rate in self.rates:
            rate_bits(host_rate)  # a bad rate fails here, before anything is made
        self.tag = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.addresses = [str(NETWORK.network_address + i + 1) for i in range(hosts)]
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.switch = f"{self.tag}-sw"
        self._dir: Path | None = None
        self._made: list[str] = []

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Make the switch, the hosts and their links; on any failure, undo it all."""
        why = unavailable()
        if why:
            raise ClusterUnavailable(why)
        if self._made:
            raise RuntimeError(f"cluster {self.tag} is started already")
        sweep()
        try:
            self._make_switch()
            for host in range(self.hosts):
                self._make_host(host)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            self._write_launcher(self._dir / "netns-ssh")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every process still in a host, remove every namespace (their links go with
        them) and the launcher script. Safe to call twice."""
        for namespace in reversed(self._made):
            _kill_all(namespace)
        for namespace in reversed(self._made):
            _ip("netns", "delete", namespace, check=False)
            shutil.rmtree(_ETC / namespace, ignore_errors=True)
        self._made.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _make_switch(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, host: int) -> None:
        namespace, port = self.namespaces[host], f"h{host}"
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("link", "add", port, "netns", self.switch, "type", "veth",
            "peer", "name", IFACE, "netns", namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{self.addresses[host]}/{NETWORK.prefixlen}",
            "dev", IFACE)
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "link", "set", IFACE, "up")
        self.shape(host, self.rates[host])
        self._write_names(namespace)

    def _write_names(self, namespace: str) -> None:
        """The host's own /etc/hosts (every host by name: gpukv-h0, ...) and a resolver
        with no server: the machine's name server is out of the hosts' reach, and a
        lookup sent there (gloo's reverse lookups, say) would wait seconds for it."""
        etc = _ETC / namespace
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{address} {_PREFIX}-h{i}\n" for i, address in
                        enumerate(self.addresses))
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        (etc / "resolv.conf").write_text("# no name server on the emulated network\n"
                                         "options timeout:1 attempts:1\n")

    def _write_launcher(self, path: Path) -> None:
        """The `ssh` MPICH's launcher calls: `netns-ssh [-x] HOST COMMAND...` runs COMMAND
        through a shell in HOST's namespace, as ssh runs it on a remote machine. As ssh, it
        fails (status 255, ssh's words) when HOST's link is down (cut, or powered off) or
        when the caller's own eth0, in the namespace it runs in, is."""
        cases = "\n".join(f"  {address}) ns={namespace} ;;" for address, namespace
                          in zip(self.addresses, self.namespaces, strict=True))
        # an option with a value (-o X, -p N ...) would otherwise be taken for the host
        valued = "bcDEeFIiJLlmOopQRSWw"
        path.write_text(
            "#!/bin/sh\n"
            "# ssh's options (MPICH passes -x) come before the host\n"
            "while [ $# -gt 0 ]; do case \"$1\" in\n"
            f"  -[{valued}]) shift 2 ;;\n"
            "  -*) shift ;;\n"
            "  *) break ;;\n"
            "esac; done\n"
            'host=$1; shift\n'
            'case "$host" in\n'
            f"{cases}\n"
            '  *) echo "netns-ssh: no emulated host $host" >&2; exit 255 ;;\n'
            'esac\n'
            "# a link carries traffic when it is up and so is its other end\n"
            f"up() {{ ip \"$@\" -o link show {IFACE} 2>/dev/null |\n"
            "  grep -q 'LOWER_UP.*state UP'; }\n"
            f"if ip -o link show {IFACE} >/dev/null 2>&1 && ! up; then\n"
            '  echo "ssh: connect to host $host port 22: Network is unreachable" >&2; exit 255\n'
            "fi\n"
            'if ! up -n "$ns"; then\n'
            '  echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255\n'
            "fi\n"
            'exec ip netns exec "$ns" sh -c "$*"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    # ------------------------------------------------------------------ the links
    def shape(self, host: int, rate: str) -> None:
        """Set host's link to `rate` both ways. The bucket holds 2 ms at that rate (at
        least 64 KiB, one segment the kernel may send whole), and up to 20 ms of packets
        queue behind it, as in a switch's port buffer, before any is dropped."""
        self._check_host(host)
        bits = rate_bits(rate)
        burst = burst_bytes(rate)
        for namespace, device in ((self.namespaces[host], IFACE), (self.switch, f"h{host}")):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace",
                            "dev", device, "root", "tbf", "rate", f"{int(bits)}bit",
                            "burst", str(burst), "latency", "20ms"],
                           check=True, capture_output=True)
        self.rates[host] = rate

    def cut(self, host: int) -> None:
        """Take host's link down (its processes go on, unreachable)."""
        self._check_host(host)
        cut_link(self.namespaces[host])

    def restore(self, host: int) -> None:
        """Bring host's link back up (the address and route come back with it)."""
        self._check_host(host)
        restore_link(self.namespaces[host])

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process of host, as when the machine dies; their pids."""
        self._check_host(host)
        pids = _pids(self.namespaces[host])
        _kill_all(self.namespaces[host])
        return pids

    def power_off(self, host: int) -> list[int]:
        """Host dies as a machine does: its link goes down first (its peers hear nothing
        more, not even the kernel closing its connections), then every process of it is
        SIGKILLed; their pids. `restore` brings the (empty) host back."""
        self.cut(host)
        return self.kill(host)

    def pids(self, host: int) -> list[int]:
        """The processes running in host."""
        self._check_host(host)
        return _pids(self.namespaces[host])

    # ------------------------------------------------------------------ running
    def env(self, base: dict | None = None) -> dict:
        """`base` (the current environment by default) plus what makes `mpiexec` (and
        `gpukv run`) start processes across the hosts, over TCP only."""
        if self._dir is None:
            raise RuntimeError("the cluster is not started")
        env = dict(os.environ if base is None else base)
        env.update({
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(self._dir / "netns-ssh"),
            "HYDRA_IFACE": IFACE,          # proxies reach mpiexec at host 0's address
            "MPIR_CVAR_NOLOCAL": "1",      # no shared memory between ranks
            "UCX_TLS": "tcp,self",
            "FI_PROVIDER": "tcp",
            # the hosts share one name ("localhost" to a resolver): gloo and NCCL bind to
            # the host's own interface instead
            "GLOO_SOCKET_IFNAME": IFACE,
            "NCCL_SOCKET_IFNAME": IFACE,
            "GPUKV_CLUSTER_HOSTS": ",".join(self.addresses),
            "GPUKV_CLUSTER": self.tag,     # `gpukv cluster cut I` finds its hosts by it
        })
        return env

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run inside host's namespace."""
        self._check_host(host)
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start argv in host (with `env()` unless `env` is given)."""
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run argv in host to its end (with `env()` unless `env` is given)."""
        kwargs.setdefault("env", self.env())
        return subprocess.run(self.command(host, argv), **kwargs)

    def _check_host(self, host) -> None:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"host: expected 0 to {self.hosts - 1}, got {host!r}")


def cut_link(namespace: str) -> None:
    """Take the link of the host in `namespace` down."""
    _ip("-n", namespace, "link", "set", IFACE, "down")


def restore_link(namespace: str) -> None:
    """Bring the link of the host in `namespace` back up; return once it carries traffic
    again (both ends of the veth report their carrier up; the address and its route
    come back with the link)."""
    _ip("-n", namespace, "link", "set", IFACE, "up")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        shown = _ip("-n", namespace, "-o", "link", "show", IFACE).stdout
        if "LOWER_UP" in shown and "state UP" in shown:
            return
        time.sleep(0.02)
    raise ClusterUnavailable(f"{namespace}: the link did not come back up within 5 s")


def clusters() -> dict:
    """{tag: [(host, namespace, address, link state)]} of the emulated clusters running
    on this machine."""
    found: dict = {}
    for namespace in _namespaces():
        match = _NAME.match(namespace)
        if match is None or match.group(3) == "sw":
            continue
        tag = namespace[:-len(match.group(3)) - 1]
        shown = _ip("-n", namespace, "-o", "-4", "addr", "show", IFACE, check=False).stdout
        address = shown.split(" inet ")[1].split("/")[0] if " inet " in shown else "-"
        link = _ip("-n", namespace, "-o", "link", "show", IFACE, check=False).stdout
        state = "up" if "state UP" in link else "down"
        found.setdefault(tag, []).append((int(match.group(3)[1:]), namespace, address, state))
    return {tag: sorted(hosts) for tag, hosts in sorted(found.items())}


# ---------------------------------------------------------------------- the command
_VERBS = ("cut", "restore", "list")


def _verb(argv: list[str]) -> int:
    """`gpukv cluster cut|restore HOST [--cluster TAG]` and `gpukv cluster list`."""
    parser = argparse.ArgumentParser(
        prog=f"gpukv cluster {argv[0]}",
        description="cut: take host HOST's link down (its processes go on, unreachable); "
                    "restore: bring it back up; list: the emulated clusters running here, "
                    "each host's namespace, address and link. The cluster is the one "
                    "GPUKV_CLUSTER names (set for the COMMAND of 'gpukv cluster'), else "
                    "--cluster TAG.")
    if argv[0] != "list":
        parser.add_argument("host", type=int, help="the host's index (0 is the first)")
        parser.add_argument("--cluster", default=os.environ.get("GPUKV_CLUSTER"),
                            help="the cluster's tag (default $GPUKV_CLUSTER)")
    args = parser.parse_args(argv[1:])
    why = unavailable()
    if why:
        print(f"gpukv cluster: {why}", file=sys.stderr)
        return 2
    running = clusters()
    if argv[0] == "list":
        for tag, hosts in running.items():
            print(tag)
            for host, namespace, address, state in hosts:
                print(f"  host {host}  {address:<15}  {namespace}  link {state}")
        if not running:
            print("no emulated cluster is running", file=sys.stderr)
        return 0
    if not args.cluster:
        parser.error("no cluster: run it inside 'gpukv cluster -- COMMAND' (which sets "
                     "GPUKV_CLUSTER), or give --cluster TAG ('gpukv cluster list' shows them)")
    hosts = {host: namespace for host, namespace, _, _ in running.get(args.cluster, [])}
    if not hosts:
        parser.error(f"--cluster {args.cluster!r}: no such cluster is running here")
    if args.host not in hosts:
        parser.error(f"host {args.host}: cluster {args.cluster} has hosts 0 to "
                     f"{max(hosts)}")
    (cut_link if argv[0] == "cut" else restore_link)(hosts[args.host])
    print(f"gpukv cluster: host {args.host} ({hosts[args.host]}): link "
          f"{'down' if argv[0] == 'cut' else 'up'}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukv cluster",
        description="Run COMMAND on host 0 of hosts emulated on this machine (Linux network "
                    "namespaces on a bridge, links shaped with tc tbf; needs root), with "
                    "the environment that makes mpiexec and 'gpukv run' start processes "
                    "across them over TCP. GPUKV_CLUSTER_HOSTS lists their addresses, "
                    "GPUKV_CLUSTER names the cluster for 'gpukv cluster cut|restore HOST' "
                    "('gpukv cluster list' shows every running cluster). Everything is "
                    "removed when COMMAND ends.",
        epilog="example: gpukv cluster --hosts 2 --rate 1gbit -- sh -c "
               "'python -m gpukv run -n 2 --hosts $GPUKV_CLUSTER_HOSTS train.py' (with the "
               "venv's python, as .venv/bin/python)")
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--rate", default="1gbit",
                        help="each host's link rate, both ways (default 1gbit)")
    parser.add_argument("--host-rate", action="append", default=[], metavar="I=RATE",
                        help="host I's link at RATE instead (a straggler), repeatable")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in _VERBS:
        return _verb(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given")
    if shutil.which(command[0]) is None:  # (as a shell says it, before any host is made)
        print(f"gpukv cluster: {command[0]}: command not found", file=sys.stderr)
        return 127
    rates = {}
    for item in args.host_rate:
        host, _, rate = item.partition("=")
        if not host.isdigit() or not rate:
            parser.error(f"--host-rate {item!r}: expected I=RATE, e.g. 1=100mbit")
        rates[int(host)] = rate
    try:
        cluster = EmulatedCluster(args.hosts, args.rate, rates)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM ends the command and removes the hosts, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with cluster:
            hosts = f"{args.hosts} host{'s' if args.hosts != 1 else ''}"
            print(f"gpukv cluster {cluster.tag}: {hosts}, links "
                  f"{', '.join(sorted(set(cluster.rates)))}", file=sys.stderr)
            for host, (address, namespace) in enumerate(zip(cluster.addresses,
                                                            cluster.namespaces)):
                print(f"  host {host}  {address:<15}  {namespace}", file=sys.stderr)
            sys.stderr.flush()
            return cluster.run(0, command).returncode
    except ClusterUnavailable as exc:
        print(f"gpukv cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
