"""Command line: `python -m gflow demo|bench|timeline|info|calibrate|model|compile`.

mpiexec -n 4 python -m gflow demo     # gflow's allreduce beside MPI's own, checked and timed
mpiexec -n 4 python -m gflow bench -b 4K -e 256M -f 2 --check    # nccl-tests' all_reduce_perf
python -m gflow timeline merge trace.*.json -o trace.json        # GFLOW_TIMELINE's files, merged
python -m gflow info                  # what this installation sees: paste it into bug reports
mpiexec -n 4 python -m gflow info     # ... and the nodes (topology) gflow finds among the ranks
mpiexec -n 4 python -m gflow calibrate --out calib.json    # the cost model's constants, measured
python -m gflow model --ranks 512 --ranks-per-node 8 --link 56gbit --workload alexnet
mpiexec -n 2 python -m gflow compile  # Numba's loops and kernels compiled once, ahead of jobs
"""

import argparse
import json
import math
import os
import sys

from . import benchmark, precompile
from .demo import demo


def info() -> int:
    """Print the MPI library, thread level, package versions and whether a GPU is seen."""
    import numpy as np
    from mpi4py import MPI

    import gflow
    from gflow.runtime.mpi import launcher, launcher_mismatch, mpi_library, thread_level_name

    started_by, ranks = launcher()
    lines = {
        "gflow": gflow.__version__,
        "python": sys.version.split()[0],
        "mpi4py": __import__("mpi4py").__version__,
        "MPI library": mpi_library(),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": thread_level_name(MPI.Query_thread()),
        "world size": MPI.COMM_WORLD.size,
        "launcher": f"{started_by} ({ranks} ranks)" if ranks else "none (this process alone)",
        "topology": _topology(),
        "numpy": np.__version__,
        "validate": gflow.config.validate,
        "small_message_bytes": gflow.config.small_message_bytes,
        "ring_segment_bytes": gflow.config.ring_segment_bytes,
        "shared_memory_min_bytes": gflow.config.shared_memory_min_bytes,
        "hierarchical_min_bytes": gflow.config.hierarchical_min_bytes,
        "shared_memory_max_bytes": gflow.config.shared_memory_max_bytes,
    }
    lines.update(_versions("numba", "numba_cuda", "cupy", "torch"))
    try:
        from numba import cuda

        lines["GPU"] = ", ".join(
            d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in cuda.gpus
        )
    except Exception as exc:  # noqa: BLE001 - any failure here just means no usable GPU
        lines["GPU"] = f"none seen ({type(exc).__name__})"
    if not lines["GPU"]:
        lines["GPU"] = "none seen"
    try:
        from ..cuda import transport

        lines["device buffers"] = transport.describe()
    except Exception as exc:  # noqa: BLE001 - Numba's CUDA support may fail to load without a GPU
        lines["device buffers"] = f"unavailable ({type(exc).__name__})"
    if (mismatch := launcher_mismatch()) is not None:
        lines["LAUNCHER MISMATCH"] = mismatch
    if MPI.COMM_WORLD.rank == 0:
        width = max(map(len, lines))
        for key, value in lines.items():
            print(f"{key:>{width}}: {value}")
    return 0


def _versions(*modules: str) -> dict:
    """Each module's installed version, without importing it: importing torch only for its version
    took 2.4 s of the command's 5. From the package's metadata (CuPy's package is named for its CUDA:
    cupy-cuda12x), or for torch from its version.py, whose build tag (+cpu, +cu130) the metadata lacks."""
    import importlib.metadata
    import importlib.util
    import os
    import re

    packages = importlib.metadata.packages_distributions()
    found = {}
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None:
            found[module] = "not installed"
            continue
        try:
            with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as file:
                found[module] = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", file.read(), re.M).group(1)
                continue
        except (OSError, TypeError, AttributeError):  # no version.py, not a package, no such line
            pass
        for package in packages.get(module, []):
            try:
                found[module] = importlib.metadata.version(package)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
        else:
            found[module] = "installed"
    return found


def _topology() -> str:
    """The nodes gflow sees on COMM_WORLD (collective: under mpiexec every rank runs info)."""
    from mpi4py import MPI

    from ..collectives.topology import discover

    try:
        return discover(MPI.COMM_WORLD).describe()
    except Exception as exc:  # noqa: BLE001 - a bad setting is what info is asked to show
        return f"unknown ({type(exc).__name__}: {exc})"


def _calibrate_refusal(args, ranks: int) -> str | None:
    """Why `gflow calibrate` with these arguments would measure nothing worth keeping, or None."""
    if args.device:
        from gflow.cuda.memory import SIMULATED

        if SIMULATED:
            return (
                "--device: NUMBA_ENABLE_CUDASIM=1 runs Numba's CUDA simulator, whose timings are not a "
                "GPU's; unset it on a machine with a GPU"
            )
        from numba import cuda

        if not cuda.is_available():
            return "--device: no GPU is usable here (numba.cuda.is_available() is False)"
    if ranks < 2:
        return (
            "the terms are what ranks cost each other (ping-pongs, gflow's steps, the node phase): run it "
            "on at least 2 ranks, `mpiexec -n 2 python -m gflow calibrate` (1 rank would write the defaults)"
        )
    if benchmark.not_a_new_file(args.out):
        return f"--out {args.out!r}: expected a file in an existing folder"
    return None


def calibrate_command(args) -> int:
    from mpi4py import MPI

    from . import cost_model as model

    rank = MPI.COMM_WORLD.rank
    refusal = _calibrate_refusal(args, MPI.COMM_WORLD.size) if rank == 0 else None
    refusal = MPI.COMM_WORLD.bcast(refusal, root=0)
    if refusal is not None:  # (before a minute of measuring)
        if rank == 0:
            print(f"gflow calibrate: {refusal}", file=sys.stderr)
        return 2
    cal = model.calibrate(
        progress=(lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    )
    if args.device:  # on rank 0's GPU alone (ranks that share it would measure each other)
        terms = model.device_terms() if rank == 0 else None
        terms = MPI.COMM_WORLD.bcast(terms, root=0)
        cal.launch, cal.pcie, cal.device = terms["launch"], terms["pcie"], terms["device"]
        cal.source += f"; device terms on {cal.device}"
        if rank == 0:
            print(
                f"device {cal.device}: a kernel launch and its stream sync {cal.launch * 1e6:.1f} us; "
                f"pinned copies {1 / cal.pcie / 1e9:.1f} GB/s each way",
                flush=True,
            )
    if rank == 0:
        cal.save(args.out)
        if args.install:
            cal.save(model.LAST_CALIBRATION)
            overridden = os.environ.get(model.CALIBRATION_ENV)
            print(
                f"wrote {args.out}, and {model.LAST_CALIBRATION}: now the default for `gflow model`"
                + (
                    f" (but {model.CALIBRATION_ENV}={overridden}, set here, comes first)"
                    if overridden
                    else ""
                )
            )
        else:
            print(
                f"wrote {args.out} (`gflow model --calibration {args.out}` uses it; `--install` makes it "
                "the default)"
            )
    return 0


def model_command(parser, args) -> int:
    from . import cost_model as model

    try:
        base = model.Calibration.load(args.calibration)
        try:
            link = model.parse_rate(args.link)
        except ValueError as exc:
            raise ValueError(f"--link {args.link!r}: {exc}") from None
        if not (math.isfinite(link) and link > 0) or args.ranks < 1 or args.ranks_per_node < 1:
            raise ValueError(
                f"--link, --ranks and --ranks-per-node must be positive, got {args.link!r}, {args.ranks}, "
                f"{args.ranks_per_node}"
            )
        if not (math.isfinite(args.latency_us) and args.latency_us >= 0):
            raise ValueError(f"--latency-us must be a number >= 0, got {args.latency_us}")
        if args.compute_ms is not None and not (math.isfinite(args.compute_ms) and args.compute_ms > 0):
            raise ValueError(f"--compute-ms must be a number > 0, got {args.compute_ms}")
        if args.batch is not None and args.batch < 1:
            raise ValueError(f"--batch must be at least 1, got {args.batch}")
        if not 0 < args.density <= 1:
            raise ValueError(f"--density must be in (0, 1], got {args.density}")
        if args.plot and benchmark.not_a_new_file(args.plot):
            raise ValueError(f"--plot {args.plot!r}: expected a file in an existing folder")
        if os.path.exists(args.workload):
            with open(args.workload) as f:
                counts = [float(v) for v in f.read().replace(",", " ").split()]
            if not counts or not all(math.isfinite(c) and c == int(c) and c > 0 for c in counts):
                raise ValueError(f"{args.workload}: expected whole, positive element counts")
            # (given in the model's order; backward produces them last first)
            sizes = [int(c) * 4 for c in reversed(counts)]
            v100 = None
        else:
            sizes = model.workload_sizes(args.workload)
            v100 = model.V100[args.workload]
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        parser.error(str(exc))
    if args.compute_ms is None and v100 is None:
        parser.error("--compute-ms is needed for a workload given as a file")
    batch = args.batch if args.batch is not None else v100["batch"] if v100 else 1
    compute_s = args.compute_ms / 1e3 if args.compute_ms is not None else batch / v100["images_per_s"]
    cal = model.cluster(
        base, link, args.latency_us * 1e-6, args.ranks_per_node, gpu=not args.cpu, transport=args.transport
    )
    rows = model.predict(sizes, args.ranks, args.ranks_per_node, compute_s, batch, cal, args.density)
    print(
        f"{args.workload}: {sum(sizes) / 2**20:.1f} MiB of fp32 gradients in {len(sizes)} tensors; "
        f"{args.ranks} ranks, {args.ranks_per_node} per node, {args.link} and {args.latency_us:g} us "
        f"between nodes; compute {compute_s * 1e3:.1f} ms per step, batch {batch} per rank"
        + ("" if args.cpu else f"; device buffers {args.transport}")
    )
    print(
        f"calibration: {base.source}; gflow's own cost per ring step {base.py_step * 1e6:.2f} us, per call "
        f"{base.py_call * 1e6:.1f} us, per recursive-doubling round {base.rd_step * 1e6:.1f} us"
    )
    shares = {
        algorithm: model.python_share(
            4 * 2**20, args.ranks, ranks_per_node=args.ranks_per_node, algorithm=algorithm, calibration=cal
        )
        for algorithm in ("ring", "hierarchical")
    }
    print(
        f"gflow's own share of one 4 MiB allreduce at {args.ranks} ranks: flat ring {shares['ring']:.0%}, "
        f"hierarchical {shares['hierarchical']:.0%}"
    )
    print(
        f"{'technique':<40} {'comm/step':>10} {'iteration':>10} {'images/s':>10} {'speedup':>8} {'eff.':>6}"
    )
    for row in rows:
        print(
            f"{row['technique']:<40} {row['comm_s'] * 1e3:8.1f}ms {row['iteration_s'] * 1e3:8.1f}ms "
            f"{row['images_per_s']:10.0f} {row['speedup']:7.1f}x {row['efficiency']:6.0%}"
        )
    if args.plot:
        _plot_model(args, sizes, compute_s, batch, cal)
    return 0


def _plot_model(args, sizes, compute_s, batch, cal) -> None:
    from . import cost_model as model

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    ranks = [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if r <= max(args.ranks, 8)]
    fig, ax = plt.subplots(figsize=(7, 5))
    per_rank = [
        model.predict(sizes, r, min(args.ranks_per_node, r), compute_s, batch, cal, args.density)
        for r in ranks
    ]
    for i, row in enumerate(per_rank[0]):  # one line per technique, the first dashed (the baseline)
        speedups = [rows[i]["speedup"] for rows in per_rank]
        ax.plot(ranks, speedups, marker="o", ms=3, label=row["technique"], ls="-" if i else "--")
    ax.plot(ranks, ranks, color="gray", lw=1, ls=":", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("speedup over one rank")
    ax.set_title(f"gflow model: {args.workload}, {args.ranks_per_node} per node, {args.link}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def bench_command(parser, args) -> int:
    from mpi4py import MPI

    try:
        benchmark.check_arguments(args)
        error = None
    except ValueError as exc:
        error = str(exc)
    rejected = MPI.COMM_WORLD.allgather(error is not None)  # every rank stops if any rank's are bad
    if error is not None and (MPI.COMM_WORLD.rank == rejected.index(True)):
        parser.error(error)  # one message, from the first rank that refused
    if any(rejected):
        return 2
    return benchmark.run(args)


def timeline_command(parser, args) -> int:
    from ..runtime import timeline

    try:
        if args.action == "merge":
            count = timeline.merge(args.files, args.out)
            print(f"wrote {args.out}: {count} events from {len(args.files)} file(s)")
        else:
            if len(args.files) != 1:
                raise ValueError("plot takes one trace (merge the ranks' files first)")
            timeline.plot(args.files[0], args.out, args.start_ms, args.end_ms)
            print(f"wrote {args.out}")
    except ImportError:
        parser.error("plot needs matplotlib (pip install matplotlib)")
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="allreduce with gflow and with MPI's own, side by side (run under mpiexec)",
        description="gflow's allreduce beside MPI's own Allreduce on random float32 data: each result "
        "checked against float64 and across ranks, both timed (medians, alternating). Run it under "
        "mpiexec, e.g. `mpiexec -n 4 python -m gflow demo`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument(
        "--sizes",
        type=benchmark.size_list_argument,
        default="4K,64K,1M,4M,16M",
        help="message sizes (K/M/G suffixes), comma-separated",
    )
    d.add_argument("--repeats", type=_positive_int, default=15, help="timed rounds per size (at least 1)")
    b = sub.add_parser(
        "bench",
        help="allreduce bandwidth over a range of sizes, nccl-tests style (run under mpiexec)",
        description=benchmark.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benchmark.add_arguments(b)
    t = sub.add_parser("timeline", help="merge the ranks' timeline files, or plot one (PNG)")
    t.add_argument("action", choices=["merge", "plot"])
    t.add_argument("files", nargs="+", help="merge: every rank's file; plot: one (merged) trace")
    t.add_argument("-o", "--out", required=True, help="the merged trace (JSON) or the picture (PNG)")
    t.add_argument("--start-ms", type=float, help="plot: from this time (ms after the first span)")
    t.add_argument("--end-ms", type=float, help="plot: up to this time")
    sub.add_parser(
        "info",
        help="versions, MPI library and thread level, GPU seen or not",
        description="What this installation sees: gflow's and its packages' versions, the MPI library, "
        "its thread level and launcher, and a GPU if any. Paste it into bug reports.",
    )
    sub.add_parser(
        "compile",
        help="compile gflow's loops and kernels into Numba's cache, once per installation",
        description=precompile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c = sub.add_parser("calibrate", help="measure the cost model's constants (run under mpiexec)")
    c.add_argument("--out", default="gflow-calibration.json", help="the JSON file to write")
    c.add_argument(
        "--install", action="store_true", help="also make it the default calibration of `gflow model`"
    )
    c.add_argument(
        "--device",
        action="store_true",
        help="also measure the device terms on rank 0's GPU: a kernel launch with its stream sync, and "
        "pinned copies between host and device (without it, the model assumes them)",
    )
    m = sub.add_parser("model", help="predict allreduce and step times at scale from a calibration")
    m.add_argument("--ranks", type=int, required=True)
    m.add_argument("--ranks-per-node", type=int, default=8)
    m.add_argument("--link", default="56gbit", help="between nodes, per node: e.g. 56gbit, 10gbit")
    m.add_argument("--latency-us", type=float, default=5.0, help="between nodes (default 5: InfiniBand)")
    m.add_argument(
        "--workload",
        default="alexnet",
        help="alexnet, resnet50, or a file of each gradient's element count, first layer first",
    )
    m.add_argument(
        "--compute-ms", type=float, help="compute per step (default: a V100's, see gflow/tools/cost_model.py)"
    )
    m.add_argument("--batch", type=int, help="images per rank per step")
    m.add_argument("--density", type=float, default=0.01, help="CSC's density for the CSC row")
    m.add_argument("--calibration", help="a `gflow calibrate` JSON (default: the last one, else defaults)")
    m.add_argument(
        "--cpu", action="store_true", help="ranks on CPUs: keep the calibration's per-element costs"
    )
    m.add_argument(
        "--transport",
        choices=("direct", "staged"),
        default="direct",
        help="how device buffers reach MPI: direct (a CUDA-aware MPI) or staged through host memory",
    )
    m.add_argument(
        "--plot",
        default="gflow-model.png",
        help="speedup against ranks, a PNG (default gflow-model.png; '' for none)",
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "calibrate":
        return calibrate_command(args)
    if args.command == "compile":
        return precompile.run()
    if args.command == "model":
        return model_command(m, args)
    if args.command == "bench":
        return bench_command(b, args)
    if args.command == "timeline":
        return timeline_command(t, args)
    return demo(args.sizes, args.repeats)


def _positive_int(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return number
