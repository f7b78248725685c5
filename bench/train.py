"""End-to-end training throughput: images/s of torchvision ResNet-18 and AlexNet on synthetic data.

    python bench/train.py --quick                            # smoke: every config, a few steps each
    python bench/train.py --append-results                   # the full matrix (~40 min; 1gbit needs root)
    python bench/train.py --models alexnet --procs 4 --networks shm 1gbit

Each rank trains on its own fixed synthetic batch (random images, random labels), CPU only, with one
torch thread (torch.set_num_threads(1), OMP/OPENBLAS/MKL_NUM_THREADS=1), plain SGD (lr 0.001, no
momentum: no optimizer state). Inputs, chosen so that a step's compute is comparable to or smaller
than its communication under the emulated network (GradientFlow's regime):

    resnet18  128x128, batch 8 per rank   11.7 M parameters, 46.8 MB of float32 gradients;
              compute about 0.3 s a step on one core here, a ring allreduce at 1 Gbit/s per link
              0.37 s (p = 2) and 0.56 s (p = 4)
    alexnet   224x224, batch 4 per rank   61.1 M parameters, 244 MB; compute about 0.33 s a step,
              the allreduce 2.0 s (p = 2) and 2.9 s (p = 4) at 1 Gbit/s per link

Contenders (all in one mpiexec run per configuration, alternated: every round builds each contender in
turn from the same initial weights, runs its warm-up steps, then its timed steps, and frees it; the
order rotates from round to round):

    plain                 single-process training, no communication (p = 1 only)
    DDP gloo              torch DistributedDataParallel over gloo (the peer); gradient_as_bucket_view,
                          forward_sync_buffers=False (Horovod's semantics: buffers are not synchronized)
    DDP gloo + fp16 hook  the same with default_hooks.fp16_compress_hook
    gflow dense           gflow.torch.DistributedOptimizer (Horovod's API), float32
    gflow dense views     the same with gradient_as_bucket_view=True (as the DDP contenders run)
    gflow fp16            the same with compression=hvd.Compression.fp16
    gflow CSC 1%          the same with sparse=dict(density=0.01)

torch.distributed is initialized from the MPI rank and size with a TCP store on 127.0.0.1, and gloo
is bound to the loopback (GLOO_SOCKET_IFNAME=lo), so under the emulated network its traffic crosses
the same rate-limited loopback as MPICH's. Every contender starts from identical weights on every
rank (seeded), so no initial broadcast is timed or needed; after each contender's steps the
parameters are checked to be identical on every rank (they train on different data, so they would
not be without a working allreduce).

Networks: "shm" (MPICH shared memory; gloo over the host loopback, as it has no shared-memory
transport) or a per-link rate such as "1gbit" (bench/netem.py: a private network namespace whose
loopback is rate-limited to p x the rate; needs root). p = 1 runs on shm only.

Figures: the median over all timed steps (every round) of the slowest rank's step time; img/s =
p x batch / that median. Scaling efficiency = img/s at p / (p x img/s of the plain contender at
p = 1), GradientFlow's measure (80%: 410.2x on 512 GPUs). Only p = 2 has one core per rank here; at
p = 4 two ranks share each core.

If bench/horovod_synthetic_benchmark.py (or --horovod-script) exists, Horovod's own
examples/pytorch/pytorch_synthetic_benchmark.py with its import changed to gflow.torch, it is run after
the contenders at every p > 1 through bench/horovod_wrapper.py, dense and with CSC 1% (its own warm-up,
batches and iterations set from --warmup, --steps and --rounds; its figure is its mean, not a median);
its input is fixed at 224x224 by the script. Horovod's sdists on PyPI (0.9.0 to 0.28.1) do not ship
its examples, so the file is not in this repository: copy it from a Horovod source tree. The development
branch's version builds the model with norm_layer=hvd.SyncBatchNorm (gflow.torch has it), so it runs
ResNets, with batch norm synchronized across ranks, but not AlexNet (which takes no norm_layer, with
Horovod too); a release tag's version builds plain models and runs both.

On a GPU, `--device cuda --models resnet50 --networks shm` runs every rank on GPU 0 (ResNet-50 at
224x224, batch 32 per rank), the DDP contenders on CUDA tensors through gloo (NCCL refuses two ranks
on one GPU), gflow through its device path; results go to OUT_cuda. bench/gpu_check.sh runs it.

Memory: AlexNet peaks at about 3 GiB per rank (the CSC contender; one contender is alive at a time),
so p = 4 needs about 12 GiB free.

Writes OUT/*.json (bench/out/train by default), train.md (table and targets) and OUT/train.png; with
--append-results the command, machine and table are appended to bench/RESULTS.md and the plot goes to
bench/results/train.png.
"""

import argparse
import gc
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import netem  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out", "train")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
PLOT = os.path.join(HERE, "results", "train.png")
HVD_SCRIPT = os.path.join(HERE, "horovod_synthetic_benchmark.py")
HVD_WRAPPER = os.path.join(HERE, "horovod_wrapper.py")

# model -> (input side, batch per rank)
INPUTS = {"resnet18": (128, 8), "alexnet": (224, 4), "resnet50": (224, 32)}  # resnet50: --device cuda's
CONTENDERS = [
    "plain", "DDP gloo", "DDP gloo + fp16 hook", "gflow dense", "gflow dense views", "gflow fp16",
    "gflow CSC 1%",
]  # fmt: skip
GFLOW = [c for c in CONTENDERS if c.startswith("gflow")]
PEER = {
    "gflow dense": "DDP gloo",
    "gflow dense views": "DDP gloo",
    "gflow fp16": "DDP gloo + fp16 hook",
    "gflow CSC 1%": "DDP gloo",
}
LR = 0.001
CSC_DENSITY = 0.01


# ---------------------------------------------------------------------------------------------- worker


def _torch_setup():
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set
        pass
    return torch


def _init_store(comm):
    """A torch.distributed TCP store on 127.0.0.1, rank 0's port handed out through MPI."""
    import torch.distributed as dist

    if comm.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, comm.size, is_master=True, wait_for_workers=False)
        comm.bcast(store.port, root=0)
        return store
    return dist.TCPStore("127.0.0.1", comm.bcast(None, root=0), comm.size, is_master=False)


def _init_gloo(comm):
    """torch.distributed over gloo from MPI's rank and size: a TCP store on 127.0.0.1, gloo on lo."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # inside the namespace: the rate-limited loopback
    dist.init_process_group("gloo", store=_init_store(comm), rank=comm.rank, world_size=comm.size)


class Runner:
    """One contender built on a fresh copy of the initial model: step() runs one training step."""

    def __init__(self, name: str, base, data, target):
        import torch
        import torch.nn.functional as F

        self.name = name
        self.model = _copy_model(base)
        self.data, self.target = data, target
        self.F = F
        params = self.model.parameters()
        self.module = self.model
        if name.startswith("DDP"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module = DDP(
                self.model, forward_sync_buffers=False, gradient_as_bucket_view=True, init_sync=False
            )
            if "fp16" in name:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.module.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
            self.optimizer = torch.optim.SGD(params, lr=LR)
        elif name.startswith("gflow"):
            import gflow.torch as hvd

            hvd.init()
            kwargs = {"named_parameters": self.model.named_parameters()}
            if name == "gflow fp16":
                kwargs["compression"] = hvd.Compression.fp16
            if name == "gflow dense views":  # DDP's gradient_as_bucket_view, as the DDP contenders run
                kwargs["gradient_as_bucket_view"] = True
            if name == "gflow CSC 1%":
                kwargs["sparse"] = dict(density=CSC_DENSITY)
            self.optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=LR), **kwargs)
        else:
            self.optimizer = torch.optim.SGD(params, lr=LR)
        self.loss = float("nan")

    def step(self) -> None:
        self.optimizer.zero_grad()
        loss = self.F.cross_entropy(self.module(self.data), self.target)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.item()

    def checksum(self) -> float:
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))

    def close(self) -> None:
        close = getattr(self.optimizer, "close", None)  # if the layer offers one
        if callable(close):
            close()
        del self.module, self.model, self.optimizer
        gc.collect()


def _make_model(name: str):
    import torch
    import torchvision

    torch.manual_seed(0)  # identical initial weights on every rank
    return getattr(torchvision.models, name)(num_classes=1000)


def _copy_model(base):
    import copy

    return copy.deepcopy(base)


def worker(args) -> None:
    from mpi4py import MPI

    torch = _torch_setup()
    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    side, batch = args.side, args.batch
    names = [c for c in args.contenders if not (c == "plain" and p > 1)]
    if any(c.startswith("DDP") for c in names):
        _init_gloo(comm)
    base = _make_model(args.model).to(args.device)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    data = torch.randn(batch, 3, side, side, generator=gen).to(args.device)
    target = torch.randint(0, 1000, (batch,), generator=gen).to(args.device)
    label = f"{args.model} {side}x{side} b{batch} p={p} {args.network} {args.device}"
    times = {n: [] for n in names}  # the slowest rank's step seconds, every timed step of every round
    rounds = {n: [] for n in names}  # img/s of each round (its median step)
    losses, mismatches = {n: [] for n in names}, {n: 0 for n in names}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runner = Runner(name, base, data, target)
            for _ in range(args.warmup):
                runner.step()
            local = np.empty(args.steps)
            comm.Barrier()
            for i in range(args.steps):
                t = time.perf_counter()
                runner.step()
                local[i] = time.perf_counter() - t
            slowest = np.empty_like(local)
            comm.Allreduce(local, slowest, op=MPI.MAX)
            check = runner.checksum()
            lo, hi = comm.allreduce(check, op=MPI.MIN), comm.allreduce(check, op=MPI.MAX)
            if name != "plain" and lo != hi:
                mismatches[name] += 1
            losses[name].append(runner.loss)
            runner.close()
            del runner
            times[name].extend(slowest.tolist())
            rate = p * batch / float(np.median(slowest))
            rounds[name].append(rate)
            if rank == 0:
                note = "" if lo == hi or name == "plain" else "  PARAMETERS DIFFER ACROSS RANKS"
                print(
                    f"  {label} round {r + 1}/{args.rounds}: {name:22s} {rate:8.2f} img/s "
                    f"(step {np.median(slowest) * 1e3:8.1f} ms, loss {runner_loss(losses[name]):.3f})"
                    f"{note}  [{time.perf_counter() - t_start:.0f} s, rank 0 peak RSS "
                    f"{_peak_rss_gib():.1f} GiB]",
                    flush=True,
                )
    if rank != 0:
        return
    rows = []
    for name in names:
        step = float(np.median(times[name]))
        rows.append(
            {
                "contender": name,
                "step_s": step,
                "img_s": p * batch / step,
                "round_img_s": rounds[name],
                "steps": times[name],
                "final_loss": losses[name][-1],
                "rank_mismatches": mismatches[name],
            }
        )
    result = {
        "model": args.model, "side": side, "batch": batch, "p": p, "network": args.network,
        "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps, "lr": LR,
        "params": sum(q.numel() for q in base.parameters()), "torch": torch.__version__, "rows": rows,
    }  # fmt: skip
    _common.write_json(_json_path(args.out, args.model, p, args.network), result)


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def runner_loss(values) -> float:
    return values[-1] if values else float("nan")


def _json_path(out: str, model: str, p: int, network: str) -> str:
    return os.path.join(out, f"train_{model}_p{p}_{network}.json")


# ------------------------------------------------------------------------ Horovod's script, if present


def run_horovod_script(model: str, p: int, network: str, args, sparse: bool) -> dict | None:
    """Horovod's pytorch_synthetic_benchmark.py on gflow.torch, through bench/horovod_wrapper.py."""
    cmd_args = [
        args.horovod_script, "--no-cuda", "--model", model, "--batch-size", str(INPUTS[model][1]),
        "--num-warmup-batches", str(args.warmup), "--num-batches-per-iter", str(args.steps),
        "--num-iters", str(args.rounds),
    ]  # fmt: skip
    if sparse:
        cmd_args = ["--sparse-density", str(CSC_DENSITY), *cmd_args]
    cmd = [_common.mpiexec(), "-n", str(p), sys.executable, HVD_WRAPPER, *cmd_args]
    rate = None if network == "shm" else netem.parse_rate(network)
    try:
        if rate is None:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        else:
            with netem.ShapedNetwork(rate, p) as net:
                done = subprocess.run(net.command(cmd), capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        print("    Horovod script: timed out", flush=True)
        return None
    print("\n".join("    | " + line for line in done.stdout.strip().splitlines()), flush=True)
    match = re.search(r"Total img/sec on \d+ \w+\(s\): ([\d.]+) \+-([\d.]+)", done.stdout)
    if done.returncode != 0 or match is None:
        print(
            f"    Horovod script failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}", flush=True
        )
        return None
    name = "Horovod script, gflow.torch" + (" CSC 1%" if sparse else "")
    return {"contender": name, "img_s": float(match.group(1)), "conf95": float(match.group(2)), "side": 224}


# ------------------------------------------------------------------------------------------- report


def load(out: str) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(out, "train_*_p*_*.json")))]


def _find(results, model, p, network):
    for r in results:
        if r["model"] == model and r["p"] == p and r["network"] == network:
            return r
    return None


def _rate(result, contender):
    if result is None:
        return None
    for row in result["rows"]:
        if row["contender"] == contender:
            return row["img_s"]
    return None


ORDER = {"shm": 0}


def _config_key(r):
    return (r["model"] != "resnet18", ORDER.get(r["network"], 1), r["network"], r["p"])


def table(results: list[dict]) -> str:
    lines = [
        "| model | input, batch/rank | p | network | contender | img/s | vs peer | step (ms) | "
        "scaling efficiency | rounds (img/s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=_config_key):
        single = _rate(_find(results, r["model"], 1, "shm"), "plain")
        for row in r["rows"]:
            name = row["contender"]
            peer = _rate(r, PEER.get(name, ""))
            vs = f"{row['img_s'] / peer:.2f}x {PEER[name]}" if peer else ""
            side = row.get("side", r["side"])
            eff = f"{row['img_s'] / (r['p'] * single):.0%}" if single and side == r["side"] else ""
            step = f"{row['step_s'] * 1e3:.0f}" if "step_s" in row else ""
            spread = " ".join(f"{x:.1f}" for x in row.get("round_img_s", []))
            if row.get("rank_mismatches"):
                name += " (PARAMETERS DIFFERED ACROSS RANKS)"
            if "conf95" in row:
                spread = f"mean, +-{row['conf95']:.1f} (95%)"
            lines.append(
                f"| {r['model']} | {side}x{side}, {r['batch']} | {r['p']} | {r['network']} | "
                f"{name} | {row['img_s']:.2f} | {vs} | {step} | {eff} | {spread} |"
            )
    return "\n".join(lines) + "\n"


def targets(results: list[dict], net: str = "1gbit") -> str:
    """The issue's targets, each with what was measured (or what is missing)."""
    out = []

    def ratio(a, b):
        return a / b if a and b else None

    def verdict(value, goal, fmt="{:.3f}x"):
        if value is None:
            return "not measured"
        return f"{fmt.format(value)} ({'met' if value >= goal else 'not met'})"

    for p in (2, 4):
        r = _find(results, "resnet18", p, "shm")
        out.append(
            f"- ResNet-18, shared memory, p = {p}: gflow dense >= 0.95x DDP gloo: "
            + verdict(ratio(_rate(r, "gflow dense"), _rate(r, "DDP gloo")), 0.95)
        )
    r = _find(results, "alexnet", 4, net)
    shm = _find(results, "alexnet", 4, "shm")
    out.append(
        f"- AlexNet 224x224 b4, {net}, p = 4: gflow dense >= 1.0x DDP gloo: "
        + verdict(ratio(_rate(r, "gflow dense"), _rate(r, "DDP gloo")), 1.0)
    )
    out.append(
        "  gflow dense views (gradient_as_bucket_view) >= 1.0x DDP gloo: "
        + verdict(ratio(_rate(r, "gflow dense views"), _rate(r, "DDP gloo")), 1.0)
    )
    out.append(
        "  gflow fp16 >= 1.0x DDP + fp16 hook: "
        + verdict(ratio(_rate(r, "gflow fp16"), _rate(r, "DDP gloo + fp16 hook")), 1.0)
    )
    out.append(
        "  gflow CSC 1% >= 2.5x DDP gloo: "
        + verdict(ratio(_rate(r, "gflow CSC 1%"), _rate(r, "DDP gloo")), 2.5)
    )
    out.append(
        "  gflow CSC 1% >= 80% of gflow's shared-memory img/s (dense there): "
        + verdict(ratio(_rate(r, "gflow CSC 1%"), _rate(shm, "gflow dense")), 0.8, "{:.0%}")
        + "; of CSC 1% there: "
        + verdict(ratio(_rate(r, "gflow CSC 1%"), _rate(shm, "gflow CSC 1%")), 0.8, "{:.0%}")
    )
    for model in ("resnet18", "alexnet"):
        single = _rate(_find(results, model, 1, "shm"), "plain")
        r = _find(results, model, 2, net)
        eff = ratio(_rate(r, "gflow CSC 1%"), 2 * single if single else None)
        out.append(
            f"- {model}, {net}, p = 2: CSC 1% scaling efficiency >= 70%: " + verdict(eff, 0.7, "{:.0%}")
        )
    for model in ("resnet18", "alexnet"):
        r = _find(results, model, 1, "shm")
        plain = _rate(r, "plain")
        over = {name: ratio(plain, _rate(r, name)) for name in GFLOW}
        text = "not measured"
        if over["gflow dense"] is not None:
            dense = over["gflow dense"]
            text = f"gflow dense {dense - 1:+.1%} ({'met' if dense <= 1.05 else 'not met'})"
            others = [f"{n} {v - 1:+.1%}" for n, v in over.items() if n != "gflow dense" and v is not None]
            if others:
                text += "; for information " + ", ".join(others)
        out.append(f"- {model}, p = 1: gflow.torch overhead <= 5% over plain (step time): " + text)
    out.append("- For scale: GradientFlow reports 80% scaling efficiency (410.2x on 512 GPUs).")
    return "\n".join(out) + "\n"


def plot(results: list[dict], path: str) -> None:
    plt = _common.pyplot()
    if plt is None or not results:
        return
    results = sorted(results, key=_config_key)
    models = sorted({r["model"] for r in results}, key=lambda m: m != "resnet18")
    columns = max(sum(r["model"] == m for r in results) for m in models)
    fig, axes = plt.subplots(len(models), columns, figsize=(3.6 * columns, 3.4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        mine = [r for r in results if r["model"] == model]
        for j in range(columns):
            ax = axes[i][j]
            if j >= len(mine):
                ax.axis("off")
                continue
            r = mine[j]
            names = [row["contender"] for row in r["rows"]]
            colors = [
                "tab:gray" if n == "plain" else "tab:orange" if n.startswith("DDP") else "tab:blue"
                for n in names
            ]
            ax.barh(names, [row["img_s"] for row in r["rows"]], color=colors)
            ax.invert_yaxis()
            ax.set_title(f"{model} {r['side']}px b{r['batch']}, p={r['p']}, {r['network']}", fontsize=8)
            ax.set_xlabel("images/s (all ranks)", fontsize=8)
            ax.tick_params(axis="both", labelsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(out: str, plot_path: str, append_to: str | None, command: str) -> None:
    results = load(out)
    text = table(results) + "\nAgainst the issue's targets:\n\n" + targets(results)
    with open(os.path.join(out, "train.md"), "w") as f:
        f.write(text)
    print(text)
    machine = _common.machine()
    _common.write_json(os.path.join(out, "train.json"), {"machine": machine, "results": results})
    plot(results, plot_path)
    if append_to:
        versions = sorted({r.get("torch", "?") for r in results})
        header = (
            "\n## End to end: ResNet-18 and AlexNet training, images/s (issue 8)\n\n"
            f"Command: `{command}` ({time.strftime('%Y-%m-%d')}). Machine: {machine['cpu']}, "
            f"{machine['cores']} cores, {machine.get('memory_gib', '?')} GiB, Python {machine['python']}, "
            f"{machine['mpi']}, torch {', '.join(versions)}. Method: bench/train.py's docstring "
            "(contenders alternate within each configuration's run, warm-up steps excluded, medians of "
            "the slowest rank's step). Plot: `bench/results/train.png`.\n\n"
        )
        with open(append_to, "a") as f:
            f.write(header + text)
        print(f"appended to {append_to}")


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["resnet18", "alexnet"], choices=list(INPUTS))
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: every rank on GPU 0 (into OUT_cuda)"
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--networks", nargs="+", default=["shm", "1gbit"])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after each build")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 warm-up, 2 steps")
    parser.add_argument(
        "--horovod-script", default=HVD_SCRIPT, help="Horovod's benchmark on gflow.torch (run if present)"
    )
    parser.add_argument("--no-horovod-script", action="store_true")
    parser.add_argument("--out", default=OUT)
    parser.add_argument(
        "--plot", help=f"where the plot goes (default: {PLOT} with --append-results, else OUT/train.png)"
    )
    parser.add_argument("--append-results", action="store_true", help="append the report to bench/RESULTS.md")
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--network", help=argparse.SUPPRESS)
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = "python bench/train.py " + " ".join(sys.argv[1:])
    if args.device == "cuda" and args.out == OUT:
        args.out = OUT + "_cuda"
    if args.quick:  # a smoke run: its own folder, so it never mixes with the measured figures
        args.rounds, args.warmup, args.steps = 1, 1, 2
        if args.out == OUT:
            args.out = OUT + "_quick"
    if args.plot is None:  # only a run that goes into RESULTS.md replaces the committed plot
        args.plot = PLOT if args.append_results and not args.quick else os.path.join(args.out, "train.png")
    if args.report:
        report(args.out, args.plot, RESULTS_MD if args.append_results else None, command)
        return
    if importlib.util.find_spec("gflow.torch") is None:
        missing = [c for c in args.contenders if c in GFLOW]
        if missing:
            print(f"gflow.torch not importable: leaving out {', '.join(missing)}", flush=True)
        args.contenders = [c for c in args.contenders if c not in GFLOW]
    hvd_script = os.path.exists(args.horovod_script) and not args.no_horovod_script
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for model in args.models:
        side, batch = INPUTS[model]
        for network in args.networks:
            for p in args.procs:
                if p == 1 and network != "shm":
                    continue  # no network at p = 1
                print(f"--- {model} {side}x{side}, batch {batch}/rank, p={p}, {network} ---", flush=True)
                worker_args = [
                    "--worker", "--model", model, "--network", network, "--side", str(side),
                    "--batch", str(batch), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--out", args.out, "--device", args.device,
                    "--contenders", *args.contenders,
                ]  # fmt: skip
                rate = None if network == "shm" else netem.parse_rate(network)
                netem.launch(os.path.abspath(__file__), p, worker_args, rate)
                if hvd_script and p > 1 and "gflow dense" in args.contenders:
                    path = _json_path(args.out, model, p, network)
                    result = json.load(open(path))
                    for sparse in (False, True):
                        row = run_horovod_script(model, p, network, args, sparse)
                        if row:
                            result["rows"].append(row)
                    _common.write_json(path, result)
    report(args.out, args.plot, RESULTS_MD if args.append_results else None, command)


if __name__ == "__main__":
    main()
