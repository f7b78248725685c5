"""Horovod's features beyond the training loop, in one script: uneven data with join(), a process set,
alltoall, reducescatter, Adasum and the timeline. Written for `import horovod.torch as hvd`; only the
import differs.

    mpiexec -n 4 .venv/bin/python examples/horovod_features.py [--timeline /tmp/trace.json]

Each rank trains a small regression model on its own share of a synthetic dataset, and the shares are
uneven (rank r has 20 + 7 r batches): ranks that run out call hvd.join() and take part in the others'
gradient averages with zeros until the last one finishes. Along the way: a metric averaged over the
even ranks only (a process set), samples routed to the rank that owns their label (alltoall), a
sharded average (reducescatter), and the final weights of two replicas combined by Adasum (when the
number of ranks is a power of two). Prints what each step found, on rank 0. Needs the `torch` extra.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # several ranks share the cores: one thread each

import argparse  # noqa: E402

import torch  # noqa: E402

import gflow.torch as hvd  # noqa: E402 - the one line that differs from a Horovod script


def main(argv=None) -> dict:
    """Run the tour; returns what it found on this rank (the tests read it)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timeline", help="write a Chrome trace per rank here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.timeline:
        hvd.start_timeline(args.timeline)

    # --- uneven data: each rank has its own number of batches; join() when it runs out
    torch.manual_seed(0)  # the same initial model everywhere (broadcast makes sure of it)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    data = torch.Generator().manual_seed(100 + rank)
    truth = torch.linspace(-1, 1, 8)
    batches = 20 + 7 * rank
    for _ in range(batches):
        x = torch.randn(32, 8, generator=data)
        y = (x @ truth).unsqueeze(1) + 0.01 * torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    last = hvd.join()
    say(f"uneven data: ranks ran 20 to {20 + 7 * (size - 1)} batches; rank {last} joined last")
    final = hvd.allreduce(loss.detach(), name="final loss")
    say(f"  the ranks' last losses average {final.item():.4f}")

    # --- a process set: the even ranks average a metric among themselves
    evens = (
        hvd.add_process_set([r for r in range(size) if r % 2 == 0]) if size > 1 else hvd.global_process_set
    )
    if evens.included():
        mean = hvd.allreduce(torch.tensor([float(rank)]), process_set=evens)
        say(f"process set {evens.ranks}: mean rank {mean.item():g}")

    # --- alltoall: route each sample to the rank that owns its label (label % size)
    labels = torch.randint(0, 10, (12,), generator=data)
    order = torch.argsort(labels % size, stable=True)
    splits = torch.bincount(labels % size, minlength=size).to(torch.int32)
    received, received_splits = hvd.alltoall(labels[order], splits=splits)
    assert bool((received % size == rank).all()), "alltoall delivered a sample to the wrong rank"
    say(f"alltoall: rank 0 now owns {received.numel()} samples, {received_splits.tolist()} from each rank")

    # --- reducescatter: average a gradient-like tensor and keep this rank's rows
    shard = hvd.reducescatter(torch.full((2 * size + 1, 3), float(rank)), op=hvd.Average)
    say(f"reducescatter: rank 0 keeps {tuple(shard.shape)} of the average, value {shard[0, 0].item():g}")

    # --- Adasum: combine the ranks' update directions (Horovod needs a power-of-two number of ranks)
    if size & (size - 1) == 0:
        delta = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) * (rank + 1)
        combined = hvd.allreduce(delta, op=hvd.Adasum)
        say(f"Adasum: |combined| / |rank 0's| = {(combined.norm() / delta.norm()).item():.3f}")
    else:
        combined = None
        say(f"Adasum: skipped ({size} ranks is not a power of two)")

    if size > 1:
        hvd.remove_process_set(evens)
    if args.timeline:
        hvd.stop_timeline()
    say("done")
    return dict(last=last, received=received, shard=shard, adasum=combined, final_loss=final.item())


if __name__ == "__main__":
    main()
