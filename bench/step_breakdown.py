"""Where a data-parallel training step's time goes: gflow.torch against DDP, on the emulated network.

    python bench/step_breakdown.py                          # AlexNet, p = 4, 1 Gbit/s per link (root)
    python bench/step_breakdown.py --network shm --rounds 2

bench/train.py says which contender is faster; this says why. Three parts, in one job per network, each
alternating its contenders round by round (the order rotating), one BLAS/torch thread per rank:

1. comm: the model's gradients reduced with no compute at all, gloo against gflow: one flat buffer,
   and DDP's buckets (1 MiB first, then 25 MiB, in backward's order) started at once and waited for.
   Both at the link's rate means the transports are not what separates the contenders.
2. step: forward, backward and the optimizer's step (which for gflow waits for the reduction) of
   "DDP gloo" and "gflow dense views" (bench/train.py's contenders), and the CPU time each rank used
   in them (user and system): on shared cores, the CPU communication takes is taken from compute.
   Also each step's communication span: from its first segment's (bucket's) start to its last one's end.
3. timeline: the last timed step's communication as it ran, on every rank: gflow's background jobs
   (when each segment was handed over, began and ended, and the CPU its thread used), and DDP's buckets
   through a communication hook that does what DDP's default does (divide, allreduce) and notes when
   each was handed over and when it finished.

Writes bench/out/step_breakdown_<model>_p<p>_<network>.json and prints medians (ms) per rank.
"""

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import netem  # noqa: E402
import train  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
STEP_CONTENDERS = ["DDP gloo", "gflow dense views"]


def _ddp_buckets(sizes: list[int]) -> list[int]:
    """Elements per bucket as DDP cuts parameters of `sizes` (in backward's order): the first bucket
    closes past 1 MiB, the others past 25 MiB."""
    buckets, filled, cap = [], 0, 2**20
    for n in sizes:
        filled += n
        if filled * 4 >= cap:
            buckets.append(filled)
            filled, cap = 0, 25 * 2**20
    return buckets + ([filled] if filled else [])


def _comm_part(comm, torch, model, rounds: int) -> dict:
    import torch.distributed as dist

    import gflow

    sizes = [p.numel() for p in model.parameters()][::-1]
    rng = np.random.default_rng(comm.rank)
    flat = rng.standard_normal(sum(sizes)).astype(np.float32)
    flat_t = torch.from_numpy(flat.copy())
    buckets = [rng.standard_normal(n).astype(np.float32) for n in _ddp_buckets(sizes)]
    buckets_t = [torch.from_numpy(b.copy()) for b in buckets]

    def gloo_buckets():
        for work in [dist.all_reduce(t, async_op=True) for t in buckets_t]:
            work.wait()

    def gflow_buckets():
        for handle in [gflow.allreduce_async(b, out=b) for b in buckets]:
            handle.wait()

    runs = {
        "gloo, one buffer": lambda: dist.all_reduce(flat_t),
        "gflow, one buffer": lambda: gflow.allreduce(flat, out=flat),
        "gloo, DDP's buckets": gloo_buckets,
        "gflow, DDP's buckets": gflow_buckets,
    }
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_common.timed(comm, runs[name]))
    return {"bytes": flat.nbytes, "buckets_bytes": [b.nbytes for b in buckets], "seconds": times}


def _engine_recorder():
    """Wrap gflow's engine so each job notes (description, handed over, began, ended, thread CPU)."""
    from gflow.runtime import engine

    log = []
    submit = engine._engine.submit

    def recording_submit(description, fn, keep=(), ctx=None, on_failure=None):
        handed = time.perf_counter()

        def job():
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn()
            finally:
                log.append((description, handed, began, time.perf_counter(), time.thread_time() - cpu))

        return submit(description, job, keep, ctx, on_failure)

    engine._engine.submit = recording_submit
    return log


def _ddp_recorder(module, torch):
    """A comm hook doing DDP's default (divide by the world size, allreduce) that notes each bucket's
    (index, bytes, handed over, finished)."""
    import torch.distributed as dist

    log = []

    def hook(state, bucket):
        handed, buffer = time.perf_counter(), bucket.buffer()
        buffer.div_(dist.get_world_size())
        future = dist.all_reduce(buffer, async_op=True).get_future()

        def done(fut):
            log.append((f"bucket {bucket.index()}", handed, handed, time.perf_counter(), 0.0))
            return fut.value()[0]

        return future.then(done)

    module.register_comm_hook(None, hook)
    return log


def _step_part(comm, torch, base, data, target, args) -> dict:
    results = {name: [] for name in STEP_CONTENDERS}
    timelines = {}
    engine_log = _engine_recorder()
    for r in range(args.rounds):
        names = STEP_CONTENDERS[r % 2 :] + STEP_CONTENDERS[: r % 2]
        for name in names:
            runner = train.Runner(name, base, data, target)
            log = _ddp_recorder(runner.module, torch) if name.startswith("DDP") else engine_log
            for step in range(args.warmup + args.steps):
                comm.Barrier()
                log.clear()
                start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                runner.optimizer.zero_grad()
                loss = runner.F.cross_entropy(runner.module(runner.data), runner.target)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                runner.optimizer.step()
                end, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                loss.item()
                if step >= args.warmup:
                    # communication's span: from the first job's (bucket's) start to the last one's end
                    span = max(e[3] for e in log) - min(e[2] for e in log) if log else 0.0
                    results[name].append(
                        {"forward": forward - start, "backward": backward - forward, "step": end - backward,
                         "total": end - start, "user": after.ru_utime - usage.ru_utime,
                         "system": after.ru_stime - usage.ru_stime, "comm_span": span}
                    )  # fmt: skip
                    timelines[name] = [(d, h - start, b - start, e - start, c) for d, h, b, e, c in log]
            runner.close()
    return {"steps": results, "last_step_timeline": timelines}


def worker(args) -> None:
    from mpi4py import MPI

    torch = train._torch_setup()
    comm = MPI.COMM_WORLD
    train._init_gloo(comm)
    base = train._make_model(args.model)
    side, batch = train.INPUTS[args.model]  # (bench/train.py's inputs for the model)
    generator = torch.Generator().manual_seed(comm.rank)
    data = torch.randn(batch, 3, side, side, generator=generator)
    target = torch.randint(0, 1000, (batch,), generator=generator)
    mine = {"comm": _comm_part(comm, torch, base, args.rounds)}
    mine.update(_step_part(comm, torch, base, data, target, args))
    everyone = comm.gather(mine, root=0)
    if comm.rank == 0:
        with open(args.result, "w") as f:
            json.dump({"p": comm.size, "model": args.model, "network": args.network, "ranks": everyone}, f)
        _print(everyone)


def _ms(values) -> str:
    return f"{np.median(values) * 1e3:7.0f}"


def _print(everyone: list) -> None:
    comm = everyone[0]["comm"]
    buckets = [round(b / 1e6, 1) for b in comm["buckets_bytes"]]
    print(f"comm alone ({comm['bytes'] / 1e6:.1f} MB; buckets {buckets} MB), slowest rank, median (ms):")
    for name, seconds in comm["seconds"].items():
        print(f"  {name:22s} {_ms(seconds)}")
    print("step, median per rank (ms): forward, backward, step, total; CPU user, system; comm span")
    for name in STEP_CONTENDERS:
        for rank, mine in enumerate(everyone):
            rows = mine["steps"][name]
            cells = " ".join(_ms([row[k] for row in rows]) for k in ("forward", "backward", "step", "total"))
            cpu = " ".join(_ms([row[k] for row in rows]) for k in ("user", "system"))
            print(f"  {name:18s} rank {rank}: {cells} | {cpu} | {_ms([row['comm_span'] for row in rows])}")
    print("the last timed step's communication (ms from its start): handed over, began, ended, thread CPU")
    for name in STEP_CONTENDERS:
        for rank, mine in enumerate(everyone):
            events = sorted(mine["last_step_timeline"][name], key=lambda e: e[1])
            for what, handed, began, ended, cpu in events:
                print(f"  {name:18s} rank {rank}: {what:28s} {handed * 1e3:7.1f} {began * 1e3:7.1f} "
                      f"{ended * 1e3:7.1f} {cpu * 1e3:6.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="alexnet", choices=["alexnet", "resnet18"])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--network", default="1gbit", help='"shm", or a rate per link such as 1gbit (root)')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(OUT, exist_ok=True)
    result = os.path.join(OUT, f"step_breakdown_{args.model}_p{args.procs}_{args.network}.json")
    worker_args = ["--worker", "--result", result, "--model", args.model, "--network", args.network]
    worker_args += ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    rate = None if args.network == "shm" else netem.parse_rate(args.network)
    netem.launch(os.path.abspath(__file__), args.procs, worker_args, rate)


if __name__ == "__main__":
    main()
