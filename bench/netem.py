"""Run MPI ranks over an emulated, rate-limited network on one machine: every rank a host of its own
(ShapedNetwork), or nodes of several ranks (EmulatedCluster).

    python bench/netem.py --per-link 1gbit --procs 4 -- bench/allreduce.py --worker --max-bytes 16M
    python bench/netem.py --per-link 1gbit --procs 4 --latency-only
    python bench/netem.py --per-link 1gbit --nodes 2 --ranks-per-node 2 -- bench/allreduce.py --worker

The ranks run in a private network namespace whose loopback is rate-limited with a token bucket
(`tc qdisc ... tbf`), and MPICH is made to use TCP between them (MPIR_CVAR_NOLOCAL=1,
MPIR_CVAR_CH4_NETMOD=ofi, FI_PROVIDER=tcp): without FI_PROVIDER it keeps using shared memory and nothing
crosses the qdisc. Only loopback addresses inside that namespace are used. The namespace is removed
afterwards, also on failure or Ctrl-C. Needs root (it says so and stops otherwise).

Rates. All ranks share the one loopback, and in a ring step all p of them send at once, so the
aggregate limit is set to p x the per-link rate you ask for: each rank's link then gets its share,
as it would on a switch with one link per host. This kernel offers tbf, htb and pfifo but no netem,
so no delay can be added: the natural loopback TCP latency is measured and reported beside the rate.
Unthrottled, 4 ranks pushed about 2.2 GB/s through the loopback in all, so aggregates above about
16 Gbit/s are limited by the CPUs, not by the emulated link; the harness warns when asked for more.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from gflow.tools.cost_model import parse_rate  # noqa: E402 - --per-link here, and the other benchmarks' networks

TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
CPU_LIMIT_BITS = 16e9  # aggregate loopback rate the 2-core machine really sustains (see above)


def _one_thread() -> dict:
    """One BLAS/OpenMP thread per rank unless this process's environment says otherwise (as
    _common.launch): the ranks share the cores, and bench/fusion.py's compute, with a thread per core
    each, ran 14x longer than it was sized for under bench/model_check.py."""
    return {name: os.environ.get(name, "1") for name in _common.ONE_THREAD}


_LATENCY_WORKER = """
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
b = np.zeros(1, np.uint8)
reps = 2000
peer = c.size - 1
c.Barrier()
t = time.perf_counter()
for _ in range(reps):
    if c.rank == 0:
        c.Send(b, peer); c.Recv(b, peer)
    elif c.rank == peer:
        c.Recv(b, 0); c.Send(b, 0)
if c.rank == 0:
    print((time.perf_counter() - t) / reps / 2 * 1e6)
"""


class ShapedNetwork:
    """A network namespace with a rate-limited loopback; use as a context manager."""

    def __init__(self, per_link_bits: float, nprocs: int):
        if os.geteuid() != 0:
            raise SystemExit("bench/netem: needs root (network namespaces and tc); run it as root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise SystemExit(f"bench/netem: '{tool}' not found (Debian: apt-get install iproute2)")
        self.per_link_bits = per_link_bits
        self.aggregate_bits = per_link_bits * nprocs
        self.name = f"gflow-netem-{os.getpid()}"
        if self.aggregate_bits > CPU_LIMIT_BITS:
            print(
                f"bench/netem: warning: {nprocs} x {per_link_bits / 1e9:g} Gbit/s = "
                f"{self.aggregate_bits / 1e9:g} "
                f"Gbit/s in all is more than this machine's loopback sustains (~{CPU_LIMIT_BITS / 1e9:g}); "
                "the CPUs, not the emulated links, will be the limit",
                file=sys.stderr,
            )

    def __enter__(self):
        # A plain SIGTERM would skip __exit__ and leave the namespace behind: make it an exception.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self._run("ip", "netns", "add", self.name)
        try:
            self._run("ip", "-n", self.name, "link", "set", "lo", "up")
            rate = f"{int(self.aggregate_bits)}bit"
            self._run(
                "tc",
                "-n",
                self.name,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "1mb",
                "latency",
                "50ms",
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

    @staticmethod
    def _run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def command(self, argv: list[str]) -> list[str]:
        """argv wrapped to run inside the namespace, with MPICH over TCP."""
        env = [f"{k}={v}" for k, v in {**_one_thread(), **TCP_ENV}.items()]
        return ["ip", "netns", "exec", self.name, "env", *env, *argv]

    def launch(self, script: str, nprocs: int, args: list[str], timeout: float = 3600) -> None:
        cmd = [_common.mpiexec(), "-n", str(nprocs), sys.executable, script, *args]
        subprocess.run(self.command(cmd), check=True, timeout=timeout)

    def latency_us(self, nprocs: int) -> float:
        """Half round trip of a 1-byte MPI message between rank 0 and the last rank, in microseconds."""
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(_LATENCY_WORKER)
        try:
            cmd = [_common.mpiexec(), "-n", str(max(nprocs, 2)), sys.executable, f.name]
            done = subprocess.run(self.command(cmd), check=True, capture_output=True, text=True, timeout=120)
            return float(done.stdout.strip().splitlines()[-1])
        finally:
            os.unlink(f.name)


class EmulatedCluster:
    """Nodes of k ranks: free traffic inside a node, a rate-limited link between nodes; a context manager.

    One network namespace per node, each with one interface (eth0, 10.77.0.<node+1>/24): a veth whose
    other end sits on a bridge in a "switch" namespace, with a token bucket on both ends, so every node
    has one link of the given rate in each direction, as a host's NIC into a switch port. Every rank
    runs inside its node's namespace (the launcher stays outside: MPICH's PMI connection is an
    inherited socket, which crosses namespaces). MPICH sees the nodes as separate hosts (see
    command): shared memory inside a node, TCP between nodes.

    What is emulated: the bandwidth of each node's link, shared by the node's ranks, the switch, and
    shared memory inside a node. What is not: latency (this kernel has no netem qdisc; the natural
    latency between nodes is measured and printed: tens of microseconds, against a real fabric's few),
    and the nodes' own cores and memory bandwidth, which all ranks share here.
    """

    def __init__(self, per_link_bits: float, nodes: int, ranks_per_node: int):
        if os.geteuid() != 0:
            raise SystemExit("bench/netem: needs root (network namespaces and tc); run it as root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise SystemExit(f"bench/netem: '{tool}' not found (Debian: apt-get install iproute2)")
        if nodes < 2 or ranks_per_node < 1:
            raise SystemExit(
                f"bench/netem: a cluster needs >= 2 nodes of >= 1 rank, got {nodes} x {ranks_per_node}"
            )
        self.per_link_bits, self.nodes, self.k = per_link_bits, nodes, ranks_per_node
        self.prefix = f"gfc{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        if per_link_bits * nodes > CPU_LIMIT_BITS:
            print(
                f"bench/netem: warning: {nodes} links of {per_link_bits / 1e9:g} Gbit/s are more than this "
                f"machine sustains in all (~{CPU_LIMIT_BITS / 1e9:g} Gbit/s)",
                file=sys.stderr,
            )

    def node(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def __enter__(self):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        run = ShapedNetwork._run
        try:
            run("ip", "netns", "add", self.switch)
            run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", "br0", "up")
            rate = f"{int(self.per_link_bits)}bit"
            tbf = ["root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"]
            for i in range(self.nodes):
                ns, port = self.node(i), f"p{i}"
                run("ip", "netns", "add", ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
                run(
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.switch,
                )
                run("ip", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "eth0")
                run("ip", "-n", ns, "link", "set", "eth0", "up")
                run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                run("ip", "-n", self.switch, "link", "set", port, "up")
                run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # the node's upload
                run("tc", "-n", self.switch, "qdisc", "add", "dev", port, *tbf)  # and its download
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in [self.node(i) for i in range(self.nodes)] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def command(self, argv: list[str]) -> list[str]:
        """mpiexec over argv, each rank started inside its node's namespace.

        Hydra's fork launcher with one "host" per node starts one local proxy per node, and MPICH takes
        the ranks of one proxy for one node: shared memory inside it (and in Split_type, so gflow finds
        the nodes from MPI as on a real cluster), its netmod (TCP over eth0) between nodes."""
        env = {**_one_thread(), "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        # PMI_RANK is the rank hydra gives each process; it places consecutive ranks on a host.
        rank_cmd = f'exec ip netns exec {self.prefix}-n$((PMI_RANK / {self.k})) env {exports} "$@"'
        hosts = ",".join(f"node{i}:{self.k}" for i in range(self.nodes))
        nprocs = str(self.nodes * self.k)
        return [
            _common.mpiexec(),
            "-launcher",
            "fork",
            "-hosts",
            hosts,
            "-n",
            nprocs,
            "sh",
            "-c",
            rank_cmd,
            "rank",
            *argv,
        ]

    def launch(self, script: str, args: list[str], timeout: float = 3600) -> None:
        subprocess.run(self.command([sys.executable, script, *args]), check=True, timeout=timeout)

    def latency_us(self) -> float:
        """Half round trip of a 1-byte message between two nodes' first ranks, in microseconds."""
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(_LATENCY_WORKER.replace("peer = c.size - 1", f"peer = {self.k}"))
        try:
            done = subprocess.run(
                self.command([sys.executable, f.name]),
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            return float(done.stdout.strip().splitlines()[-1])
        finally:
            os.unlink(f.name)

    def describe(self, latency: float) -> str:
        return (
            f"emulated cluster: {self.nodes} nodes x {self.k} ranks, {self.per_link_bits / 1e9:g} Gbit/s "
            f"per node link, free inside a node; natural latency {latency:.1f} us half round trip "
            "between nodes"
        )


def launch(
    script: str,
    nprocs: int,
    args: list[str],
    per_link_bits: float | None,
    timeout: float = 3600,
    ranks_per_node: int | None = None,
):
    """As below; with ranks_per_node (and a rate), on an EmulatedCluster of nprocs / ranks_per_node
    nodes instead of one host per rank."""
    if ranks_per_node and per_link_bits is not None:
        if nprocs % ranks_per_node:
            raise SystemExit(f"bench/netem: {nprocs} ranks do not make nodes of {ranks_per_node}")
        with EmulatedCluster(per_link_bits, nprocs // ranks_per_node, ranks_per_node) as cluster:
            print(cluster.describe(cluster.latency_us()), flush=True)
            cluster.launch(script, args, timeout=timeout)
            return None
    return _launch_flat(script, nprocs, args, per_link_bits, timeout)


def _launch_flat(
    script: str, nprocs: int, args: list[str], per_link_bits: float | None, timeout: float = 3600
):
    """Run script under mpiexec: over shared memory (per_link_bits None) or the emulated network.
    Returns the measured loopback latency in microseconds for the emulated network, else None."""
    if per_link_bits is None:
        _common.launch(script, nprocs, args, timeout=timeout)
        return None
    with ShapedNetwork(per_link_bits, nprocs) as net:
        latency = net.latency_us(nprocs)
        print(
            f"emulated network: {per_link_bits / 1e9:g} Gbit/s per link ({net.aggregate_bits / 1e9:g} Gbit/s "
            f"loopback in all), {nprocs} ranks over TCP, natural latency {latency:.1f} us half round trip",
            flush=True,
        )
        net.launch(script, nprocs, args, timeout=timeout)
        return latency


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--per-link", type=parse_rate, required=True, help="e.g. 1gbit, 500mbit")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument(
        "--nodes", type=int, help="an emulated cluster of this many nodes (with --ranks-per-node)"
    )
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.nodes:
        with EmulatedCluster(args.per_link, args.nodes, args.ranks_per_node) as cluster:
            print(cluster.describe(cluster.latency_us()), flush=True)
            if not args.latency_only:
                if not args.script:
                    parser.error("give a script to run (or --latency-only)")
                cluster.launch(args.script, [a for a in args.args if a != "--"])
        return
    if args.latency_only:
        with ShapedNetwork(args.per_link, args.procs) as net:
            latency = net.latency_us(args.procs)
        print(
            f"{args.procs} ranks, {args.per_link / 1e9:g} Gbit/s per link: {latency:.1f} us half round trip"
        )
        return
    if not args.script:
        parser.error("give a script to run (or --latency-only)")
    launch(args.script, args.procs, [a for a in args.args if a != "--"], args.per_link)


if __name__ == "__main__":
    main()
