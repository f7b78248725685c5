"""Run MPI ranks over an emulated, rate-limited network on one machine.

    python bench/netem.py --per-link 1gbit --procs 4 -- bench/allreduce.py --worker --max-bytes 16M
    python bench/netem.py --per-link 1gbit --procs 4 --latency-only

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

TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
CPU_LIMIT_BITS = 16e9  # aggregate loopback rate the 2-core machine really sustains (see above)

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


def parse_rate(text: str) -> float:
    """'1gbit' -> 1e9 bits/s; also mbit, kbit, or a plain number of bits/s."""
    text = text.lower().strip()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


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
        env = [f"{k}={v}" for k, v in TCP_ENV.items()]
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


def launch(script: str, nprocs: int, args: list[str], per_link_bits: float | None, timeout: float = 3600):
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
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
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
