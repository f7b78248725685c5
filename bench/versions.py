"""Two versions of gflow side by side: `python -m gflow bench` from this tree and from another
checkout (an earlier commit), alternated run by run, so that a change's cost on the data path is
measured against the machine's drift rather than against a figure from another day.

    git worktree add /tmp/base <commit>
    python bench/versions.py --baseline /tmp/base --procs 2 4 -b 4K -e 64K --rounds 5

Each round runs the baseline and this tree once each (in alternating order), every size -n timed
calls; the figure per version and size is the median over rounds of each run's median time. Writes
bench/out/versions.json and prints a table with the ratio this tree / baseline (below 1: faster).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(HERE, "bench", "out")


def run(tree: str, procs: int, args) -> dict:
    """One `gflow bench` job with gflow imported from `tree`; {bytes: median seconds}."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "bench.json")
        command = [_common.mpiexec(), "-n", str(procs), sys.executable, "-m", "gflow", "bench"]
        command += ["-b", args.b, "-e", args.e, "-f", "2", "-n", str(args.n), "-w", "10", "--json", path]
        subprocess.run(command, check=True, env=env, cwd=scratch, capture_output=True, timeout=1800)
        rows = json.load(open(path))["rows"]
    return {row["bytes"]: row["time_us"] * 1e-6 for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="a checkout of the version to compare with")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("-b", default="4K")
    parser.add_argument("-e", default="64K")
    parser.add_argument("-n", type=int, default=200, help="timed calls per size and run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    trees = {"baseline": os.path.abspath(args.baseline), "this tree": HERE}
    results = {}
    for procs in args.procs:
        times = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                times[name].append(run(trees[name], procs, args))
            print(f"p={procs}: round {r + 1}/{args.rounds}", flush=True)
        results[procs] = {
            name: {size: float(np.median([t[size] for t in runs])) for size in runs[0]}
            for name, runs in times.items()
        }
        base = {size: [t[size] for t in times["baseline"]] for size in times["baseline"][0]}
        # how much the baseline's runs differ among themselves: (max - min) / median
        results[procs]["spread"] = {size: float(np.ptp(ts) / np.median(ts)) for size, ts in base.items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "versions.json"), "w") as f:
        json.dump({"machine": _common.machine(), "args": vars(args), "results": results}, f, indent=1)
    print("| p | size | baseline (us) | this tree (us) | this / baseline | baseline's run-to-run range |")
    print("|---|---|---|---|---|---|")
    for procs, res in results.items():
        for size in res["baseline"]:
            base, new = res["baseline"][size], res["this tree"][size]
            print(
                f"| {procs} | {size // 1024} KiB | {base * 1e6:.1f} | {new * 1e6:.1f} | {new / base:.3f} | "
                f"{res['spread'][size]:.1%} |"
            )


if __name__ == "__main__":
    main()
