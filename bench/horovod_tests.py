"""Run Horovod's own PyTorch test file (test/parallel/test_torch.py) against gflow.torch: the measure of
"drop-in" (issue 28). Horovod's file is not part of gflow; pass its path:

    python bench/horovod_tests.py /path/to/horovod/test/parallel/test_torch.py --procs 2

The file runs unmodified. What this script puts around it, in a scratch folder on the PYTHONPATH:
  - a `horovod.torch` package that only re-exports gflow.torch (every public name);
  - the three helpers it imports from Horovod's test/utils/common.py (rank and size from the
    launcher's environment, skip a GPU test, a temporary path), written here;
  - two shims for Python and torch APIs removed since the file was written, nothing of Horovod's
    behaviour: inspect.getargspec (gone in Python 3.11) and torch.FatalError (where torch lacks it).
Each test runs in its own `mpiexec -n P` launch (a hang fails that test after --timeout seconds and
the run goes on). The file is copied into that folder first, so that Horovod's own helpers beside
it stay out of the way; a test passes when it passes on every rank, skips when it skips on every rank.
Prints one line per test as it goes, then the summary and the failures' first lines; --json
writes the per-test results.
"""

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HOROVOD_TORCH = '''"""horovod.torch for Horovod's tests: gflow.torch, re-exported."""
import gflow.torch as _gflow_torch
from gflow.torch import *  # noqa: F401,F403

globals().update({k: getattr(_gflow_torch, k) for k in dir(_gflow_torch) if not k.startswith("__")})
'''

COMMON = '''"""The helpers Horovod's test_torch.py imports from its test/utils/common.py (gflow's own)."""
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "file")
    try:
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)
'''

SHIMS = '''"""Python and torch APIs that Horovod's older test file uses and that no longer exist."""
import inspect

if not hasattr(inspect, "getargspec"):
    inspect.getargspec = inspect.getfullargspec
import torch

if not hasattr(torch, "FatalError"):
    class FatalError(RuntimeError):
        pass

    torch.FatalError = FatalError
torch.set_num_threads(1)
'''


def test_names(path: str) -> list:
    """The test methods of the file's TestCase classes, as pytest node ids (in file order)."""
    tree = ast.parse(open(path).read())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            seen = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    seen[item.name] = None  # (a later definition replaces an earlier one)
            names += [f"{node.name}::{name}" for name in seen]
    return names


def outcome(xml_path: str) -> tuple:
    """(passed|failed|skipped|error, first line of the message) of the one test in a junit file."""
    if not os.path.exists(xml_path):
        return "missing", ""
    case = ET.parse(xml_path).getroot().find(".//testcase")
    if case is None:
        return "missing", ""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or node.text or "").strip().splitlines()
            return ("skipped" if tag == "skipped" else "failed"), (message[0] if message else "")[:300]
    return "passed", ""


def run_one(folder: str, test_file: str, node: str, procs: int, timeout: float, mpiexec: str) -> tuple:
    for f in os.listdir(folder):
        if f.startswith("result."):
            os.remove(os.path.join(folder, f))
    rank_var = "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"
    command = (
        f"exec {sys.executable} -m pytest -q -p no:cacheprovider "
        f"-p shims --junitxml={folder}/result.{rank_var}.xml '{test_file}::{node}'"
    )
    env = dict(os.environ, PYTHONPATH=folder + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [mpiexec, "-n", str(procs), "bash", "-c", command],
            env=env, cwd=folder, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-f", f"result.*{node.split('::')[-1]}"], check=False)
        return "failed", f"timed out after {timeout:.0f} s (a hang)", time.perf_counter() - start
    results = [outcome(os.path.join(folder, f"result.{r}.xml")) for r in range(procs)]
    kinds = {k for k, _ in results}
    message = next((m for k, m in results if k == "failed" and m), "") or " | ".join(tail)[-300:]
    if kinds == {"passed"}:
        kind = "passed"
    elif kinds == {"skipped"}:
        kind, message = "skipped", results[0][1]
    else:
        kind = "failed"
    return kind, message, time.perf_counter() - start


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("test_file", help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test launch")
    parser.add_argument("-k", dest="only", default="", help="run only tests whose name contains this")
    parser.add_argument("--json", help="write the per-test results here")
    parser.add_argument("--mpiexec", default=shutil.which("mpiexec", path=os.path.dirname(sys.executable)))
    args = parser.parse_args()
    test_file = os.path.abspath(args.test_file)
    folder = tempfile.mkdtemp(prefix="horovod_tests_")
    os.makedirs(os.path.join(folder, "horovod", "torch"))
    open(os.path.join(folder, "horovod", "__init__.py"), "w").close()
    with open(os.path.join(folder, "horovod", "torch", "__init__.py"), "w") as f:
        f.write(HOROVOD_TORCH)
    with open(os.path.join(folder, "common.py"), "w") as f:
        f.write(COMMON)
    with open(os.path.join(folder, "shims.py"), "w") as f:
        f.write(SHIMS)
    names = [n for n in test_names(test_file) if args.only in n]
    # A copy beside the helpers (pytest puts the test's own folder first on sys.path, where
    # Horovod's test/utils may be).
    shutil.copy(test_file, os.path.join(folder, "test_torch.py"))
    test_file = os.path.join(folder, "test_torch.py")
    results = {}
    for i, node in enumerate(names, 1):
        kind, message, seconds = run_one(folder, test_file, node, args.procs, args.timeout, args.mpiexec)
        results[node] = {"outcome": kind, "message": message, "seconds": round(seconds, 1)}
        print(f"[{i}/{len(names)}] {kind:7s} {seconds:5.1f}s {node}", flush=True)
    ran = [r for r in results.values() if r["outcome"] != "skipped"]
    passed = sum(r["outcome"] == "passed" for r in ran)
    skipped = len(results) - len(ran)
    share = 100.0 * passed / len(ran) if ran else 0.0
    print(
        f"\n{passed} of {len(ran)} tests that do not skip pass ({share:.1f}%); {skipped} skipped; "
        f"{len(ran) - passed} failed; at {args.procs} ranks"
    )
    for node, r in results.items():
        if r["outcome"] not in ("passed", "skipped"):
            print(f"  FAILED {node}: {r['message']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"procs": args.procs, "file": test_file, "results": results}, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
