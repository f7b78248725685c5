"""`gflow compile`: compile gflow's Numba loops and kernels into Numba's cache ahead of a job.

A job's first collectives compile what they use, on every rank at once: about 2 s per loop and
element type here, 80 s for all of them. Where ranks outnumber cores, the ranks already waiting slow
the compiling ones further: the test suite's 4-rank batch took 430 s from a cold cache and 143 s from
a warm one, on 2 cores. Compiled once per installation (Numba keeps its cache beside the sources,
else in the user's cache folder, or in NUMBA_CACHE_DIR), they load in milliseconds in every later
process. Under `mpiexec -n N` the ranks share the work.
"""

import time


def signatures() -> list:
    """(dispatcher, argument types) of every loop and kernel gflow compiles for the host, once each."""
    from ..arrays import half_kernels
    from ..collectives import native

    return list(dict.fromkeys(native.loop_signatures() + half_kernels.kernel_signatures()))


def compile_part(every: list, part: int, parts: int) -> tuple:
    """Compile (or load from the cache) every signature in `every` of every parts-th function from
    part; (compiled, loaded). Whole functions: Numba rewrites a function's cache index without a lock,
    so two processes saving signatures of one function at once can lose one or mix them (helper-90)."""
    mine = list(dict.fromkeys(dispatcher for dispatcher, _ in every))[part::parts]
    compiled = loaded = 0
    for dispatcher, types in (each for each in every if each[0] in mine):
        hits = sum(dispatcher.stats.cache_hits.values())
        dispatcher.compile(types)
        if sum(dispatcher.stats.cache_hits.values()) > hits:
            loaded += 1
        else:
            compiled += 1
    return compiled, loaded


def run() -> int:
    """The command: this rank's share, then rank 0 says what was done, in how long and where."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    started = time.perf_counter()
    every = signatures()
    counts = comm.gather(compile_part(every, comm.rank, comm.size), root=0)
    if comm.rank == 0:
        compiled, loaded = (sum(c[i] for c in counts) for i in (0, 1))
        where = every[0][0].stats.cache_path
        print(
            f"gflow compile: {compiled} compiled, {loaded} already in Numba's cache, on {comm.size} "
            f"process(es), in {time.perf_counter() - started:.1f} s (cache: {where})"
        )
    return 0
