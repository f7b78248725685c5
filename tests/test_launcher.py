"""A launcher of another MPI library (a system Open MPI's mpiexec starting the MPICH wheel's processes,
or MPICH's starting an Open MPI build) leaves every rank alone in a world of one: n trainings, each
believing it is the job. gflow names it at import and in `gflow info` (gflow/runtime/mpi.py)."""

import os
import subprocess
import sys

import pytest
from helpers import WORLD

from gflow.runtime.mpi import launcher, launcher_mismatch, mpi_library

LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HYDI_CONTROL_FD", "SLURM_STEP_NUM_TASKS")


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI's mpiexec as one of 4 ranks"),
        ({"PMI_SIZE": "3", "HYDI_CONTROL_FD": "7"}, "MPICH's mpiexec (Hydra) as one of 3 ranks"),
        ({"SLURM_STEP_NUM_TASKS": "8"}, "Slurm's srun as one of 8 ranks"),
    ],
)
def test_several_ranks_launched_but_a_world_of_one_is_named(monkeypatch, variables, named):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert launcher() == ("none", 0) and launcher_mismatch() is None  # a process on its own: all well
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    message = launcher_mismatch()
    assert message is not None and named in message and "sees a world of 1" in message, message
    right = "Open MPI's own" if mpi_library().startswith("Open MPI") else ".venv/bin/mpiexec"
    assert right in message, message  # the launcher to use instead, for the library mpi4py loaded


def test_the_library_is_named_in_one_printable_line(monkeypatch):
    # Open MPI ends its version string with the C string's NUL, which `gflow info` printed (bash then
    # warned "ignored null byte" in .ci/openmpi); MPICH pads its line with spaces.
    named = mpi_library()
    assert named and named.isprintable() and named == named.strip(), repr(named)
    for raw in ("Open MPI v4.1.4, package: Debian OpenMPI\0", "MPICH Version:      5.0.2   \nMPICH Release"):
        monkeypatch.setattr("mpi4py.MPI.Get_library_version", lambda raw=raw: raw)
        named = mpi_library()
        assert named.isprintable() and "  " not in named and named == named.strip(), repr(named)


def test_a_slurm_batch_script_is_no_launch(monkeypatch):
    # sbatch -n 4 sets the job's SLURM_NTASKS and SLURM_PROCID in the batch script itself: a process
    # started there alone (data preparation, `gflow info`) is not a rank of a step.
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert launcher() == ("none", 0) and launcher_mismatch() is None


def test_no_check_before_mpi_is_started():
    # mpi4py.rc.initialize = False: the program starts MPI itself, after importing gflow.
    code = (
        "import mpi4py; mpi4py.rc.initialize = False; import gflow; "
        "from mpi4py import MPI; print(MPI.Is_initialized())"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.parallel([2, 3])
def test_the_right_launcher_is_not_flagged():
    name, ranks = launcher()
    assert ranks == WORLD.size and launcher_mismatch() is None, (name, ranks)


def test_import_warns_and_info_says_so():
    # A launcher's variables that the MPICH wheel does not read: the process starts alone, as it does
    # under another library's launcher (the real Open MPI's mpiexec also sets PMIx variables, on which
    # MPICH's MPI_Init itself stops with "unsupported PMI version PMIx": README, "On a cluster").
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("PMI")}
    env["OMPI_COMM_WORLD_SIZE"] = "4"
    done = subprocess.run(
        [sys.executable, "-c", "import gflow"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "as one of 4 ranks" in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "gflow", "info"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "LAUNCHER MISMATCH" in done.stdout and "Open MPI's mpiexec (4 ranks)" in done.stdout, done.stdout
    # the demo fails, where each rank ran its own one-rank demo and called it correct (helper-65)
    done = subprocess.run(
        [sys.executable, "-m", "gflow", "demo"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "sees a world of 1" in done.stderr, done.stdout + done.stderr
    assert "correct" not in done.stdout, done.stdout
