"""A small cluster on one machine: N emulated hosts in Linux network namespaces.

Each host is a network namespace with its own address on a private test
subnet (10.213.0.0/24, assigned only inside namespaces this tool creates), a
``/etc/netns/<ns>/hosts`` file naming every host, and its own host name (an
``unshare --uts`` namespace per launched process tree). The hosts hang off a
bridge that lives in a further namespace of its own (the "switch"), through
one veth pair per host; a link can be rate-limited (``tc ... tbf``) or cut
(``ip link set ... down``).

MPICH's hydra ``mpiexec`` runs inside the first host and reaches the others
through ``-launcher ssh -launcher-exec scripts/cluster/launcher.sh``: it drops
the ssh options and runs the proxy command with ``ip netns exec`` in the named
host's namespace (``NETCLUSTER_HOSTS`` maps names to namespaces), under that
host's name. No ssh daemon is needed.

Why ``UCX_TLS=tcp,self`` (and *not* ``MPIR_CVAR_NOLOCAL=1``), measured here:
by default UCX's shared-memory transports connect ranks in different
namespaces of the same kernel, so nothing crosses the veth; ``UCX_TLS=tcp,self``
sends inter-host data over TCP through the links, while MPICH's own
shared memory still serves ranks of the same emulated host, as on a real node.
``MPIR_CVAR_NOLOCAL=1`` would make every rank its own "node", breaking the
``MPI.COMM_TYPE_SHARED`` split that the node layout (and the node-shared buffer) rely on.

Every run reads the links' byte counters, so a silent fallback to shared memory
cannot pass as a multi-node run. Everything created (namespaces, links, qdiscs,
``/etc/netns`` files, the temporary directory, processes left in the
namespaces) is removed on exit, also on an exception or SIGTERM/SIGHUP/SIGINT;
stale namespaces of earlier runs whose process is gone are removed at start.

As a library (tests, benchmarks)::

    with NetCluster(hosts=2, ranks_per_host=1, rate="1gbit") as cluster:
        res = cluster.run(["python", "-m", "mpisgd.train", ...], timeout=120)
        cluster.check_traffic(res, min_bytes=1 << 20)

As a CLI::

    python scripts/cluster/netcluster.py run --hosts 2 --ranks-per-host 1 --rate 1gbit -- \\
        python -m mpisgd.train --dataset synthetic --max-steps 20
    python scripts/cluster/netcluster.py clean     # remove stale namespaces of this tool
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "mpisgdnc"  # namespace names: mpisgdnc<pid>x<serial>-h<i> / -sw
SUBNET = "10.213.0"  # a private test subnet, used only inside namespaces made here
IFACE = "eth0"  # each host's end of its link (inside the host's namespace)
BRIDGE = "br0"
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/var/run/netns")
_STALE_RE = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_serial = itertools.count()
# the environment that forces inter-host MPI traffic over the veth links (see module docstring)
NET_ENV = {"UCX_TLS": "tcp,self", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

LAUNCHER = Path(__file__).resolve().parent / "launcher.sh"  # hydra's ssh stand-in


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no permission, no tools): tests skip with this."""


class TrafficError(AssertionError):
    """A run that should have crossed the links did not (a fallback to shared memory)."""


@dataclass
class Host:
    name: str  # host name (UTS) and name in every hosts file
    ns: str  # network namespace
    addr: str  # address of IFACE on the test subnet
    port: str  # the link's other end, on the switch's bridge
    ranks: int  # MPI ranks this host runs


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    link_bytes: dict[str, int] = field(default_factory=dict)  # host -> tx+rx bytes during the run

    @property
    def min_link_bytes(self) -> int:
        return min(self.link_bytes.values()) if self.link_bytes else 0


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as '1gbit', '10gbit', '500mbit'."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit, got {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def check_permitted() -> None:
    """Raise ClusterUnavailable (with the reason) unless namespaces can be made here."""
    if os.name != "posix" or os.geteuid() != 0:
        raise ClusterUnavailable("emulated cluster needs root (network namespaces, veth, tc)")
    for tool in ("ip", "unshare", "hostname", "mpiexec"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"emulated cluster needs {tool!r} on PATH")
    probe = f"{PREFIX}{os.getpid()}x{next(_serial)}-probe"
    try:
        res = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterUnavailable(f"'ip netns add' failed: {exc}") from None
    if res.returncode != 0:
        raise ClusterUnavailable(f"'ip netns add' is not permitted here: {res.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_processes(ns: str, grace_s: float = 2.0) -> None:
    """TERM, then KILL, the processes still inside namespace ns (ours: the namespace is ours)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        res = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in res.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _ip("netns", "pids", ns, check=False).stdout.split():
            time.sleep(0.05)


def _remove_ns(ns: str) -> None:
    _kill_ns_processes(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def clean_stale() -> list[str]:
    """Remove namespaces (and /etc/netns dirs) of this tool whose creating process is gone."""
    names = set()
    if NETNS_RUN.is_dir():
        names |= {p.name for p in NETNS_RUN.iterdir()}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for ns in sorted(names):
        m = _STALE_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _remove_ns(ns)
            removed.append(ns)
    return removed


class NetCluster:
    """N emulated hosts joined by rate-limitable links; a context manager that cleans up after itself."""

    def __init__(self, hosts: int = 2, ranks_per_host: int | Sequence[int] = 1, rate: str | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if hosts > 250:
            raise ValueError(f"at most 250 hosts on the /24 test subnet, got {hosts}")
        ranks = [ranks_per_host] * hosts if isinstance(ranks_per_host, int) else list(ranks_per_host)
        if len(ranks) != hosts or min(ranks) < 1:
            raise ValueError(f"need one rank count >= 1 per host, got {ranks_per_host!r} for {hosts} host(s)")
        if rate is not None:
            parse_rate(rate)
        self.tag = f"{PREFIX}{os.getpid()}x{next(_serial)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(f"h{i}", f"{self.tag}-h{i}", f"{SUBNET}.{i}", f"p{i}", r)
                      for i, r in enumerate(ranks, start=1)]
        self.rate = rate
        self.extra_env = dict(extra_env or {})
        self.workdir: Path | None = None
        self.wrapper: Path | None = None
        self.hostfile: Path | None = None
        self._made: list[str] = []  # namespaces created, in order
        self._old_handlers: dict[int, Any] = {}
        self._lock = threading.Lock()

    # --- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> NetCluster:
        check_permitted()
        clean_stale()
        self._install_signal_handlers()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        # SIGTERM/SIGHUP would otherwise end Python without running `finally`: turn them into SystemExit
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: object) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _setup(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            self._add_ns(h.ns)
            (NETNS_ETC / h.ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.ns / "hosts").write_text(hosts_text)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            # both ends are created directly inside their namespaces: nothing touches the host's own
            _ip("link", "add", IFACE, "netns", h.ns, "type", "veth", "peer", "name", h.port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", h.port, "master", BRIDGE)
            _ip("-n", self.switch, "link", "set", h.port, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFACE)
            _ip("-n", h.ns, "link", "set", IFACE, "up")
        if self.rate:
            self.set_rate(self.rate)
        self.wrapper = LAUNCHER
        if not os.access(LAUNCHER, os.X_OK):  # a checkout that lost the mode bit: run a private copy
            self.wrapper = self.workdir / LAUNCHER.name
            shutil.copy(LAUNCHER, self.wrapper)
            self.wrapper.chmod(0o755)
        self.hostfile = self.workdir / "hostfile"
        self.hostfile.write_text("".join(f"{h.name}:{h.ranks}\n" for h in self.hosts))

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Remove everything this cluster made; safe to call twice."""
        with self._lock:
            for ns in reversed(self._made):
                _remove_ns(ns)  # deleting a namespace deletes its links and qdiscs with it
            self._made.clear()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir = None
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

    # --- links ------------------------------------------------------------------------------
    def set_rate(self, rate: str | None) -> None:
        """Limit every link to `rate` in both directions (tbf on both ends); None removes limits."""
        for h in self.hosts:
            for ns, dev in ((h.ns, IFACE), (self.switch, h.port)):
                _ip("-n", ns, "link", "show", dev)  # fail early on a missing link
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                               timeout=20)
                if rate is None:
                    continue
                bytes_per_s = parse_rate(rate) / 8
                # a bucket of ~1 ms of traffic (at least two 64 KiB GSO segments): a real line rate
                burst = max(128 * 1024, int(bytes_per_s / 1000))
                subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", str(burst), "latency", "50ms"], check=True, capture_output=True,
                               text=True, timeout=20)
        self.rate = rate

    def link_down(self, host: str) -> None:
        """Cut host's cable (its end of the veth goes down)."""
        _ip("-n", self._host(host).ns, "link", "set", IFACE, "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self._host(host).ns, "link", "set", IFACE, "up")

    def link_bytes(self) -> dict[str, int]:
        """tx+rx bytes so far on each host's link (the host's side of its veth)."""
        out = {}
        for h in self.hosts:
            stats = json.loads(_ip("-n", h.ns, "-j", "-s", "link", "show", "dev", IFACE).stdout)[0]["stats64"]
            out[h.name] = int(stats["tx"]["bytes"]) + int(stats["rx"]["bytes"])
        return out

    def _host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"no host {name!r}; hosts are {', '.join(h.name for h in self.hosts)}")

    # --- launching --------------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        return sum(h.ranks for h in self.hosts)

    def env(self) -> dict[str, str]:
        hosts = " ".join(f"{h.name}={h.ns}" for h in self.hosts)  # read by launcher.sh
        return {**os.environ, **NET_ENV, "NETCLUSTER_HOSTS": hosts, **self.extra_env}

    def mpiexec_cmd(self, argv: Sequence[str], n: int | None = None) -> list[str]:
        """The command line that runs `mpiexec ... argv` from inside the first host."""
        if self.hostfile is None:
            raise RuntimeError("the cluster is not set up: use it as a context manager")
        mpiexec = shutil.which("mpiexec") or "mpiexec"
        h1 = self.hosts[0]
        hosts = ",".join(f"{h.name}:{h.ranks}" for h in self.hosts)
        return ["ip", "netns", "exec", h1.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                h1.name, mpiexec, "-hosts", hosts, "-n", str(n or self.n_ranks), "-launcher", "ssh",
                "-launcher-exec", str(self.wrapper), *argv]

    def popen(self, argv: Sequence[str], n: int | None = None, **kw: Any) -> subprocess.Popen:
        """Start mpiexec in its own session (so a timeout can kill its whole process group)."""
        return subprocess.Popen(self.mpiexec_cmd(argv, n), env=self.env(), start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def kill_jobs(self) -> None:
        """Kill every process left in the hosts' namespaces (after a timeout or a cut link)."""
        for h in self.hosts:
            _kill_ns_processes(h.ns, grace_s=1.0)

    def wait(self, proc: subprocess.Popen, timeout: float, before: dict[str, int] | None = None,
             t0: float | None = None) -> RunResult:
        """Wait for a job from popen() with a hard timeout; on timeout kill it and everything it started."""
        t0 = time.monotonic() if t0 is None else t0
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.kill_jobs()
            out, err = proc.communicate(timeout=30)
        wall = time.monotonic() - t0
        after = self.link_bytes()
        delta = {k: after[k] - (before or {}).get(k, 0) for k in after}
        rc = proc.returncode if not timed_out else 124
        return RunResult(rc, out, err, wall, timed_out, delta)

    def run(self, argv: Sequence[str], timeout: float = 300, n: int | None = None) -> RunResult:
        """Run `mpiexec argv` across the hosts; returns exit status, output and bytes per link."""
        before = self.link_bytes()
        t0 = time.monotonic()
        return self.wait(self.popen(argv, n), timeout, before, t0)

    def check_traffic(self, res: RunResult, min_bytes: int) -> None:
        """Raise TrafficError unless every host's link carried at least min_bytes during the run."""
        low = {h: b for h, b in res.link_bytes.items() if b < min_bytes}
        if low:
            raise TrafficError(f"links carried fewer than {min_bytes} bytes: {low} (all: {res.link_bytes}); "
                               "the ranks talked through shared memory, not the emulated network")

    def describe(self) -> str:
        rate = self.rate or "unlimited"
        return (f"{len(self.hosts)} emulated host(s) "
                + ", ".join(f"{h.name}={h.addr}x{h.ranks}" for h in self.hosts)
                + f" | links {rate} | namespaces {self.tag}-*")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="netcluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command under mpiexec across emulated hosts")
    r.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    r.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks per host (default 1)")
    r.add_argument("--rate", default=None, help="per-link rate limit, e.g. 1gbit (default: unlimited)")
    r.add_argument("--timeout", type=float, default=600, help="seconds before the job is killed (default 600)")
    r.add_argument("--min-bytes", type=int, default=1 << 20,
                   help="fail (exit 3) if a link carried fewer bytes (default 1 MiB; 0: no check)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    sub.add_parser("clean", help="remove stale namespaces left by killed runs of this tool")
    a = p.parse_args(argv)
    if a.cmd == "clean":
        check_permitted()
        print("removed:", " ".join(clean_stale()) or "nothing")
        return 0
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after --")
    try:
        with NetCluster(a.hosts, a.ranks_per_host, a.rate) as cluster:
            print(f"netcluster: {cluster.describe()}", file=sys.stderr)
            env = {k: v for k, v in cluster.env().items() if k in NET_ENV or k in ("NETCLUSTER_HOSTS",)}
            print(f"netcluster: env {shlex.join(f'{k}={v}' for k, v in env.items())} "
                  f"{shlex.join(cluster.mpiexec_cmd(cmd))}", file=sys.stderr)
            res = cluster.run(cmd, timeout=a.timeout)
            sys.stdout.write(res.stdout)
            sys.stderr.write(res.stderr)
            print(f"netcluster: exit {res.returncode}{' (timed out)' if res.timed_out else ''} after "
                  f"{res.wall_s:.1f} s | bytes per link {res.link_bytes}", file=sys.stderr)
            if res.returncode == 0 and a.min_bytes and res.min_link_bytes < a.min_bytes:
                print(f"netcluster: FAIL: a link carried < {a.min_bytes} bytes: traffic did not cross "
                      "the emulated network", file=sys.stderr)
                return 3
            return res.returncode
    except ClusterUnavailable as exc:
        print(f"netcluster: unavailable: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
