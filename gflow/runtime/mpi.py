"""The MPI library underneath, in words: for messages that say which library and thread level gflow
got, and which launcher started the job (a launcher of another library is the commonest first-run
mistake: every rank then runs alone)."""

import os

from mpi4py import MPI


def mpi_library() -> str:
    """The MPI library mpi4py runs on, in a line ("MPICH Version: 5.0.2", "Open MPI v4.1.4, ...")."""
    # MPICH pads the line with spaces; Open MPI ends it with its C string's NUL.
    return " ".join(MPI.Get_library_version().replace("\0", " ").splitlines()[0].split())


def thread_level_name(level: int) -> str:
    """'MPI_THREAD_MULTIPLE' for MPI.THREAD_MULTIPLE, and so on."""
    names = {
        MPI.THREAD_SINGLE: "SINGLE",
        MPI.THREAD_FUNNELED: "FUNNELED",
        MPI.THREAD_SERIALIZED: "SERIALIZED",
        MPI.THREAD_MULTIPLE: "MULTIPLE",
    }
    return "MPI_THREAD_" + names.get(level, str(level))


def launcher() -> tuple[str, int]:
    """(the launcher that started this process, as its environment tells; the ranks it started, or
    0 where no launcher's variables are set: a process started on its own, MPI's "singleton")."""
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "Open MPI's mpiexec", int(env["OMPI_COMM_WORLD_SIZE"])
    if "PMI_SIZE" in env:
        name = "MPICH's mpiexec (Hydra)" if "HYDI_CONTROL_FD" in env else "a PMI launcher (Slurm's srun?)"
        return name, int(env["PMI_SIZE"])
    if "SLURM_STEP_NUM_TASKS" in env:  # (an srun step's own: a batch script also has SLURM_NTASKS)
        return "Slurm's srun", int(env["SLURM_STEP_NUM_TASKS"])
    return "none", 0


def launcher_mismatch() -> str | None:
    """What is wrong where the launcher started several ranks but MPI sees a world of one: the
    launcher belongs to another MPI library than the one mpi4py loaded, so every rank runs alone,
    each believing it is the whole job (n independent trainings, silently). None where all is well."""
    if not MPI.Is_initialized() or MPI.Is_finalized():  # (mpi4py.rc.initialize = False: not yet told)
        return None
    name, ranks = launcher()
    world = MPI.COMM_WORLD.Get_size()
    if ranks > 1 and world == 1:
        library = mpi_library()
        if library.startswith("Open MPI"):
            right = "Open MPI's own (mpiexec.openmpi on Debian and Ubuntu)"
        else:  # (the MPICH wheel, gflow's default)
            right = "for the MPICH wheel, the environment's own (.venv/bin/mpiexec, or activate it first)"
        return (
            f"this process was started by {name} as one of {ranks} ranks, but MPI ({library}) sees a world "
            "of 1: the launcher belongs to another MPI library than the one mpi4py uses, so each rank would "
            f"run alone. Start the job with the launcher of mpi4py's library: {right}"
        )
    return None
