"""gflow.torch jobs for test_torch_runtime.py, run under mpiexec (not collected by pytest).

argv: the mode (see below). Once every rank has loaded torch, each arms a watchdog: a rank still
running CASE_DEADLINE_S (default 20) seconds later prints its stack and exits, so a hang fails its
test within seconds of the start, however long the ranks took to import torch. CASE_CROSSED_S, where
set, is how long a blocking wait lasts before the stall inspector checks it for crossed waits (1 s).
"""

import faulthandler
import os
import sys
import time

import torch
from mpi4py import MPI

import gflow
import gflow.torch as hvd
from gflow.runtime import stall

torch.set_num_threads(1)
stall.CROSSED_S = float(os.environ.get("CASE_CROSSED_S", stall.CROSSED_S))
world = MPI.COMM_WORLD
me, p = world.rank, world.size
mode = sys.argv[1]
world.Barrier()  # every rank has imported torch: the deadline counts from here
faulthandler.dump_traceback_later(float(os.environ.get("CASE_DEADLINE_S", "20")), exit=True)


def say(text: str) -> None:
    sys.stdout.write(f"[rank {me}: {text}]\n")  # one write: the launcher interleaves separate ones
    sys.stdout.flush()


if mode == "init-lists":  # the last rank passes another list of ranks than the others
    ranks = list(range(p)) if me == p - 1 else list(range(p - 1))
    try:
        hvd.init(comm=ranks)
    except ValueError as exc:
        say(f"ValueError: {exc}")
    else:
        say("initialised")
elif mode == "init-bad-rank":  # rank 0 names a rank COMM_WORLD does not have; the others agree
    ranks = [0, p + 5] if me == 0 else list(range(p))
    try:
        hvd.init(comm=ranks)
    except ValueError as exc:
        say(f"ValueError: {exc}")
    else:
        say("initialised")
elif mode == "init-odd":  # rank 0 passes another form of comm= than the others' list of every rank
    import numpy as np

    forms = {"None": None, "WORLD": world, "range": range(p), "ndarray": np.arange(p), "set": set(range(p)),
             "str": "0,1"}  # fmt: skip
    for form in sys.argv[2].split(","):  # one after another in one job (each init after a shutdown)
        try:
            hvd.init(comm=forms[form] if me == 0 else list(range(p)))
        except ValueError as exc:
            say(f"{form}: ValueError: {exc}")
        else:
            say(f"{form}: initialised on {hvd.size()} ranks")
            hvd.shutdown()
elif mode == "barrier-exit":  # rank 1 ends its program cleanly; the others call barrier()
    hvd.init()
    if me == 1:
        say("leaving")
        sys.exit(0)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        hvd.barrier()
    except gflow.GflowError as exc:
        named = "rank 1 has left the job" in str(exc)
        horovod = isinstance(exc, hvd.HorovodInternalError)
        say(f"barrier raised after {time.monotonic() - start:.1f} s, named {named}, horovod {horovod}")
        say(f"its error: {str(exc).splitlines()[0][:400]}")  # (what a failure shows: CI, stop 66)
    else:
        say("barrier returned")
elif mode == "barrier-late":  # the last rank comes to barrier() long after the others
    hvd.init()
    if me == p - 1:
        time.sleep(float(sys.argv[2]))
    hvd.barrier()
    say("finished")
elif mode == "homogeneous":  # only rank 0 asks (a local query in Horovod); then all reduce
    hvd.init()
    if me == 0:
        say(f"homogeneous {hvd.is_homogeneous()}")
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    sizes = world.allgather(hvd.local_size())
    say(f"sum {total.item():g}, expected homogeneous {len(set(sizes)) == 1}")
elif mode == "metric":  # a metric reduced between backward and step (issue 24, item 11)
    # Each episode on a communicator of its own (a failed one is left behind): who reduces it ("rank0"
    # or "all"); in the first step or the third (when the optimizer's background channel exists);
    # threshold 1 (every gradient sent during backward) or 1 MiB (everything sent at step). Rank 0
    # alone: crossed waits, an error on every rank. Every rank: it works.
    episodes = [("rank0", w, t) for w in ("first", "third") for t in (1, 1 << 20)] + [("all", "third", 1)]
    for who, when, threshold in episodes:
        hvd.init(comm=world.Dup())
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            threshold_bytes=threshold,
        )  # fmt: skip
        steps = 1 if when == "first" else 3
        label = f"{who} {when} {threshold}"
        for step in range(steps):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + me))
            loss = model(x).square().mean()
            loss.backward()
            start = time.monotonic()
            try:
                if step == steps - 1 and (who == "all" or me == 0):
                    hvd.allreduce(loss.detach(), op=hvd.Sum, name="loss")
                opt.step()
            except gflow.MismatchError as exc:
                crossed = "crossed waits" in str(exc) and "a metric reduced on rank 0 only" in str(exc)
                horovod = isinstance(exc, hvd.HorovodInternalError) or me == 0
                waited = time.monotonic() - start
                say(f"{label}: raised after {waited:.1f} s, crossed {crossed}, horovod {horovod}")
                break
        else:
            say(f"{label}: trained {steps} steps")
elif mode == "kit-metric":  # gflow.DataParallel, a gflow.allreduce on rank 0 only inside the step
    import numpy as np

    rng = np.random.default_rng(me)
    params = {k: rng.standard_normal(64).astype(np.float32) for k in ("a", "b", "c")}
    gflow.broadcast_parameters(params)  # (as a trainer starts; and the caller's channel exists then:
    # Open MPI 4.1 can hang with two duplicates of one communicator outstanding, ompi#2025)
    dp = gflow.DataParallel(params, threshold_bytes=256)
    for key in reversed(list(params)):
        dp.push(key, rng.standard_normal(64).astype(np.float32))
    start = time.monotonic()
    try:
        if me == 0:
            gflow.allreduce(np.ones(1))
        dp.synchronize()
    except gflow.MismatchError as exc:
        say(f"raised after {time.monotonic() - start:.1f} s, crossed {'crossed waits' in str(exc)}")
    else:
        say("synchronized")
else:
    raise SystemExit(f"unknown mode {mode!r}")
faulthandler.cancel_dump_traceback_later()
