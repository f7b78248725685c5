"""Data-parallel training of a small MLP on scikit-learn's digits with gflow's trainer kit: a complete
custom trainer (NumPy; CuPy when a GPU is present and cupy imports) to copy from. Needs the `examples`
extra (scikit-learn): `pip install -e '.[mpich,examples]'`.

    mpiexec -n 4 .venv/bin/python examples/train_mlp.py                          # dense fp32
    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --compression fp16 --loss-scale
    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --density 0.01 --epochs 60  # CSC at 1%
    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --topk 0.05     # your own compression: a hook
    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --checkpoint /tmp/mlp --epochs 10
    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --checkpoint /tmp/mlp --epochs 20 --resume

What it shows, in the order a trainer meets it:
- every rank builds the same model and gflow.broadcast_parameters makes sure they start equal;
- gflow.DataParallel over the parameters; backward writes each gradient into the array
  gradient_buffers() gave it (views of the fusion pool: no copy) and pushes it at once, last layer
  first, so its communication overlaps the rest of backward;
- dp.synchronize() averages them over the ranks (dense, float16 on the wire, or coarse-grained sparse),
  unscales them under dynamic loss scaling, and says whether to apply the step (False on every rank
  when one rank overflowed);
- checkpoints: each rank saves its own file (PATH.rank<r>.pkl: weights, optimizer state,
  dp.state_dict() with this rank's sparse residuals, epoch, the data-order RNG), and --resume carries on
  from the last one bitwise as if never stopped.

The global batch is split over the ranks (rank r takes every size-th sample of each batch), so every
world size walks the same batches. Sparse (--density) uses Deep Gradient Compression's recipe: the
momentum goes into the residual (momentum correction, --momentum, default 0.5 there) and the optimizer
is plain SGD on the update; a warm-up of --warmup-epochs lowers the density from 1.
"""

import os

# One BLAS thread per rank: several ranks share the cores. Set before NumPy loads its BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import pickle  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gflow  # noqa: E402

HIDDEN = 256


def array_module(want: str):
    """CuPy when asked or (auto) when a GPU is present and cupy imports; NumPy otherwise."""
    if want == "cpu":
        return np
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            rank = MPI.COMM_WORLD.rank
            cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
            return cupy
    except Exception as exc:  # noqa: BLE001 - no CuPy or no GPU: NumPy
        if want == "gpu":
            raise SystemExit(f"--device gpu: CuPy with a GPU is needed ({exc})") from None
    if want == "gpu":
        raise SystemExit("--device gpu: no GPU found")
    return np


def host(a):
    """A NumPy copy of a NumPy or CuPy array (for checkpoints)."""
    return a.get() if hasattr(a, "get") else np.array(a)


def load_digits(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return (x[train], y[train]), (x[test], y[test])


def init_params(xp, seed: int = 0) -> dict:
    """He-initialised weights, zero biases; the same on every rank (same seed), in model order."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((64, HIDDEN)) * np.sqrt(2 / 64)
    w2 = rng.standard_normal((HIDDEN, 10)) * np.sqrt(2 / HIDDEN)
    params = {"w1": w1, "b1": np.zeros(HIDDEN), "w2": w2, "b2": np.zeros(10)}
    return {k: xp.asarray(v, dtype=np.float32) for k, v in params.items()}


def forward(p, x):
    z = x @ p["w1"] + p["b1"]
    h = z * (z > 0)  # ReLU
    return h, h @ p["w2"] + p["b2"]


def backward(xp, p, x, y, grads, push, scale: float) -> float:
    """Mean cross-entropy of (x, y), times `scale` for the gradients: write each gradient into
    grads[name] and push it as soon as it is ready, last layer first. Returns the (unscaled) loss."""
    h, logits = forward(p, x)
    e = xp.exp(logits - logits.max(axis=1, keepdims=True))
    prob = e / e.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = float(-xp.log(prob[rows, y] + 1e-12).mean())
    d = prob
    d[rows, y] -= 1
    d *= np.float32(scale / len(y))  # the scaled loss's gradient with respect to the logits
    grads["b2"][...] = d.sum(axis=0)
    push("b2")  # its communication starts while the rest of backward runs
    grads["w2"][...] = h.T @ d
    push("w2")
    dh = (d @ p["w2"].T) * (h > 0)
    grads["b1"][...] = dh.sum(axis=0)
    push("b1")
    grads["w1"][...] = x.T @ dh
    push("w1")
    return loss


def accuracy(p, x, y) -> float:
    return float((forward(p, x)[1].argmax(axis=1) == y).mean())


def checkpoint_path(base: str, rank: int) -> str:
    return f"{base}.rank{rank}.pkl"


def save(path: str, params, velocity, dp, epoch: int, order_rng) -> None:
    state = {
        "params": {k: host(v) for k, v in params.items()},
        "velocity": {k: host(v) for k, v in velocity.items()},
        "dp": dp.state_dict(),
        "epoch": epoch,
        "order_rng": order_rng.bit_generator.state,
    }
    with open(path + ".tmp", "wb") as f:
        pickle.dump(state, f)
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint


def restore(path: str, xp, params, velocity, dp, order_rng) -> int:
    with open(path, "rb") as f:
        state = pickle.load(f)
    dp.load_state_dict(state["dp"])  # checks the settings, world size and rank first
    for k in params:
        params[k][...] = xp.asarray(state["params"][k])
        velocity[k][...] = xp.asarray(state["velocity"][k])
    order_rng.bit_generator.state = state["order_rng"]
    return state["epoch"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--momentum",
        type=float,
        default=None,
        help="SGD momentum (dense, default 0.9) or momentum correction (sparse, default 0.5)",
    )
    parser.add_argument("--compression", choices=["none", "fp16"], default="none")
    parser.add_argument(
        "--density",
        type=float,
        default=None,
        help="coarse-grained sparse communication at this density (e.g. 0.01)",
    )
    parser.add_argument("--chunk-elems", type=int, default=32, help="CSC chunk length")
    parser.add_argument(
        "--topk",
        type=float,
        default=None,
        metavar="DENSITY",
        help="reduce through a user-level hook instead: top-k with error feedback (examples/topk_hook.py)",
    )
    parser.add_argument("--warmup-epochs", type=float, default=2.0, help="CSC warm-up from dense")
    parser.add_argument("--loss-scale", action="store_true", help="dynamic loss scaling")
    parser.add_argument("--checkpoint", metavar="PATH", help="save PATH.rank<r>.pkl after every epoch")
    parser.add_argument("--resume", action="store_true", help="carry on from --checkpoint's files")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")
    if args.topk is not None and (args.density is not None or args.compression != "none" or args.checkpoint):
        parser.error("--topk is a compression of its own: not with --density, --compression or --checkpoint")
    return args  # fmt: skip


def main(argv=None) -> float:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    xp = array_module(args.device)
    (xtr, ytr), (xte, yte) = load_digits(args.seed)
    xtr, ytr, xte, yte = (xp.asarray(a) for a in (xtr, ytr, xte, yte))
    steps_per_epoch = len(ytr) // args.batch

    params = init_params(xp, args.seed)
    gflow.broadcast_parameters(params)  # the same start everywhere, whatever each rank drew
    sparse = None
    momentum = args.momentum
    if args.density is not None:
        momentum = 0.5 if momentum is None else momentum
        warmup = int(args.warmup_epochs * steps_per_epoch)
        sparse = {"density": args.density, "chunk_elems": args.chunk_elems, "momentum": momentum,
                  "warmup_steps": warmup}  # fmt: skip
        momentum = 0.0  # in the residual, not in the optimizer
    elif momentum is None:
        momentum = 0.9
    dp = gflow.DataParallel(
        params,
        compression=None if args.compression == "none" else args.compression,
        sparse=sparse,
        loss_scaler=gflow.LossScaler(init_scale=2.0**10, growth_interval=200) if args.loss_scale else None,
    )
    if args.topk is not None:
        from topk_hook import TopK, topk_hook  # (examples/topk_hook.py, beside this file)

        dp.register_hook(TopK(args.topk), topk_hook)
    grads = dp.gradient_buffers()
    velocity = {k: xp.zeros_like(v) for k, v in params.items()}
    order_rng = np.random.default_rng(args.seed + 1)  # the data order: the same on every rank
    first_epoch = 0
    if args.resume:
        path = checkpoint_path(args.checkpoint, rank)
        found = comm.allgather(os.path.exists(path))
        if any(found) and not all(found):
            missing = [r for r, f in enumerate(found) if not f]
            raise SystemExit(f"--resume: ranks {missing} have no checkpoint {args.checkpoint}.rank<r>.pkl")
        if all(found):
            first_epoch = restore(path, xp, params, velocity, dp, order_rng) + 1
        if rank == 0:
            print(f"resumed after epoch {first_epoch}" if first_epoch else "no checkpoint: starting afresh")

    if rank == 0 and first_epoch == 0:
        kind = "CuPy" if xp is not np else "NumPy"
        mode = f"CSC density {args.density}" if sparse else "dense"
        mode = f"top-k hook, density {args.topk}" if args.topk is not None else mode
        scaling = "on" if args.loss_scale else "off"
        print(f"{size} ranks, {kind}, {mode}, compression={args.compression}, loss scaling={scaling}, "
              f"{steps_per_epoch} steps/epoch")  # fmt: skip
    lr = np.float32(args.lr)
    for epoch in range(first_epoch, args.epochs):
        start, loss_sum, skipped = time.perf_counter(), 0.0, 0
        perm = order_rng.permutation(len(ytr))
        for s in range(steps_per_epoch):
            idx = xp.asarray(perm[s * args.batch : (s + 1) * args.batch][rank::size])  # this rank's share
            loss_sum += backward(xp, params, xtr[idx], ytr[idx], grads, dp.push, dp.loss_scale)
            if dp.synchronize():  # grads now hold the mean over the ranks, unscaled
                for k, p in params.items():
                    if momentum:
                        velocity[k] *= np.float32(momentum)
                        velocity[k] += grads[k]
                        p -= lr * velocity[k]
                    else:
                        p -= lr * grads[k]
            else:
                skipped += 1
        loss = float(gflow.allreduce(np.array([loss_sum / steps_per_epoch]), "mean")[0])
        acc = accuracy(params, xte, yte)
        if args.checkpoint:
            save(checkpoint_path(args.checkpoint, rank), params, velocity, dp, epoch, order_rng)
        if rank == 0:
            extra = f"  loss scale {dp.loss_scale:g} ({skipped} skipped)" if args.loss_scale else ""
            print(f"epoch {epoch + 1:3d}  loss {loss:.4f}  held-out accuracy {acc:.4f}  "
                  f"{time.perf_counter() - start:.2f} s{extra}", flush=True)  # fmt: skip
    acc = accuracy(params, xte, yte)
    if rank == 0:
        print(f"final held-out accuracy {acc:.4f}")
    return acc


if __name__ == "__main__":
    main()
