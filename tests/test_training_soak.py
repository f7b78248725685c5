"""A property-based training soak: hypothesis draws whole training programs (tests/training_programs.py)
for gflow.torch.DistributedOptimizer and gflow.DataParallel and runs them on every rank, step by step.

After every step, every rank's weights must be bitwise identical (MPI's own allgather of the bytes) and
equal a single-process float64 reference of the same program (each rank's loss averaged, as data
parallelism averages gradients; the same schedulers, freezing, clipping and skipped steps), within

    |w - w_ref| <= 4 * p * u * path + 1e-5 * (|w_ref| + path) + 1e-6

per element, where u is the unit roundoff of the wire dtype (0 for float32, 2**-11 for fp16, 2**-8 for
bf16; p ranks: one rounding of each rank's share and p - 1 roundings of partial sums, each at most
u * mean_r |g_r|), and path is what the reference's per-element steps could move the weight: the sum
over applied steps of lr * B, B the momentum recursion on mean_r |g_r| (times the clip coefficient).
The 1e-5 terms are float32 against float64.

Programs gflow refuses, and what it must do then:

- two named hvd.allreduce_async started in another order on one rank: MismatchError (a
  HorovodInternalError) on every rank at synchronize(), no handle returning mixed values; the optimizer
  step they were in flight with may fail too, provided it fails on every rank alike (a failed collective
  may fail the ones queued behind it). Training then goes on from a consistent state: a refused update
  is not applied on any rank (the reference skips it), a refused step leaves the loss scale as it was,
  the program goes on with its next step, and every later step is checked as usual.
- a blocking metric (hvd.allreduce, gflow.allreduce on DataParallel's communicator) on rank 0 only,
  between backward and step (Program.crossed): gflow finds the crossed waits within seconds and raises
  MismatchError ("crossed waits") on every rank, on rank 0 from the metric, on the others from the step
  (a HorovodInternalError too, for gflow.torch). No rank applies the step (weights bitwise unchanged, the
  same on every rank; the loss scale unchanged). By design the communicator's blocking collectives then
  fail on every rank (the abandoned collective's messages stay posted), so the program ends there and
  its communicator is left behind: the soak trains on a duplicate of COMM_WORLD of its own (Channel),
  and the next program gets a fresh one. A stall abort (STALL_ABORT_S) ends a job that hangs instead.
- (torch, CSC) a layer frozen or unfrozen after wrapping with DistributedOptimizer(sparse=...)
  (Program.refreeze_refused): the first backward after the change raises ValueError ("the parameters
  to reduce changed after wrapping") on every rank, from the gradient hook. The program ends there.

Every phase of a step (start, backward, step, scheduler, async) is followed by an agreement over MPI, so
an unexpected error on some ranks fails the example on every rank instead of leaving the others waiting.

The features (module FEATURES) can be switched off one by one: GFLOW_SOAK_DISABLE="amp_plain,metric_rank0"
draws programs without them; GFLOW_SOAK_FEATURES=... draws only from those listed. The number of
examples per world size: GFLOW_TEST_EXAMPLES (default EXAMPLES below).

test_the_soak_catches_planted_mutants plants a bug in gflow (monkeypatched, in the test's processes) and
checks that the same soak body, passing without it, fails under it.
"""

import dataclasses
import os
import time
import traceback

import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from training_programs import CLASSES, CYCLING, ExpectedScale, Program, Reference, batches, make_trainer

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)

FEATURES = {
    "fp16": "float16 on the wire (hvd.Compression.fp16, compression='fp16')",
    "bf16": "bfloat16 on the wire",
    "sparse": "CSC at density 1.0 (DistributedOptimizer moves SGD's momentum into it)",
    "bpps2": "backward_passes_per_step=2: gradients accumulate locally, the loss scaled by 1/2",
    "steplr": "StepLR",
    "onecycle": "OneCycleLR(cycle_momentum=True)",
    "cyclic": "CyclicLR(cycle_momentum=True)",
    "clip": "optimizer.synchronize(); clip_grad_norm_; with skip_synchronize(): step()",
    "amp_plain": "GradScaler: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()",
    "amp_horovod": "GradScaler, Horovod's recipe: synchronize(); unscale_(); [clip]; skip_synchronize: step",
    "loss_scaler": "DataParallel with gflow.LossScaler",
    "overflow": "a loss-scaled step where drawn ranks' local gradients hold inf: every rank skips it",
    "freeze_before": "layers frozen before wrapping, staying frozen",
    "unfreeze_after": "layers frozen before wrapping, unfrozen (requires_grad_(True)) at a drawn step",
    "freeze_after": "layers frozen after wrapping, at a drawn step",
    "sparse_refreeze": "(torch) freeze_after/unfreeze_after with CSC too: ValueError on every rank, the end",
    "checkpoint": "state_dict() at a drawn step, fresh objects load it; bitwise equal to a run never stopped",
    "checkpoint_plain": "(torch) a checkpoint whose optimizer part is a plain torch state dict (no 'gflow')",
    # (bitwise equal to the run never stopped too, except with CSC over fp16/bf16: see soak())
    "refreeze_checkpoint": "(torch) checkpoint/checkpoint_plain also drawn with freeze_after/unfreeze_after",
    "async_same": "two hvd.allreduce_async(name=...) in flight during the step, same order everywhere",
    "async_swapped": "... started in the other order on a drawn rank: MismatchError on every rank",
    "metric_all": "hvd.allreduce(loss) (gflow.allreduce for DataParallel) between backward and step",
    "metric_rank0": "... on rank 0 only: MismatchError (crossed waits) on every rank in seconds, the end",
}
_only = os.environ.get("GFLOW_SOAK_FEATURES")
_on = set(FEATURES) if _only is None else set(filter(None, _only.split(",")))
_off = set(filter(None, os.environ.get("GFLOW_SOAK_DISABLE", "").split(",")))
assert _on | _off <= set(FEATURES), f"unknown soak features: {sorted((_on | _off) - set(FEATURES))}"
ENABLED = _on - _off

EXAMPLES = int(os.environ.get("GFLOW_TEST_EXAMPLES", "12"))
TIMEOUT_S = 200  # per test and world size; the watchdog fires 10 s before (tests/conftest.py)
# A rank waiting this long in a gflow collective ends the job with gflow's stall report (which ranks
# have not entered it) instead of the watchdog's stack dump much later: crossed waits are found in
# seconds, and no wait of a working soak comes near this.
STALL_ABORT_S = 30.0
CROSSED_WITHIN_S = 15.0  # the longest a step with crossed waits may take to fail on every rank
UNIT_ROUNDOFF = {"none": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}
CROSSED = "crossed waits"
REFREEZE = "DistributedOptimizer(sparse=...): the parameters to reduce changed after wrapping"


@pytest.fixture(autouse=True)
def _stall_abort(monkeypatch):
    if not gflow.config.stall_abort_s:  # (unless GFLOW_STALL_ABORT_S says otherwise)
        monkeypatch.setattr(gflow.config, "stall_abort_s", STALL_ABORT_S)


class Channel:
    """The communicator the soak trains on: a duplicate of COMM_WORLD of its own, gflow.torch
    initialised on it. A program that ends in crossed waits leaves it unusable by design, and so may
    a failed example: retire() leaves it behind (not freed: the abandoned collective's messages are
    still posted), and the next program gets a fresh one. Every rank retires it at the same point.
    MPICH runs out of communicators after about 400 retired ones (each with gflow's duplicates), so
    after FAILED_CAP failed examples (a long shrink) the next failed ones keep theirs."""

    FAILED_CAP = 150
    comm = None
    failed = 0

    @classmethod
    def get(cls):
        if cls.comm is None:
            cls.comm = WORLD.Dup()
        hvd.init(comm=cls.comm)  # (every program: something else may have initialised it elsewhere)
        return cls.comm

    @classmethod
    def retire(cls, failed: bool = False) -> None:
        if failed:
            cls.failed += 1
            if cls.failed > cls.FAILED_CAP:
                return
        cls.comm = None


# --- what hypothesis draws ----------------------------------------------------------------------


def on(feature: str) -> bool:
    return feature in ENABLED


def options(default, *features):
    """default, then the enabled features (a feature's name is also its value)."""
    return [default, *[f for f in features if on(f)]]


@st.composite
def programs(draw, apis):
    api = draw(st.sampled_from(apis))
    steps = draw(st.integers(3, 6))
    depth = draw(st.integers(2, 3))
    dims = (draw(st.integers(3, 6)), *[draw(st.integers(4, 10)) for _ in range(depth - 1)], CLASSES)
    wire = draw(st.sampled_from(options("none", "fp16", "bf16")))
    sparse = None
    if on("sparse") and draw(st.booleans()):
        sparse = (draw(st.sampled_from([4, 16, 64])), draw(st.integers(0, 2)))
    schedule = draw(st.sampled_from(options("none", "steplr", "onecycle", "cyclic")))
    momentum = 0.9 if schedule in CYCLING else draw(st.sampled_from([0.0, 0.5, 0.9]))
    lr = draw(st.sampled_from([0.1, 0.05, 0.2]))
    passes = 2 if on("bpps2") and draw(st.booleans()) else 1
    if api == "torch":
        pattern = draw(st.sampled_from(options("plain", "clip", "amp_plain", "amp_horovod")))
    else:
        pattern = draw(st.sampled_from(options("plain", "loss_scaler")))
    clip = None
    if pattern == "clip" or (pattern == "amp_horovod" and on("clip") and draw(st.booleans())):
        clip = draw(st.sampled_from([0.05, 0.5]))  # 0.05: active (the norms are larger)
    amp = pattern in ("amp_plain", "amp_horovod", "loss_scaler")
    overflow_choices = [(), (), (0,), (1,), (2,), (0, 1)] if amp and on("overflow") else [()]
    overflow = tuple(draw(st.sampled_from(overflow_choices)) for _ in range(steps))
    frozen, events = [], []
    fates = options("train", "freeze_before", "unfreeze_after", "freeze_after")
    if api == "torch" and sparse is not None and not on("sparse_refreeze"):
        fates = [f for f in fates if f not in ("unfreeze_after", "freeze_after")]
    for layer in range(depth - 1):  # the last layer always trains: every step has a gradient
        fate = draw(st.sampled_from(fates))
        if fate in ("freeze_before", "unfreeze_after"):
            frozen.append(layer)
        if fate in ("unfreeze_after", "freeze_after"):
            events.append((draw(st.integers(1, steps - 1)), layer, fate == "unfreeze_after"))
    resumes = options(None, "checkpoint", *(["checkpoint_plain"] if api == "torch" else []))
    if api == "torch" and events and not on("refreeze_checkpoint"):
        resumes = [None]
    resume = draw(st.sampled_from(resumes))
    checkpoint = None if resume is None else draw(st.integers(1, steps - 1))
    plain_load = resume == "checkpoint_plain"
    asyncs = [None] * steps
    async_mode = draw(st.sampled_from(options(None, "async_same", "async_swapped")))
    if async_mode is not None:
        asyncs = [draw(st.sampled_from([None, "same"])) for _ in range(steps)]
        if async_mode == "async_swapped":  # one step: the rank that starts them swapped
            asyncs[draw(st.integers(0, steps - 1))] = draw(st.integers(0, 2))
    metric = [None] * steps
    metric_mode = draw(st.sampled_from(options(None, "metric_all", "metric_rank0")))
    if metric_mode is not None:
        metric = [draw(st.sampled_from([None, "all"])) for _ in range(steps)]
        if metric_mode == "metric_rank0":  # one step: on rank 0 only (the program ends there)
            crossed = draw(st.integers(0, steps - 1))
            metric[crossed] = "rank0"
            if asyncs[crossed] not in (None, "same"):
                # Not with async_swapped in the same step: its MismatchError would end the other
                # ranks' step before they wait for rank 0, and rank 0 would wait in the metric for
                # ranks outside gflow (the soak's own agreement): a deadlock of the program's own,
                # not crossed waits. Both named allreduce_async in the same order instead.
                asyncs[crossed] = "same"
    return Program(
        api=api, dims=dims, steps=steps, seed=draw(st.integers(0, 2**16)), lr=lr, momentum=momentum,
        schedule=schedule, passes=passes, wire=wire, sparse=sparse,
        threshold=draw(st.sampled_from([64, 512, 1 << 20])), pattern=pattern, clip=clip,
        scale_exp=draw(st.integers(2, 6)), growth_interval=draw(st.integers(1, 3)), overflow=overflow,
        frozen=tuple(frozen), events=tuple(events), checkpoint=checkpoint, plain_load=plain_load,
        asyncs=tuple(asyncs), metric=tuple(metric),
    )  # fmt: skip


# --- agreement: every phase's outcome, the same on every rank -----------------------------------


def gather(obj) -> list:
    """MPI's allgather of obj, after a barrier that waits politely: up to 3 ranks share 2 cores here,
    and MPI's own waits spin, slowing the rank they wait for (the soak took twice as long)."""
    request = WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)
    return WORLD.allgather(obj)


def attempt(fn):
    """fn()'s exception, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - judged by agree(), on every rank
        return exc
    return None


def _describe(exc) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(lines[-12:])


def refusal(exc) -> bool:
    return isinstance(exc, (gflow.GflowError, hvd.HorovodInternalError)) and bool(str(exc))


def _outcomes(everyone) -> str:
    return "\n".join(f"--- rank {r}: " + ("no error" if e is None else e[2]) for r, e in enumerate(everyone))


def agree(exc, label: str, may_refuse: bool = False) -> bool:
    """The phase `label` ended with `exc` here (None: no error). Every rank learns every rank's
    outcome, and every rank raises AssertionError naming what each rank got unless all ranks
    succeeded or (may_refuse) all raised the same gflow/Horovod error type. Returns whether the phase
    was refused (on every rank)."""
    mine = None if exc is None else (type(exc).__name__, refusal(exc), _describe(exc))
    everyone = gather(mine)
    succeeded = all(e is None for e in everyone)
    refused = all(e is not None and e[1] for e in everyone) and len({e[0] for e in everyone}) == 1
    if may_refuse:
        ok, want = succeeded or refused, "no error, or the same gflow/Horovod error on every rank"
    else:
        ok, want = succeeded, "no error"
    if not ok:
        raise AssertionError(f"{label}: expected {want}, got:\n{_outcomes(everyone)}")
    return refused


def expect_refusal(exc, label: str, kind: type, text: str, horovod: bool = False) -> None:
    """The phase `label` must have raised `kind` with `text` in its message on every rank (and, where
    `horovod`, a HorovodInternalError too); every rank raises AssertionError naming what each rank got
    otherwise."""
    fits = (
        isinstance(exc, kind)
        and text in str(exc)
        and (not horovod or isinstance(exc, hvd.HorovodInternalError))
    )
    everyone = gather(None if exc is None else (type(exc).__name__, fits, _describe(exc)))
    if not all(e is not None and e[1] for e in everyone):
        want = f"{kind.__name__}{' (a HorovodInternalError)' if horovod else ''} saying {text!r}"
        raise AssertionError(f"{label}: expected {want} on every rank, got:\n{_outcomes(everyone)}")


# --- the checks ---------------------------------------------------------------------------------


def check_weights(prog: Program, label: str, weights: dict, ref: Reference) -> None:
    """Bitwise identical on every rank, and within the stated bound of the float64 reference."""
    blobs = gather({n: w.tobytes() for n, w in weights.items()})
    expected = ref.weights()
    eps = 4 * WORLD.size * UNIT_ROUNDOFF[prog.wire]

    def check():
        for name in weights:
            differing = [r for r, b in enumerate(blobs) if b[name] != blobs[0][name]]
            assert not differing, f"{name}: the weights differ between ranks: rank 0 and ranks {differing}"
        for name, w in weights.items():
            r, path = expected[name], ref.path[name].numpy()
            tol = eps * path + 1e-5 * (np.abs(r) + path) + 1e-6
            err = np.abs(w.astype(np.float64) - r)
            if not np.all(err <= tol):  # NaN fails too
                i = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err - tol))), err.shape)
                raise AssertionError(
                    f"{name} differs from the float64 reference at {i}: got {w[i]!r}, expected {r[i]!r} "
                    f"(|error| {err[i]:.3g} > tolerance {tol[i]:.3g}; {int(np.sum(~(err <= tol)))} of "
                    f"{err.size} elements off)"
                )

    on_all_ranks(check, label)


def check_scale(label: str, scale: float, expected: float, applied, expected_applied: bool) -> None:
    """The scale is the expected one on every rank; DataParallel's synchronize() said whether to apply
    the step (`applied`; None for torch.amp.GradScaler, whose skip shows in the weights) alike."""
    scales, applies = gather(scale), gather(applied)

    def check():
        assert len(set(scales)) == 1, f"the loss scales differ between ranks: {scales}"
        assert scale == expected, f"the loss scale is {scale}, expected {expected}"
        if applied is not None:
            assert applies == [expected_applied] * len(applies), (
                f"DataParallel.synchronize() returned {applies} on the ranks, expected {expected_applied}"
            )

    on_all_ranks(check, label)


def close_to_mean(got, everyone, label: str) -> None:
    """got is the mean of everyone's values, within float32's rounding of a p-term sum."""
    stacked = np.stack([np.asarray(e, dtype=np.float64) for e in everyone])
    mean = stacked.mean(axis=0)
    tol = 4 * len(everyone) * 2.0**-24 * np.abs(stacked).mean(axis=0) + 1e-30
    got = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        fine = (np.abs(got - mean) <= tol) | (got == mean) | (np.isnan(got) & np.isnan(mean))
    assert np.all(fine), f"{label}: got {got}, expected the mean over the ranks {mean}"


# --- the soak body ------------------------------------------------------------------------------


def soak(prog: Program) -> dict:
    """Run prog on every rank with every check; return the final weights (at its end(), where gflow
    refused a step by design)."""
    final = run_on_channel(prog)
    # The same program never stopped: bitwise the same weights. Not where a plain torch state dict
    # resumed CSC over a compressed wire: each rank's residual then holds the wire's rounding of what
    # it sent (gflow/fusion/sparse.py), gflow's state, which a plain state dict does not carry
    # (the fresh optimizer's residuals stay zero: DistributedOptimizer.load_state_dict); such a run is
    # checked against the reference only, as every run is after every step. (Nor where the program
    # ended before its checkpoint: then nothing was resumed.)
    exact = not (prog.plain_load and prog.sparse is not None and prog.wire != "none")
    if prog.checkpoint is not None and prog.checkpoint < prog.end() and exact:
        whole = run_on_channel(dataclasses.replace(prog, checkpoint=None, plain_load=False))

        def check():
            for name, w in final.items():
                assert w.tobytes() == whole[name].tobytes(), (
                    f"{name}: resumed at step {prog.checkpoint} differs from the run never stopped "
                    f"(max |difference| {np.max(np.abs(w.astype(np.float64) - whole[name])):.3g})"
                )

        on_all_ranks(check, "checkpoint and resume against the run never stopped")
    return final


def run_on_channel(prog: Program) -> dict:
    """run(prog) on the soak's communicator; retired after crossed waits (by design), or a failure."""
    comm = Channel.get()
    try:
        final, usable = run(prog, comm)
    except BaseException:  # (raised on every rank alike: the checks fail everywhere at once)
        Channel.retire(failed=True)
        raise
    if not usable:
        Channel.retire()
    return final


def run(prog: Program, comm) -> tuple:
    """(the final weights, whether comm is still usable)."""
    rank = WORLD.rank
    x, y = batches(prog)
    rng = np.random.default_rng([prog.seed, rank])
    box = {}
    agree(attempt(lambda: box.setdefault("trainer", make_trainer(prog, comm))), "building the trainer")
    trainer = box["trainer"]
    ref = Reference(prog, trainer.weights())
    check_weights(prog, "broadcast parameters", trainer.weights(), ref)
    scale = ExpectedScale(prog, min_scale=0.0 if prog.api == "torch" else 1.0) if prog.amp else None
    for s in range(prog.end()):
        where = f"step {s}"
        trainer.applied = None
        if s == prog.checkpoint:
            agree(attempt(lambda: trainer.restart(ref.user_momentum)), f"{where}: checkpoint and resume")
        before = trainer.weights()
        swapped = prog.swapped_rank(s)
        tensors = {k: torch.from_numpy(rng.standard_normal(7).astype(np.float32)) for k in "ab"}
        handles, state = {}, {}

        def start(s=s, swapped=swapped, tensors=tensors, handles=handles):
            trainer.set_requires_grad(prog.requires_grad(s))
            if prog.asyncs[s] is not None:
                for key in "ba" if rank == swapped else "ab":
                    handles[key] = hvd.allreduce_async(tensors[key], name=f"soak.{key}")
            trainer.zero_grad()

        agree(attempt(start), f"{where}: start (freezing, allreduce_async, zero_grad)")

        def backward(s=s, state=state):
            state["loss"] = trainer.backward(s, x, y)

        failed = attempt(backward)
        if prog.refreeze_refused(s):  # refused by design: the program ends here
            expect_refusal(
                failed, f"{where}: backward after (un)freezing a layer under CSC", ValueError, REFREEZE
            )
            check_unapplied(prog, where, before, trainer.weights(), ref)
            if handles:
                check_async(where, handles, tensors, swapped)
            return trainer.weights(), True
        agree(failed, f"{where}: backward")

        def step(s=s, state=state):
            m = prog.metric[s]
            if m == "all" or (m == "rank0" and rank == 0):
                state["metric"] = trainer.metric(state["loss"])
            trainer.step()

        if prog.crossed(s):  # refused by design: the program ends here, its communicator unusable
            label = f"{where}: a metric on rank 0 only between backward and the optimizer step"
            horovod = prog.api == "torch" and rank != 0
            began = time.monotonic()
            failed = attempt(step)
            took = gather(time.monotonic() - began)
            expect_refusal(failed, label, gflow.MismatchError, CROSSED, horovod)
            on_all_ranks(lambda took=took: check_quick(took), label)
            check_unapplied(prog, where, before, trainer.weights(), ref)
            if handles:
                check_async(where, handles, tensors, swapped)
            if scale is not None:
                check_scale(f"{where}: loss scale", trainer.scale, scale.scale, trainer.applied, False)
            return trainer.weights(), False
        refused = agree(attempt(step), f"{where}: optimizer step", prog.may_refuse(s))
        agree(attempt(trainer.scheduler_step), f"{where}: scheduler step")
        if prog.metric[s] == "all":
            losses = gather(state["loss"].numpy())
            on_all_ranks(lambda st=state, ls=losses: close_to_mean(st["metric"], ls, "metric"), where)
        if handles:
            check_async(where, handles, tensors, swapped)
        overflow = bool(prog.amp and prog.overflows(s))
        ref.step(s, x, y, apply=not (refused or overflow))
        check_weights(prog, f"{where}: weights", trainer.weights(), ref)
        if scale is not None:
            expected = scale.scale if refused else scale.update(overflow)
            check_scale(f"{where}: loss scale", trainer.scale, expected, trainer.applied, not overflow)
    return trainer.weights(), True


def check_quick(took: list) -> None:
    """Crossed waits were found within seconds (gflow checks after 1 s of waiting, again at 2, 4, 8 s
    where its engine was still busy), not left to a stall abort or the watchdog."""
    slowest = max(took)
    assert slowest < CROSSED_WITHIN_S, (
        f"the crossed waits took {slowest:.1f} s to fail on some rank (per rank: "
        + ", ".join(f"{t:.1f} s" for t in took)
        + f"); expected under {CROSSED_WITHIN_S:g} s"
    )


def check_unapplied(prog: Program, where: str, before: dict, weights: dict, ref: Reference) -> None:
    """A step refused by design applied nothing: every rank's weights bitwise as before the step (and
    so still the same on every rank, and the reference's, which skips it)."""

    def check():
        for name, w in weights.items():
            assert w.tobytes() == before[name].tobytes(), (
                f"{name}: changed by the refused step (max |difference| "
                f"{np.max(np.abs(w.astype(np.float64) - before[name])):.3g})"
            )

    on_all_ranks(check, f"{where}: the refused step applied nothing")
    check_weights(prog, f"{where}: weights after the refused step", weights, ref)


def check_async(where: str, handles: dict, tensors: dict, swapped) -> None:
    """Both handles synchronized. The same order everywhere: right values, no error. Swapped on one
    rank: synchronize() raises MismatchError on every rank (for the first of the two it waits for, at
    least; the other may fail too, with any gflow/Horovod error), and no handle returns mixed values."""
    results, errors = {}, {}
    for key in "ab":
        try:
            results[key] = hvd.synchronize(handles[key]).numpy()
        except Exception as exc:  # noqa: BLE001 - judged below, on every rank
            errors[key] = exc
    everyone = gather({k: t.numpy() for k, t in tensors.items()})
    mismatch = gather(any(isinstance(e, gflow.MismatchError) for e in errors.values()))
    label = f"{where}: two named allreduce_async, " + (
        "the same order" if swapped is None else f"swapped on rank {swapped}"
    )

    def check():
        if swapped is None:
            assert not errors, f"unexpected errors: {[_describe(e) for e in errors.values()]}"
        else:
            assert all(mismatch), f"MismatchError raised per rank: {mismatch}"
            for e in errors.values():
                assert refusal(e) and isinstance(e, hvd.HorovodInternalError), f"not a Horovod error: {e!r}"
        for key, value in results.items():  # never mixed values
            close_to_mean(value, [e[key] for e in everyone], f"allreduce_async {key!r}")

    on_all_ranks(check, label)


# --- the soak -----------------------------------------------------------------------------------


@pytest.mark.parallel([2, 3])
@pytest.mark.timeout(TIMEOUT_S)
@settings(max_examples=EXAMPLES)
@given(prog=programs(("torch",)))
def test_distributed_optimizer_training_soak(prog):
    soak(prog)


@pytest.mark.parallel([2, 3])
@pytest.mark.timeout(TIMEOUT_S)
@settings(max_examples=EXAMPLES)
@given(prog=programs(("dp_numpy", "dp_tensor")))
def test_data_parallel_training_soak(prog):
    soak(prog)


# --- the mutants: the soak must catch a planted bug ---------------------------------------------


def _unscale_skips_first(monkeypatch) -> None:
    """LossScaler.unscale leaves the first gradient it is given in each step scaled."""
    unscale, update = gflow.LossScaler.unscale, gflow.LossScaler.update

    def mutant_unscale(self, grad):
        if not getattr(self, "_mutant_skipped", False):
            self._mutant_skipped = True
            return False
        return unscale(self, grad)

    def mutant_update(self, overflow):
        self._mutant_skipped = False
        return update(self, overflow)

    monkeypatch.setattr(gflow.LossScaler, "unscale", mutant_unscale)
    monkeypatch.setattr(gflow.LossScaler, "update", mutant_update)


def _push_loses_write_back(monkeypatch) -> None:
    """DataParallel.push hands a copy of the first gradient of each step to the reduction: that
    gradient is reduced, but never written back (it keeps its local value)."""
    push, synchronize = gflow.DataParallel.push, gflow.DataParallel.synchronize

    def mutant_push(self, key, grad=None):
        if not getattr(self, "_mutant_copied", False):
            self._mutant_copied = True
            grad = self.gradient_buffers()[key] if grad is None else grad
            grad = grad.clone() if isinstance(grad, torch.Tensor) else np.array(grad, copy=True)
        return push(self, key, grad)

    def mutant_synchronize(self, **kw):
        self._mutant_copied = False
        return synchronize(self, **kw)

    monkeypatch.setattr(gflow.DataParallel, "push", mutant_push)
    monkeypatch.setattr(gflow.DataParallel, "synchronize", mutant_synchronize)


def _mutant_program(api: str, pattern: str) -> Program:
    return Program(
        api=api, dims=(4, 6, CLASSES), steps=3, seed=7, lr=0.1, momentum=0.5, schedule="none", passes=1,
        wire="none", sparse=None, threshold=64, pattern=pattern, clip=None, scale_exp=4, growth_interval=2,
        overflow=((),) * 3, frozen=(), events=(), checkpoint=None, plain_load=False, asyncs=(None,) * 3,
        metric=(None,) * 3,
    )  # fmt: skip


# mutant -> (plant it, the programs it must fail): retarget a mutant by changing its function here
MUTANTS = {
    "unscale_skips_first": (
        _unscale_skips_first,
        [_mutant_program("dp_numpy", "loss_scaler"), _mutant_program("dp_tensor", "loss_scaler")],
    ),
    "push_loses_write_back": (
        _push_loses_write_back,
        [_mutant_program("torch", "plain"), _mutant_program("dp_numpy", "plain")],
    ),
}


def plant_mutant(monkeypatch, name: str) -> None:
    MUTANTS[name][0](monkeypatch)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_soak_catches_planted_mutants(monkeypatch, mutant):
    progs = MUTANTS[mutant][1]
    for prog in progs:
        soak(prog)  # passes on gflow as it is
    plant_mutant(monkeypatch, mutant)
    for prog in progs:
        with pytest.raises(AssertionError, match="differs from the float64 reference|differ between ranks"):
            soak(prog)
