"""A Horovod-style PyTorch script on gflow.torch: an MLP on scikit-learn's digits, data parallel.

    mpiexec -n 4 .venv/bin/python examples/train_torch.py                      # dense
    mpiexec -n 4 .venv/bin/python examples/train_torch.py --fp16-allreduce     # float16 on the wire
    mpiexec -n 4 .venv/bin/python examples/train_torch.py --density 0.01       # CSC at 1%

Written as for `import horovod.torch as hvd`; only the import differs. gflow's one extra is
DistributedOptimizer's sparse= (coarse-grained sparse communication): with SGD momentum, the momentum
moves into CSC's momentum correction, so the update is not accelerated twice. Every rank takes every
size-th sample of each global batch, so every world size walks the same batches. Prints one line per
epoch on rank 0 and the final held-out accuracy. Needs the `torch` and `examples` extras (PyTorch,
scikit-learn): `pip install -e '.[mpich,torch,examples]'`.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # several ranks share the cores: one thread each

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812

import gflow.torch as hvd  # noqa: E402 - the one line that differs from a Horovod script


def load_digits(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--density", type=float, help="CSC: the fraction of gradient chunks sent")
    parser.add_argument("--chunk-elems", type=int, default=32)
    parser.add_argument("--warmup-epochs", type=float, default=2.0, help="CSC warm-up from dense")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + hvd.rank())  # different on each rank: broadcast_parameters fixes it
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    steps_per_epoch = len(y_train) // args.batch
    sparse = None
    if args.density is not None:
        warmup = int(args.warmup_epochs * steps_per_epoch)
        sparse = dict(density=args.density, chunk_elems=args.chunk_elems, warmup_steps=warmup)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        sparse=sparse,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    order_rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(order_rng.permutation(len(y_train)))
        losses = []
        for step in range(steps_per_epoch):
            batch = order[step * args.batch : (step + 1) * args.batch][hvd.rank() :: hvd.size()]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {np.mean(losses):.4f}  "
                f"held-out accuracy {accuracy:.4f}  {time.perf_counter() - start:.1f} s",
                flush=True,
            )
    if hvd.rank() == 0:
        print(f"final held-out accuracy {accuracy:.4f} on {hvd.size()} ranks", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
