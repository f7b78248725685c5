"""The training programs of tests/test_training_soak.py: what hypothesis draws (Program), the models and
data, the trainers under test (gflow.torch.DistributedOptimizer, gflow.DataParallel over NumPy arrays
with a hand-written backward or over CPU tensors with torch autograd) and the single-process float64
reference of the same program.

A Program is plain data, the same on every rank (hypothesis draws it derandomized); ranks named in it
are taken modulo the world size. Every rank builds every rank's batches from the program's seed, so
the reference sees all of them. The trainers run on the communicator they are given (gflow.torch
initialised on it, DataParallel, LossScaler and the broadcast made with comm=it): the soak's own
duplicate of COMM_WORLD, which a program ending in crossed waits leaves broken (see Program.crossed).
"""

import copy
import dataclasses
import io
import math
import pickle

import numpy as np
import torch
import torch.nn.functional as F
from helpers import WORLD

import gflow
import gflow.torch as hvd

MICRO = 3  # samples per rank per backward pass
CLASSES = 3
CYCLING = ("onecycle", "cyclic")  # the schedulers that set the param groups' momentum


@dataclasses.dataclass(frozen=True)
class Program:
    """One drawn training program (see tests/test_training_soak.py for what each field exercises)."""

    api: str  # "torch" (DistributedOptimizer), "dp_numpy", "dp_tensor" (DataParallel)
    dims: tuple  # layer widths, the input's first; len(dims) - 1 Linear layers, tanh between them
    steps: int
    seed: int
    lr: float
    momentum: float  # the user's SGD momentum (the cycling schedulers overwrite it)
    schedule: str  # "none", "steplr", "onecycle", "cyclic"; scheduler.step() after every step
    passes: int  # backward_passes_per_step: gradients accumulate locally, the loss scaled by 1/passes
    wire: str  # "none", "fp16", "bf16": the dtype on the wire
    sparse: tuple | None  # CSC at density 1.0: (chunk_elems, warmup_steps), else None
    threshold: int  # the fusion segment size, bytes
    pattern: str  # torch: "plain", "clip", "amp_plain", "amp_horovod"; DataParallel: "plain", "loss_scaler"
    clip: float | None  # max_norm of clip_grad_norm_ ("clip", and optionally "amp_horovod")
    scale_exp: int  # the loss scaler's initial scale, 2**scale_exp
    growth_interval: int
    overflow: tuple  # per step: the ranks whose local gradient holds inf (amp patterns only)
    frozen: tuple  # layers frozen before wrapping
    events: tuple  # (step, layer, requires_grad): frozen or unfrozen on every rank at that step's start
    checkpoint: int | None  # save at the start of this step, resume into fresh objects
    plain_load: bool  # (torch) the optimizer part resumed from a plain torch state dict (no "gflow")
    asyncs: tuple  # per step: None, "same", or the rank that starts the two named allreduces swapped
    metric: tuple  # per step: None, "all" (the loss reduced on every rank) or "rank0" (on rank 0 only)

    @property
    def amp(self) -> bool:
        return self.pattern in ("amp_plain", "amp_horovod", "loss_scaler")

    def overflows(self, step: int) -> set:
        return {r % WORLD.size for r in self.overflow[step]}

    def swapped_rank(self, step: int):
        a = self.asyncs[step]
        return None if a in (None, "same") else a % WORLD.size

    def crossed(self, step: int) -> bool:
        """A blocking collective on rank 0 only (the metric), between backward and step, while the
        other ranks wait in the step for the gradients' reduction on gflow's background channel:
        crossed waits. gflow finds them within seconds and raises MismatchError ("crossed waits") on
        every rank, on rank 0 from the metric's call, on the others from the step (a
        HorovodInternalError too, for gflow.torch); no rank applies the step. The communicator's
        blocking collectives then fail on every rank by design (the abandoned collective's messages
        stay posted): the program ends there, and its communicator is left behind."""
        return self.metric[step] == "rank0" and WORLD.size > 1

    def refreeze_refused(self, step: int) -> bool:
        """(torch, CSC) the first step whose parameters to reduce differ from those at wrapping (a
        layer frozen or unfrozen since): DistributedOptimizer(sparse=...) refuses it by design, with
        ValueError from the gradient hook (out of backward()) on every rank. The program ends there.
        (A resumed trainer wraps with the same parameters as the first: those of `frozen`.)"""
        changes = [at for at, _, _ in self.events]
        return self.api == "torch" and self.sparse is not None and bool(changes) and step == min(changes)

    def end(self) -> int:
        """The number of steps the program runs: it ends at a step gflow refuses by design (crossed
        waits, or refreezing with CSC), that step included."""
        return next(
            (s + 1 for s in range(self.steps) if self.crossed(s) or self.refreeze_refused(s)), self.steps
        )

    def may_refuse(self, step: int) -> bool:
        """gflow may refuse this step's optimizer step, provided it does so on every rank alike: two
        named allreduce_async in flight in another order on one rank fail, and a failed collective
        may fail the reductions queued behind it on the same communicator."""
        return self.swapped_rank(step) is not None

    def requires_grad(self, step: int) -> dict:
        """layer -> requires_grad during this step."""
        flags = {layer: layer not in self.frozen for layer in range(len(self.dims) - 1)}
        for at, layer, value in sorted(self.events):
            if at <= step:
                flags[layer] = value
        return flags


# --- the model and the data ---------------------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def make_mlp(prog: Program, seed: int, dtype=torch.float32) -> MLP:
    torch.manual_seed(seed)
    return MLP(prog.dims).to(dtype)


def names_of(prog: Program) -> list:
    """The parameters' names in model order (as named_parameters() gives them)."""
    return [f"layers.{i}.{kind}" for i in range(len(prog.dims) - 1) for kind in ("weight", "bias")]


def layer_of(name: str) -> int:
    return int(name.split(".")[1])


def batches(prog: Program):
    """Every rank's micro-batches of every step (the same on every rank): x[step][rank][pass], y[...]."""
    g = torch.Generator().manual_seed(prog.seed)
    shape = (prog.steps, WORLD.size, prog.passes, MICRO)
    x = torch.randn(*shape, prog.dims[0], generator=g) * 1.5
    y = torch.randint(0, CLASSES, shape, generator=g)
    return x, y


def make_scheduler(prog: Program, opt):
    if prog.schedule == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if prog.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=prog.lr, total_steps=prog.steps + 1, cycle_momentum=True,
            base_momentum=0.8, max_momentum=0.95,
        )  # fmt: skip
    if prog.schedule == "cyclic":
        return torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=prog.lr / 4, max_lr=prog.lr, step_size_up=2, cycle_momentum=True,
            base_momentum=0.8, max_momentum=0.9,
        )  # fmt: skip
    return None


def sparse_settings(prog: Program, momentum: float | None = None) -> dict | None:
    if prog.sparse is None:
        return None
    chunk_elems, warmup = prog.sparse
    settings = dict(density=1.0, chunk_elems=chunk_elems, warmup_steps=warmup)
    if momentum:
        settings["momentum"] = momentum
    return settings


def roundtrip(obj):
    """obj through torch.save/torch.load, as a checkpoint on disk: nothing shared with the original."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# --- the reference ------------------------------------------------------------------------------


class Reference:
    """The same program in one process, in float64: each step's gradient is the mean over the ranks
    of each rank's loss gradient (data parallelism's average); skipped steps are not applied; the same
    schedulers, freezing and clipping. With CSC (density 1, momentum factor masking) the update is
    plain SGD's: the momentum the scheduler or the user set is not applied by anyone.

    For the tolerance it keeps, per element, `path`: sum over steps of lr * B, where B is the momentum
    recursion on mean over ranks of |g_r| (after clipping): the most a per-element relative error of
    the communicated gradients (eps * |g_r|, each step) can move a weight."""

    def __init__(self, prog: Program, init: dict):
        self.prog = prog
        self.model = make_mlp(prog, 0, torch.float64)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(torch.as_tensor(init[name], dtype=torch.float64))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=prog.lr, momentum=prog.momentum)
        self.sched = make_scheduler(prog, self.opt)
        self.user_momentum = self.opt.param_groups[0]["momentum"]  # what a plain SGD would hold
        self._force_sparse_momentum()
        self.path = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}
        self._magnitude = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}

    def _force_sparse_momentum(self):
        if self.prog.sparse is not None:
            for group in self.opt.param_groups:
                group["momentum"] = 0.0

    def step(self, s: int, x, y, apply: bool) -> None:
        """Step s; its update only if `apply` (not a refused or overflowed step)."""
        prog, size = self.prog, WORLD.size
        flags = prog.requires_grad(s)
        named = list(self.model.named_parameters())
        for name, p in named:
            p.requires_grad_(flags[layer_of(name)])
        trainable = [(n, p) for n, p in named if p.requires_grad]
        total = {n: torch.zeros_like(p) for n, p in trainable}
        magnitude = {n: torch.zeros_like(p) for n, p in trainable}
        for r in range(size):
            loss = 0
            for k in range(prog.passes):
                loss = loss + F.cross_entropy(self.model(x[s, r, k].double()), y[s, r, k]) / prog.passes
            grads = torch.autograd.grad(loss, [p for _, p in trainable])
            for (n, _), g in zip(trainable, grads, strict=True):
                total[n] += g / size
                magnitude[n] += g.abs() / size
        self.opt.zero_grad(set_to_none=True)
        for n, p in trainable:
            p.grad = total[n]
        coefficient = 1.0
        if prog.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in trainable], prog.clip))
            coefficient = min(1.0, prog.clip / (norm + 1e-6))
        group = self.opt.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        if apply:
            self.opt.step()
            for n, _ in trainable:
                b = self._magnitude[n]
                b.mul_(momentum).add_(magnitude[n] * coefficient)
                self.path[n] += lr * b
        if self.sched is not None:
            self.sched.step()
            self.user_momentum = self.opt.param_groups[0]["momentum"]
            self._force_sparse_momentum()

    def weights(self) -> dict:
        return {n: p.detach().clone().numpy() for n, p in self.model.named_parameters()}


class ExpectedScale:
    """The loss scale a scaler must hold: halved after a step that some rank overflowed, doubled after
    growth_interval good steps in a row (GradScaler's and LossScaler's rule; LossScaler stops at 1);
    a refused step (an error before the scaler's update) changes nothing."""

    def __init__(self, prog: Program, min_scale: float):
        self.scale, self.good, self.interval, self.min_scale = (
            2.0**prog.scale_exp,
            0,
            prog.growth_interval,
            min_scale,
        )

    def update(self, overflow: bool) -> float:
        if overflow:
            self.scale, self.good = max(self.scale * 0.5, self.min_scale), 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.scale, self.good = self.scale * 2.0, 0
        return self.scale


# --- the trainers under test --------------------------------------------------------------------


WIRE = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "bf16": hvd.Compression.bf16}


class TorchTrainer:
    """torch.optim.SGD wrapped in gflow.torch.DistributedOptimizer (Horovod's recipe), on the
    communicator gflow.torch was initialised on (comm)."""

    def __init__(self, prog: Program, comm):
        self.prog, self.comm = prog, comm
        self.build(seed=prog.seed + 1 + WORLD.rank)  # ranks differ: broadcast_parameters must fix it
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def build(self, seed: int) -> None:
        prog = self.prog
        self.model = make_mlp(prog, seed)
        for name, p in self.model.named_parameters():
            p.requires_grad_(layer_of(name) not in prog.frozen)
        sgd = torch.optim.SGD(self.model.parameters(), lr=prog.lr, momentum=prog.momentum)
        self.opt = hvd.DistributedOptimizer(
            sgd,
            named_parameters=self.model.named_parameters(),
            compression=WIRE[prog.wire],
            backward_passes_per_step=prog.passes,
            threshold_bytes=prog.threshold,
            sparse=sparse_settings(prog),
        )
        self.sched = make_scheduler(prog, self.opt)
        self.scaler = None
        if prog.pattern in ("amp_plain", "amp_horovod"):
            self.scaler = torch.amp.GradScaler(
                "cpu", init_scale=2.0**prog.scale_exp, growth_interval=prog.growth_interval
            )

    def weights(self) -> dict:
        return {n: p.detach().numpy().copy() for n, p in self.model.named_parameters()}

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def set_requires_grad(self, flags: dict) -> None:
        for name, p in self.model.named_parameters():
            p.requires_grad_(flags[layer_of(name)])

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def backward(self, s: int, x, y) -> torch.Tensor:
        prog, r = self.prog, WORLD.rank
        total = 0.0
        for k in range(prog.passes):
            loss = F.cross_entropy(self.model(x[s, r, k]), y[s, r, k]) / prog.passes
            if k == 0 and r in prog.overflows(s):
                loss = loss * math.inf  # this rank's local gradient holds inf/NaN
            total = total + loss.detach()
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return total.reshape(1)

    def step(self) -> None:
        prog, opt, scaler = self.prog, self.opt, self.scaler
        params = self.model.parameters()
        if prog.pattern == "plain":
            opt.step()
        elif prog.pattern == "clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(params, prog.clip)
            with opt.skip_synchronize():
                opt.step()
        elif prog.pattern == "amp_plain":  # PyTorch's own lines, no synchronize()
            scaler.step(opt)
            scaler.update()
        else:  # Horovod's recipe
            opt.synchronize()
            scaler.unscale_(opt)
            if prog.clip is not None:
                torch.nn.utils.clip_grad_norm_(params, prog.clip)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()

    def metric(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the ranks, blocking (a logged metric)."""
        return hvd.allreduce(loss, name="loss")

    def scheduler_step(self) -> None:
        if self.sched is not None:
            self.sched.step()

    def restart(self, user_momentum: float) -> None:
        """Save everything, build fresh objects (another initialisation) and load it."""
        prog = self.prog
        flags = {name: p.requires_grad for name, p in self.model.named_parameters()}
        saved = roundtrip(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "sched": None if self.sched is None else self.sched.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict(),
            }
        )
        self.build(seed=prog.seed + 1000 + WORLD.rank)
        self.model.load_state_dict(saved["model"])
        opt_state = saved["opt"]
        if prog.plain_load:  # what a plain torch.optim.SGD of the same schedule would have saved
            opt_state = {k: copy.deepcopy(v) for k, v in opt_state.items() if k != "gflow"}
            for group in opt_state["param_groups"]:
                group["momentum"] = user_momentum
        self.opt.load_state_dict(opt_state)
        if self.sched is not None:
            self.sched.load_state_dict(saved["sched"])
        if self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
        for name, p in self.model.named_parameters():
            p.requires_grad_(flags[name])


class DataParallelTrainer:
    """gflow.DataParallel under a hand-written SGD (momentum as torch's): NumPy float32 parameters with
    a hand-written backward writing into gradient_buffers() ("dp_numpy"), or float32 CPU tensors with
    torch autograd, their .grad pushed ("dp_tensor"). Gradients are pushed last layer first, frozen
    parameters not at all (DataParallel pushes zeros for them) and not updated. The learning rate and
    momentum of each step come from the same torch scheduler on a stand-in optimizer. With CSC the
    momentum is given to CSC (at density 1 the update is then plain SGD's) and the own SGD has none."""

    def __init__(self, prog: Program, comm):
        self.prog, self.comm = prog, comm
        self.names = names_of(prog)
        self.build(seed=prog.seed + 1 + WORLD.rank)
        gflow.broadcast_parameters(self._arrays(), comm=comm)

    def _arrays(self) -> list:
        if self.prog.api == "dp_numpy":
            return [self.params[n] for n in self.names]
        return [self.params[n].data for n in self.names]

    def build(self, seed: int) -> None:
        prog = self.prog
        model = make_mlp(prog, seed)
        if prog.api == "dp_numpy":
            self.params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        else:
            self.params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
        self.flags = {layer: layer not in prog.frozen for layer in range(len(prog.dims) - 1)}
        self.scaler = None
        if prog.pattern == "loss_scaler":
            self.scaler = gflow.LossScaler(
                init_scale=2.0**prog.scale_exp, growth_interval=prog.growth_interval, comm=self.comm
            )
        self.dp = gflow.DataParallel(
            {n: self.params[n] if prog.api == "dp_numpy" else self.params[n].data for n in self.names},
            compression=None if prog.wire == "none" else prog.wire,
            sparse=sparse_settings(prog, momentum=prog.momentum),
            loss_scaler=self.scaler,
            threshold_bytes=prog.threshold,
            comm=self.comm,
        )
        self.grads = self.dp.gradient_buffers() if prog.api == "dp_numpy" else None
        self.velocity = {n: None for n in self.names}
        stand_in = torch.zeros(1, requires_grad=True)
        self.shadow = torch.optim.SGD([stand_in], lr=prog.lr, momentum=prog.momentum)
        self.sched = make_scheduler(prog, self.shadow)

    def weights(self) -> dict:
        if self.prog.api == "dp_numpy":
            return {n: a.copy() for n, a in self.params.items()}
        return {n: p.detach().numpy().copy() for n, p in self.params.items()}

    @property
    def scale(self) -> float:
        return float(self.dp.loss_scale)

    def trainable(self, name: str) -> bool:
        return self.flags[layer_of(name)]

    def set_requires_grad(self, flags: dict) -> None:
        self.flags = dict(flags)
        if self.prog.api == "dp_tensor":
            for name, p in self.params.items():
                p.requires_grad_(flags[layer_of(name)])

    def zero_grad(self) -> None:
        if self.prog.api == "dp_numpy":
            for g in self.grads.values():
                g[...] = 0
        else:
            for p in self.params.values():
                p.grad = None

    def backward(self, s: int, x, y) -> torch.Tensor:
        prog, r = self.prog, WORLD.rank
        total = 0.0
        for k in range(prog.passes):
            upstream = self.scale / prog.passes
            if k == 0 and r in prog.overflows(s):
                upstream *= math.inf
            if prog.api == "dp_numpy":
                loss = self._numpy_backward(x[s, r, k].numpy(), y[s, r, k].numpy(), upstream)
            else:
                loss = self._autograd_backward(x[s, r, k], y[s, r, k], upstream)
            total += loss / prog.passes
        for name in reversed(self.names):  # backward's order; frozen ones are pushed as zeros
            if self.trainable(name):
                if prog.api == "dp_numpy":
                    self.dp.push(name)
                else:
                    self.dp.push(name, self.params[name].grad)
        return torch.tensor([total], dtype=torch.float32)

    def _numpy_backward(self, x, y, upstream) -> float:
        """Forward and backward of the MLP in float32 NumPy; the gradients (times upstream) are added
        into the trainable parameters' gradient buffers. Returns the loss."""
        p, n_layers = self.params, len(self.prog.dims) - 1
        acts = [x.astype(np.float32)]
        for i in range(n_layers):
            z = acts[-1] @ p[f"layers.{i}.weight"].T + p[f"layers.{i}.bias"]
            acts.append(np.tanh(z) if i < n_layers - 1 else z)
        logits = acts[-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss = float(-log_softmax[np.arange(len(y)), y].mean())
        dz = np.exp(log_softmax)
        dz[np.arange(len(y)), y] -= 1
        with np.errstate(over="ignore", invalid="ignore"):
            dz = (dz / len(y) * np.float32(upstream)).astype(np.float32)
            for i in reversed(range(n_layers)):
                w, b = f"layers.{i}.weight", f"layers.{i}.bias"
                if self.trainable(w):
                    self.grads[w] += dz.T @ acts[i]
                    self.grads[b] += dz.sum(axis=0)
                if i:
                    dz = (dz @ p[w]) * (1 - acts[i] ** 2)
        return loss

    def _autograd_backward(self, x, y, upstream) -> float:
        out = x
        n_layers = len(self.prog.dims) - 1
        for i in range(n_layers):
            out = F.linear(out, self.params[f"layers.{i}.weight"], self.params[f"layers.{i}.bias"])
            if i < n_layers - 1:
                out = torch.tanh(out)
        loss = F.cross_entropy(out, y)
        (loss * upstream).backward()
        return float(loss.detach())

    def step(self) -> None:
        prog = self.prog
        apply = self.applied = self.dp.synchronize()
        if not apply:
            return
        group = self.shadow.param_groups[0]
        lr = group["lr"]
        momentum = 0.0 if prog.sparse is not None else group["momentum"]
        with torch.no_grad():
            for name in self.names:
                if not self.trainable(name):
                    continue
                if prog.api == "dp_numpy":
                    w, g = self.params[name], self.grads[name]
                else:
                    w, g = self.params[name].data.numpy(), self.params[name].grad.numpy()
                if momentum:
                    v = self.velocity[name]
                    v = g.copy() if v is None else v * np.float32(momentum) + g
                    self.velocity[name] = v
                    g = v
                w -= np.float32(lr) * g

    def metric(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the ranks, blocking (gflow.allreduce on DataParallel's communicator)."""
        return gflow.allreduce(loss, "mean", comm=self.comm)

    def scheduler_step(self) -> None:
        if self.sched is not None:
            self.sched.step()

    def restart(self, user_momentum: float) -> None:
        flags = dict(self.flags)
        saved = pickle.loads(
            pickle.dumps(
                {
                    "weights": self.weights(),
                    "velocity": self.velocity,
                    "dp": self.dp.state_dict(),
                    "shadow": self.shadow.state_dict(),
                    "sched": None if self.sched is None else self.sched.state_dict(),
                }
            )
        )
        self.build(seed=self.prog.seed + 1000 + WORLD.rank)
        for name, value in saved["weights"].items():
            target = self.params[name] if self.prog.api == "dp_numpy" else self.params[name].data.numpy()
            target[...] = value
        self.velocity = saved["velocity"]
        self.dp.load_state_dict(saved["dp"])
        self.shadow.load_state_dict(saved["shadow"])
        if self.sched is not None:
            self.sched.load_state_dict(saved["sched"])
        self.set_requires_grad(flags)


def make_trainer(prog: Program, comm):
    return TorchTrainer(prog, comm) if prog.api == "torch" else DataParallelTrainer(prog, comm)
