"""A job one of whose ranks fails: run by test_failures.py under mpiexec (not collected by pytest).

argv: the mode (see below), then the failing rank. Every rank first does one good blocking and one
good async allreduce, so that the communicators exist. The failing rank prints "failing at <time>"
just before it fails, so the test can time how long the others take to end."""

import re
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import gflow
from gflow.runtime import failures

mode, failing = sys.argv[1], int(sys.argv[2])
if mode.endswith("-over-mpi"):  # (the agreement's messages over MPI, as across hosts: no slots)
    gflow.config.shared_slots = False
world = MPI.COMM_WORLD
me = world.rank
x = np.random.default_rng(me).standard_normal(1 << 20).astype(np.float32)  # 4 MB
gflow.allreduce(x)
gflow.allreduce_async(x).wait()
sizes = [1 << 16] * 8  # a lazy step of 8 gradients, 2 MB in all, fired in segments of 512 KiB
lazy = gflow.LazyAllreduce(threshold_bytes=1 << 19)
grads = [
    np.random.default_rng(me + 10 * i).standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)
]
for g in grads:
    lazy.push(g)
lazy.flush()
if me == 0:  # MPICH's shared-memory file of this node, which the job's abort must remove
    print(f"segments: {' '.join(sorted(failures.mpich_segments()))}", flush=True)
world.Barrier()  # read before any rank fails (a failing rank's abort removes the file: CI once saw none)


def fail(how):
    print(f"rank {me} failing at {time.time():.3f}", flush=True)
    if how == "raise":
        raise ValueError(f"a bad batch on rank {me}")
    sys.exit(0)


how = "raise" if mode.startswith("raise") else "exit"
if mode in ("ok", "ok-finalize"):  # no failure: the ranks end at different times, nobody is told
    for _ in range(3):  # anyone left (and with "ok-finalize", each calls MPI.Finalize() itself)
        gflow.allreduce(x)
    lazy.push(grads[0])
    lazy.flush()
    time.sleep(0.5 * me)
    if mode == "ok-finalize":
        MPI.Finalize()
elif mode in ("raise", "exit"):  # before a collective: the others enter a 4 MB allreduce
    if me == failing:
        time.sleep(0.5)  # the others are waiting in it
        fail(how)
    gflow.allreduce(x)
elif mode == "exit-early":  # the others enter a collective after the rank has left
    if me == failing:
        fail(how)
    time.sleep(1.0)
    gflow.allreduce(x)
elif mode == "exit-inside":  # leaving from inside a blocking allreduce (a signal handler's exit)
    if me == failing:
        signal.signal(signal.SIGALRM, lambda *_: fail("exit"))
        signal.setitimer(signal.ITIMER_REAL, 0.3)
    else:
        time.sleep(2.0)  # the failing rank waits for these inside the allreduce
    gflow.allreduce(x)
elif mode in ("retry-async", "retry-lazy"):  # the others catch the error, retry, and must fail again
    if me == failing:
        fail("exit")
    for attempt in range(3):
        start = time.monotonic()
        try:
            if mode == "retry-async":
                gflow.allreduce_async(x).wait()
            else:
                for g in grads:
                    lazy.push(g)
                lazy.flush()
        except gflow.GflowError as exc:  # a short line: the launcher may interleave long ones
            # (rank 1, or ranks 1, 2 when another rank finished its retries and left meanwhile)
            named = re.search(r"ranks? (\d+, )*1(, \d+)* ha(s|ve) left the job", str(exc)) is not None
            took = time.monotonic() - start
            print(f"[rank {me} attempt {attempt}: {took:.1f} s, named {named}]", flush=True)
    print(f"rank {me} done retrying", flush=True)  # and exits 0: Open MPI's mpiexec would kill
    # the others at once when the first rank exits non-zero
elif mode == "exit-before-async":  # the others' first async call on a communicator, without it
    sub = world.Split(0, me)
    gflow.allreduce(x, comm=sub)
    if me == failing:
        fail(how)
    time.sleep(0.5)
    gflow.allreduce_async(x, comm=sub).wait()
elif mode == "exit-after-freeing":  # it frees a communicator the others call on again (an error of the
    # program's, met over TCP: MPI_Comm_free is collective), so says goodbye on the world's only
    sub = world.Split(0, me)
    gflow.allreduce(x, comm=sub)
    if me == failing:
        sub.Free()
        fail(how)
    time.sleep(0.5)
    gflow.allreduce(x, comm=sub)
elif mode in ("exit-before-first-async", "exit-before-first-blocking"):  # the others' first call on a
    # communicator it never used: it said goodbye on the world's channel only (stall.hear_elsewhere)
    sub = world.Split(0, me)
    if me == failing:
        fail(how)
    time.sleep(0.5)
    if mode.endswith("async"):
        gflow.allreduce_async(x, comm=sub).wait()
    else:
        gflow.allreduce(x, comm=sub)
elif mode == "exit-before-blocking":  # the others' first blocking call on a communicator whose
    # calls were all async (a trainer's steps, then a metric on some ranks): its goodbye went out on
    # the background channel only
    sub = world.Split(0, me)
    gflow.allreduce_async(x, comm=sub).wait()
    if me == failing:
        fail(how)
    time.sleep(0.5)
    gflow.allreduce(x[:1], comm=sub)
elif mode in ("raise-async", "exit-async"):  # with an async allreduce in flight on this rank: an
    # exception ends the job; an exit lets the engine finish it first (the others are on their way)
    if me != failing:
        time.sleep(1.0)
    handle = gflow.allreduce_async(x)
    if me == failing:
        time.sleep(0.3)  # the engine is waiting for the others
        fail(how)
    handle.wait()
elif mode == "exit-unwaited":  # an async allreduce on this rank alone, never waited for: exit says so
    if me == failing:
        gflow.allreduce_async(x[:1000])
    print(f"rank {me} finished", flush=True)
elif mode == "exit-unwaited-failed":  # the same, failed before this rank's exit (the others left first)
    if me == failing:
        handle = gflow.allreduce_async(x[:1000])
        while not handle.done():
            time.sleep(0.01)
    print(f"rank {me} finished", flush=True)
elif mode in ("raise-lazy", "exit-lazy"):  # in the middle of a lazy step: half of it pushed
    for i, g in enumerate(grads):
        if me == failing and i == len(grads) // 2:
            fail(how)
        lazy.push(g)
    lazy.flush()
elif mode == "exit-in-flush":  # leaving from inside flush(): what it pushed is still reduced
    if me == failing:
        signal.signal(signal.SIGALRM, lambda *_: fail("exit"))
        signal.setitimer(signal.ITIMER_REAL, 0.3)
    else:
        time.sleep(1.5)  # the failing rank is inside flush, waiting for these
    for g in grads:
        lazy.push(g)
    lazy.flush()
    print(f"rank {me} finished the step", flush=True)
    gflow.allreduce(x)  # the rank that left is not here
elif mode.startswith("exit-after-refused-in-join"):  # the failing rank's only calls on a communicator:
    # an async sparse step, refused beside the joined others, whose channel it drops; then it leaves.
    # ("-caught": the others catch the error and end normally)
    sub = world.Split(0, me)
    if me == failing:
        try:
            step = gflow.LazyAllreduce(comm=sub, sparse={"density": 0.5})
            step.push(x[:64].copy())
            step.flush()
        except gflow.GflowError as refused:
            print(f"rank {me} refused: {refused}", flush=True)
        time.sleep(0.5)  # the others serve a fresh background channel, waiting for this rank
        fail(how)
    from gflow.collectives.join import join

    try:
        join(sub)
    except gflow.GflowError as error:
        if not mode.endswith("-caught"):
            raise
        print(f"rank {me} caught: {error}", flush=True)
elif mode.startswith("exit-in-join"):  # the others are in join(), serving the failing rank's calls
    if me == failing:
        time.sleep(0.5)
        fail("exit")
    from gflow.collectives import join
    from gflow.runtime.context import context

    join.serve(context(world))
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {me} finished", flush=True)
