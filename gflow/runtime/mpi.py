"""The MPI library underneath, in words: for messages that say which library and thread level gflow got."""

from mpi4py import MPI


def mpi_library() -> str:
    """The MPI library mpi4py runs on, in a line ("MPICH Version: 5.0.2", "Open MPI v4.1.4, ...")."""
    return MPI.Get_library_version().splitlines()[0].strip()


def thread_level_name(level: int) -> str:
    """'MPI_THREAD_MULTIPLE' for MPI.THREAD_MULTIPLE, and so on."""
    names = {
        MPI.THREAD_SINGLE: "SINGLE",
        MPI.THREAD_FUNNELED: "FUNNELED",
        MPI.THREAD_SERIALIZED: "SERIALIZED",
        MPI.THREAD_MULTIPLE: "MULTIPLE",
    }
    return "MPI_THREAD_" + names.get(level, str(level))
