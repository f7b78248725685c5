"""gflow.DataParallel and broadcast_parameters: the trainer kit over LazyAllreduce, at world sizes 1 to 4.

References are MPI's own Allreduce and float64 NumPy (tests/helpers.py); "identical" means bitwise, over
MPI's own allgather.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    WORLD,
    assert_close_to_reference,
    assert_same_on_all_ranks,
    on_all_ranks,
    random_array,
    rank_rng,
)
from mpi4py import MPI

import gflow
from gflow.runtime.context import context
from gflow.training.data_parallel import DataParallel, broadcast_parameters

# The layers above the collectives run at 1-3 ranks: the collectives under them are tested at 1-4
# (test_allreduce.py, test_hierarchical.py, ...), and 4 ranks each importing torch on the 2-core CI
# machine cost a third of the suite's time.
SIZES = [1, 2, 3]
SHAPES = {"w1": (12, 9), "b1": (9,), "w2": (9, 5), "b2": (5,), "scale": ()}


def make_params(seed, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng(seed)  # the same on every rank
    return {k: np.array(rng.standard_normal(s), dtype) for k, s in shapes.items()}


def random_grads(rng, params):
    return {k: np.array(rng.standard_normal(p.shape) * 3, p.dtype) for k, p in params.items()}


def fp16_close(y, x):
    """Within float16 rounding of the float64 mean: each rank's value and the result are rounded to
    float16 once, and p - 1 additions round in float16 (as tests/test_pipeline.py)."""
    everyone = np.stack(WORLD.allgather(x.astype(np.float64)))
    scale = np.abs(everyone).sum(axis=0) / WORLD.size
    tol = (WORLD.size + 2) * 2.0**-11 * scale + 2.0**-24
    assert np.all(np.abs(y.astype(np.float64) - everyone.mean(axis=0)) <= tol)


def push_in_backward_order(dp, keys, grads, buffers) -> dict:
    """Push each key's gradient, last layer first: written into its buffer from gradient_buffers()
    (buffers given) or as a copy of its own; {key: the array pushed}."""
    pushed = {}
    for key in reversed(keys):
        if buffers is not None:
            buffers[key][...] = grads[key]
            dp.push(key)
            pushed[key] = buffers[key]
        else:
            pushed[key] = grads[key].copy()
            dp.push(key, pushed[key])
    return pushed


def identical(params):
    """Every rank holds bitwise the same parameters."""
    for p in params.values():
        assert_same_on_all_ranks(np.ascontiguousarray(p))


@pytest.mark.parallel(SIZES)
def test_dense_equals_mpis_allreduce_mean():
    for dtype, threshold, use_buffers in [
        (np.float32, 64, True),  # many segments, pool views
        (np.float64, 1 << 20, True),
        (np.float32, 100, False),  # the trainer's own arrays
    ]:
        params = make_params(1, dtype)
        dp = DataParallel(params, threshold_bytes=threshold)
        buffers = dp.gradient_buffers() if use_buffers else None
        if use_buffers:  # pool views: one contiguous block when fused in one segment
            assert all(not b.flags.owndata for b in buffers.values())
        for step in range(3):
            grads = random_grads(rank_rng(10 * step + threshold), params)

            def check(grads=grads, buffers=buffers, dp=dp, step=step, params=params):
                pushed = push_in_backward_order(dp, list(params), grads, buffers)
                assert dp.synchronize() is True
                assert dp.step_count == step + 1
                assert all(dp.gradients()[k] is g for k, g in pushed.items())
                for key, g in pushed.items():
                    assert_close_to_reference(g, grads[key], "mean")
                    assert_same_on_all_ranks(g)

            on_all_ranks(check, f"{dtype.__name__} threshold={threshold} step={step}")


@pytest.mark.parallel(SIZES)
def test_device_parameters_get_a_device_pool(monkeypatch):
    """Numba device arrays as parameters: gradient_buffers() are device arrays carved out of a
    device pool, in the node's peer memory from two ranks (CUDA IPC; the simulator's twin here), and
    synchronize() leaves the mean in them."""
    from numba import cuda

    from gflow.collectives import hierarchical

    monkeypatch.setattr(gflow.config, "small_message_bytes", 0)  # (the node phase, small, for the simulator)
    monkeypatch.setattr(gflow.config, "shared_memory_min_bytes", 64)
    host = make_params(3)
    params = {k: cuda.to_device(v) for k, v in host.items()}
    dp = DataParallel(params, threshold_bytes=256)
    buffers = dp.gradient_buffers()
    in_pool = [any(p.place(b) is not None for p in hierarchical._pools) for b in buffers.values()]
    assert in_pool == [WORLD.size > 1] * len(buffers), in_pool
    for step in range(2):
        grads = random_grads(rank_rng(40 + step), host)
        for key in reversed(list(params)):
            buffers[key].copy_to_device(grads[key])
            dp.push(key)
        assert dp.synchronize() is True
        for key, b in buffers.items():
            on_all_ranks(lambda b=b, g=grads[key]: assert_close_to_reference(b.copy_to_host(), g, "mean"))


@pytest.mark.parallel(SIZES)
def test_any_push_order_and_an_unused_parameter_still_agree():
    params = make_params(2)
    keys = list(params)
    dp = DataParallel(params, threshold_bytes=200)
    buffers = dp.gradient_buffers()
    for step in range(3):
        rng = rank_rng(100 + step)
        grads = random_grads(rng, params)
        order = [keys[i] for i in rng.permutation(len(keys))]  # a different order on every rank
        unused = "w1" if WORLD.rank == WORLD.size - 1 else None  # no gradient reached it on this rank
        if unused:
            buffers[unused][...] = 123.0  # stale values: synchronize() must push zeros instead
            grads[unused] = np.zeros_like(grads[unused])

        def check(grads=grads, order=order, unused=unused):
            for key in order:
                if key != unused:
                    buffers[key][...] = grads[key]
                    dp.push(key)
            assert dp.synchronize()
            for key in keys:
                assert_close_to_reference(buffers[key], grads[key], "mean")
                assert_same_on_all_ranks(buffers[key])

        on_all_ranks(check, f"step {step}")

    # Without gradient buffers, an unused parameter gets a zero array of its own.
    dp = DataParallel(params)
    grads = random_grads(rank_rng(7), params)
    if WORLD.rank == 0:
        grads["b2"][...] = 0

    def own_arrays():
        for key in keys:
            if not (WORLD.rank == 0 and key == "b2"):
                dp.push(key, grads[key].copy())
        assert dp.synchronize()
        for key, g in dp.gradients().items():
            assert_close_to_reference(g, grads[key], "mean")

    on_all_ranks(own_arrays, "own arrays")


@pytest.mark.parallel([2, 3])
def test_other_absent_parameters_on_one_rank_fail_the_step_everywhere_naming_set_absent():
    """helper-84: set_absent() with other keys on one rank fails the step on every rank, but the
    MismatchError did not name set_absent() among its causes. The next step, set alike, works."""
    comm = WORLD.Dup()
    dp = DataParallel(
        {"a": np.zeros(10, np.float32), "b": np.zeros(20, np.float32)}, threshold_bytes=40, comm=comm
    )

    def step(absent):
        dp.set_absent(absent)
        grads = {k: rank_rng(41).standard_normal(buf.shape).astype(np.float32)
                 for k, buf in dp.gradient_buffers().items()}  # fmt: skip
        for key in ("b", "a"):
            if key not in absent:
                dp.gradient_buffers()[key][...] = grads[key]
                dp.push(key)
        return grads

    def check():
        step(["a"] if WORLD.rank == WORLD.size - 1 else ["b"])
        with pytest.raises(gflow.MismatchError, match=r"set_absent\(\) on some ranks only"):
            dp.synchronize()
        grads = step(["a"])
        assert dp.synchronize() is True
        assert dp.gradients()["a"] is None
        assert_close_to_reference(dp.gradients()["b"], grads["b"], "mean")

    try:
        on_all_ranks(check)
    finally:
        comm.Free()


@pytest.mark.parallel(SIZES)
def test_absent_parameters_leave_the_fusion_and_the_rest_match_mpi():
    """set_absent: those parameters are neither pushed nor reduced (gradients() gives None), the rest
    still match MPI's mean, in the pool and with the trainer's own arrays; they come back with
    set_absent([]); misuse is refused (a push of one, mid-step, an unknown key)."""
    for use_buffers in (True, False):
        params = make_params(2)
        dp = DataParallel(params, threshold_bytes=200)
        buffers = dp.gradient_buffers() if use_buffers else None
        for step, absent in enumerate([["b1", "scale"], ["w1"], []]):
            dp.set_absent(absent)
            grads = random_grads(rank_rng(40 + step), params)

            def check(grads=grads, buffers=buffers, dp=dp, absent=absent, params=params):
                pushed = push_in_backward_order(dp, [k for k in params if k not in absent], grads, buffers)
                if absent:
                    with pytest.raises(ValueError, match="out of the fusion"):
                        dp.push(absent[0], grads[absent[0]].copy())
                    with pytest.raises(RuntimeError, match="in flight"):
                        dp.set_absent([])
                assert dp.synchronize() is True
                reduced = dp.gradients()
                assert all(reduced[k] is None for k in absent)
                for key, g in pushed.items():
                    assert reduced[key] is g
                    assert_close_to_reference(g, grads[key], "mean")

            on_all_ranks(check, f"buffers={use_buffers} absent={absent}")
        with pytest.raises(KeyError, match="no parameter 'nope'"):
            dp.set_absent(["nope"])
    # With sparse= the segments' residuals are kept by place: one out would move another into its
    # residual (helper-44: a parameter took its neighbour's 100x larger residual, silently).
    sparse = DataParallel(make_params(2), sparse={"density": 0.25, "chunk_elems": 4}, threshold_bytes=200)
    sparse.set_absent([])  # (no change: nothing moves)
    with pytest.raises(ValueError, match="not with sparse="):
        sparse.set_absent(["b1"])


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("named", [True, False])
def test_ranks_with_different_absent_parameters_fail_the_step_on_every_rank(named):
    """Named, or unnamed with parameters of one shape: the last rank leaves out another one than
    the others (unnamed, the kit would otherwise pair one rank's parameter with another's)."""
    shapes = {"a": (4,), "b": (4,), "c": (4,)}
    params = make_params(3, shapes=shapes)
    dp = DataParallel(params if named else list(params.values()), threshold_bytes=1 << 20)
    keys = list(params) if named else [0, 1, 2]
    absent = keys[1] if WORLD.rank == WORLD.size - 1 else keys[0]
    grads = random_grads(rank_rng(44), params)
    arrays = dict(zip(keys, grads.values(), strict=True))
    dp.set_absent([absent])
    for key in reversed(keys):
        if key != absent:
            dp.push(key, arrays[key].copy())
    with pytest.raises(gflow.MismatchError):
        dp.synchronize()
    dp.set_absent([])  # the same everywhere again: the next step works
    for key in reversed(keys):
        dp.push(key, arrays[key].copy())
    assert dp.synchronize() is True


@pytest.mark.parallel(SIZES)
def test_parameters_stay_bitwise_identical_dense_fp16_and_csc():
    variants = [
        {},
        {"compression": "fp16"},
        {"sparse": {"density": 0.2, "chunk_elems": 8, "momentum": 0.5, "warmup_steps": 2}},
        {"sparse": {"density": 0.1, "chunk_elems": 4}, "compression": "fp16"},
    ]
    for settings in variants:
        params = make_params(3)
        for p in params.values():  # ranks start apart: broadcast_parameters brings them together
            p += np.float32(WORLD.rank)
        broadcast_parameters(params)
        dp = DataParallel(params, threshold_bytes=256, **settings)
        grads = dp.gradient_buffers()
        rng = rank_rng(4)

        def train(params=params, dp=dp, grads=grads, rng=rng):
            for _ in range(6):
                for key in reversed(list(params)):
                    # a gradient that depends on the parameters, so a divergence would grow
                    grads[key][...] = params[key] * np.float32(0.1) + rng.standard_normal(params[key].shape)
                    dp.push(key)
                assert dp.synchronize()
                for key, p in params.items():
                    p -= np.float32(0.05) * grads[key]
                identical(params)

        on_all_ranks(train, f"{settings}")


@pytest.mark.parallel(SIZES)
def test_one_ranks_overflow_skips_the_step_on_every_rank():
    # Sparse at density 1 sends everything, so its result is the mean too.
    for settings in [{}, {"compression": "fp16"}, {"sparse": {"density": 1.0, "chunk_elems": 4}}]:
        params = make_params(5)
        scaler = gflow.LossScaler(init_scale=2.0**10, growth_interval=100)
        dp = DataParallel(params, loss_scaler=scaler, **settings)
        grads = dp.gradient_buffers()
        rng = rank_rng(5)
        for step in range(3):
            raw = random_grads(rng, params)
            bad = step == 1 and WORLD.rank == WORLD.size - 1

            def check(raw=raw, bad=bad, step=step, dp=dp, grads=grads, scaler=scaler, settings=settings,
                      params=params):  # fmt: skip
                scale = dp.loss_scale
                for key in reversed(list(params)):
                    grads[key][...] = raw[key] * np.float32(scale)  # backward of the scaled loss
                    if bad and key == "b1":
                        grads[key][2] = np.inf
                    dp.push(key)
                applied = dp.synchronize()
                assert applied is (step != 1), f"step {step}: synchronize() returned {applied}"
                assert WORLD.allgather(applied) == [applied] * WORLD.size
                if applied:  # unscaled: the mean of the raw gradients
                    for key in params:
                        if "compression" in settings:
                            fp16_close(grads[key], raw[key])
                        else:
                            assert_close_to_reference(grads[key], raw[key], "mean")
                assert dp.loss_scale == 2.0**10 * (0.5 if step >= 1 else 1.0)
                assert scaler.skipped_steps == (1 if step >= 1 else 0)

            on_all_ranks(check, f"{settings} step {step}")
        assert dp.step_count == 3


@pytest.mark.parallel([2, 3])
def test_ranks_with_different_loss_scales_fail_the_step_on_every_rank():
    """A LossScaler restored on rank 0 only (issue 24, item 7): each rank unscaled the reduced sum by
    its own scale (rank 0: 64.5, rank 1: 1.0078, where 1.5 was right). The ranks now agree on the
    scale in the exchange that agrees on overflow: MismatchError on every rank, and once the states
    agree again the next step is right."""
    params = make_params(7)
    scaler = gflow.LossScaler(init_scale=2.0**6, growth_interval=100)
    dp = DataParallel(params, loss_scaler=scaler)
    grads = dp.gradient_buffers()
    if WORLD.rank == 0:  # a checkpoint taken at another scale, loaded here only
        state = scaler.state_dict()
        state["scale"] = 2.0**12
        scaler.load_state_dict(state)
    raw = random_grads(rank_rng(7), params)

    def step():
        for key in reversed(list(params)):
            grads[key][...] = raw[key] * np.float32(dp.loss_scale)
            dp.push(key)
        return dp.synchronize()

    def mismatch():
        with pytest.raises(gflow.MismatchError, match=r"loss scales differ \(from 64 to 4096"):
            step()
        # helper-51: the refusal came after the reduced, unscaled values were written back, so a retry
        # reduced them again. The scales are compared in the final exchange now, before any write.
        for key in params:
            np.testing.assert_array_equal(grads[key], raw[key] * np.float32(dp.loss_scale), err_msg=key)

    on_all_ranks(mismatch)
    scaler.load_state_dict(gflow.LossScaler(init_scale=2.0**6, growth_interval=100).state_dict())

    def recovered():
        assert step() is True
        for key in params:
            assert_close_to_reference(grads[key], raw[key], "mean")

    on_all_ranks(recovered)


@pytest.mark.parallel([2, 3])
def test_ranks_with_different_loss_scaler_settings_fail_the_first_step_on_every_rank():
    """helper-54: a growth_interval of 1 on rank 1 (2000 elsewhere) passed the first step and failed
    every later one saying the scales differ, pointing at checkpoints; with 2000 against 1000, first
    about 1000 steps in. The settings are compared with the scale: the first step fails on every rank,
    naming them, and nothing is written; LossScaler.update alone compares them too."""
    params = make_params(8)
    growth = 1 if WORLD.rank == 1 else 2000
    dp = DataParallel(params, loss_scaler=gflow.LossScaler(growth_interval=growth))
    grads = dp.gradient_buffers()
    raw = random_grads(rank_rng(8), params)

    def refused():
        for key in reversed(list(params)):
            grads[key][...] = raw[key] * np.float32(dp.loss_scale)
            dp.push(key)
        with pytest.raises(gflow.MismatchError, match="LossScaler settings differ .*'growth_interval'"):
            dp.synchronize()
        for key in params:
            np.testing.assert_array_equal(grads[key], raw[key] * np.float32(dp.loss_scale), err_msg=key)
        alone = gflow.LossScaler(backoff_factor=0.25 if WORLD.rank == 0 else 0.5)
        with pytest.raises(gflow.MismatchError, match="LossScaler.update: the ranks' LossScaler settings"):
            alone.update(False)

    on_all_ranks(refused)


@pytest.mark.parallel([2, 3])
def test_an_async_call_between_pushes_in_other_orders_is_said_to_meet_the_step():
    """Every rank makes the async call between its pushes, but the last rank pushes in the other order,
    so DataParallel holds its first push back and the call comes first in its queue: MismatchError on
    every rank, which said "rank 1 called allreduce" alone, though every rank called it (helper-92).
    It now says what meets what, and where to make the call."""
    comm = WORLD.Dup()  # (the step that met another call ends its communicator's collectives)
    params = make_params(2, shapes={"w1": (300, 10), "w2": (300, 10)})  # (each fills a segment)
    dp = DataParallel(params, threshold_bytes=1024, comm=comm)
    grads = random_grads(rank_rng(94), params)
    order = list(params)[::-1] if WORLD.rank == WORLD.size - 1 else list(params)
    dp.push(order[0], grads[order[0]])
    metric = gflow.allreduce_async(np.ones(3), comm=comm)
    dp.push(order[1], grads[order[1]])

    def check():
        errors = []
        for wait in (dp.synchronize, metric.wait):  # (each rank's error in full comes from one of them)
            with pytest.raises(gflow.GflowError) as raised:
                wait()
            errors.append(raised.value)
        full = [str(e) for e in errors if isinstance(e, gflow.MismatchError)]
        hint = "a gradient step met another call: one made on some ranks only, or at another point"
        assert full and all(hint in text for text in full), errors

    on_all_ranks(check)


def test_a_loss_scaler_on_the_world_is_taken_however_the_world_is_named():
    """comm=None means MPI.COMM_WORLD, for both; mpi4py objects of one communicator are one
    (helper-92: compared by identity, these were refused). Another communicator still is."""
    params = make_params(2)
    DataParallel(params, loss_scaler=gflow.LossScaler(comm=MPI.COMM_WORLD))
    DataParallel(params, comm=MPI.COMM_WORLD, loss_scaler=gflow.LossScaler())
    DataParallel(params, comm=MPI.Intracomm(MPI.COMM_WORLD), loss_scaler=gflow.LossScaler())
    other = MPI.COMM_WORLD.Dup()
    with pytest.raises(ValueError, match="loss_scaler must agree on overflow over DataParallel's"):
        DataParallel(params, comm=other, loss_scaler=gflow.LossScaler())
    other.Free()


@pytest.mark.parallel([2, 3])
def test_a_step_refused_for_its_loss_scales_leaves_sparse_residuals_as_they_were():
    """With sparse=, LossScaler.update's refusal (ranks at different scales) came after the residuals
    were committed, so the refused step still changed later ones. It comes before now: a run that was
    refused a step and went on ends bitwise equal to one that never made it."""

    def run(refuse: bool):
        params = make_params(9)
        scaler = gflow.LossScaler(init_scale=2.0**4, growth_interval=100)
        dp = DataParallel(params, sparse={"density": 0.3, "chunk_elems": 4}, loss_scaler=scaler)
        grads = dp.gradient_buffers()
        rng = rank_rng(9)
        for step in range(4):
            raw = random_grads(rng, params)
            if step == 1 and not refuse:
                continue
            if step == 1 and WORLD.rank == 0:
                scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0**6))
            for key in reversed(list(params)):
                grads[key][...] = raw[key] * np.float32(dp.loss_scale)
                dp.push(key)
            if step == 1:
                with pytest.raises(gflow.MismatchError, match="loss scales differ"):
                    dp.synchronize()
                scaler.load_state_dict(gflow.LossScaler(init_scale=2.0**4, growth_interval=100).state_dict())
                continue
            assert dp.synchronize()
            for key in params:
                params[key] -= 0.1 * grads[key]
        return params

    def check():
        refused, skipped = run(True), run(False)
        for key in refused:
            np.testing.assert_array_equal(refused[key], skipped[key], err_msg=key)

    on_all_ranks(check)


@pytest.mark.parallel([1, 2, 3])
def test_bad_pushes_raise_clear_errors_and_the_next_step_works():
    params = make_params(6)
    dp = DataParallel(params, threshold_bytes=128)
    grads = dp.gradient_buffers()

    ref = random_grads(rank_rng(8), params)

    def key_errors():
        state = dp.state_dict()
        with pytest.raises(KeyError, match="unknown parameter 'nope'"):
            dp.push("nope")
        grads["b2"][...] = ref["b2"]
        dp.push("b2")
        with pytest.raises(ValueError, match="'b2' was already pushed in this step"):
            dp.push("b2")
        for call in (dp.state_dict, lambda: dp.load_state_dict(state)):
            with pytest.raises(RuntimeError, match="in flight"):
                call()

    on_all_ranks(key_errors, "key errors")

    def finish(b2_pushed=False):
        # Those errors changed nothing: the step goes on and is right.
        for key in reversed(list(params)):
            if not (b2_pushed and key == "b2"):
                grads[key][...] = ref[key]
                dp.push(key)
        assert dp.synchronize()
        for key in params:
            assert_close_to_reference(grads[key], ref[key], "mean")

    on_all_ranks(lambda: finish(b2_pushed=True), "after key errors")

    # A bad gradient on one rank fails the step on every rank: its own error there, MismatchError on
    # the others. Then the next step works.
    culprit = WORLD.size - 1
    for bad, error, match in [
        ("not an array", TypeError, "push\\('w2'\\): grad: expected a NumPy array"),
        (np.zeros((9, 4), np.float32), ValueError, "expected the parameter's shape \\(9, 5\\)"),
        (np.zeros((9, 5), np.float64), TypeError, "dtype float32, got \\(9, 5\\) float64"),
        (np.zeros((9, 5), np.float32)[::1].T.copy().T, ValueError, "C-contiguous"),
    ]:

        def failing_step(bad=bad, error=error, match=match):
            for key in reversed(list(params)):
                grads[key][...] = 1.0
                if key == "w2" and WORLD.rank == culprit:
                    dp.push(key, bad)
                else:
                    dp.push(key)
            expected = error if WORLD.rank == culprit else gflow.MismatchError
            with pytest.raises(expected, match=match if WORLD.rank == culprit else None):
                dp.synchronize()

        on_all_ranks(failing_step, f"bad grad {bad!r:.30}")
        on_all_ranks(finish, f"after bad grad {bad!r:.30}")


@pytest.mark.parallel([2, 3])
def test_parameters_that_differ_across_ranks_fail_every_rank():
    shapes = dict(SHAPES)
    if WORLD.rank == 1:
        shapes["b1"] = (8,)
    params = make_params(9, shapes=shapes)
    dp = DataParallel(params)

    def check():
        for key in params:
            dp.push(key, np.ones(params[key].shape, np.float32))
        with pytest.raises(gflow.MismatchError):
            dp.synchronize()

    on_all_ranks(check)
    on_all_ranks(lambda: pytest.raises(gflow.MismatchError, broadcast_parameters, params))


def test_argument_errors_up_front():
    a, b = np.zeros(3, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="'x' appears twice"):
        DataParallel([("x", a), ("x", b)])
    with pytest.raises(ValueError, match="'a' and 'b' are the same array"):
        DataParallel({"a": a, "b": a})
    with pytest.raises(TypeError, match="parameter 'b'.*got list"):
        DataParallel({"a": a, "b": [1.0, 2.0]})
    with pytest.raises(TypeError, match="must be floating, got int32"):
        DataParallel([a, np.zeros(2, np.int32)])
    with pytest.raises(ValueError, match="no parameters"):
        DataParallel({})
    with pytest.raises(TypeError, match="names must be strings"):
        DataParallel({1: a})
    with pytest.raises(TypeError, match="loss_scaler"):
        DataParallel([a], loss_scaler=2.0)
    with pytest.raises(ValueError, match="density"):
        DataParallel([a], sparse={"density": 2.0})
    # Settings a parameter can never take: every step after failed on every rank (helper-44)
    with pytest.raises(TypeError, match="parameter 'h'.*needs a floating gradient of float32 or float64"):
        DataParallel({"a": a, "h": np.zeros(2, np.float16)}, sparse={"density": 0.5})
    with pytest.raises(TypeError, match="parameter 1: compression='fp16' on a bfloat16 input"):
        DataParallel([a, np.zeros(2, ml_dtypes.bfloat16)], compression="fp16")
    dp = DataParallel([a, b])  # a list: keys are indices, buffers a list
    with pytest.raises(ValueError, match="no grad given and no gradient_buffers"):
        dp.push(0)
    # (the step is unchanged: not begun, so the program's own async calls are not taken for its own)
    assert not context().in_a_step()
    buffers = dp.gradient_buffers()
    assert isinstance(buffers, list) and [x.shape for x in buffers] == [(3,), (4,)]
    assert dp.gradient_buffers()[0] is buffers[0]  # the same arrays every time
    buffers[0][...], buffers[1][...] = 1.0, 2.0
    dp.push(1)
    dp.push(0)
    assert dp.synchronize() and dp.loss_scale == 1.0
    np.testing.assert_array_equal(buffers[0], 1.0)


@pytest.mark.parallel(SIZES)
def test_broadcast_parameters_overwrites_in_place_with_roots_values():
    root = WORLD.size - 1
    for params in [make_params(10), list(make_params(11, np.float64).values())]:
        values = params.values() if isinstance(params, dict) else params
        objects = [id(p) for p in values]
        for p in values:
            p[...] = rank_rng(12).standard_normal(p.shape)
        expected = WORLD.bcast([p.copy() for p in values], root=root)  # MPI's own broadcast

        def check(params=params, values=values, objects=objects, expected=expected):
            broadcast_parameters(params, root=root)
            assert [id(p) for p in values] == objects
            for p, e in zip(values, expected, strict=True):
                np.testing.assert_array_equal(p, e)

        on_all_ranks(check)


@pytest.mark.parallel(2)
def test_the_example_trains_and_resumes_bitwise(tmp_path, capsys):
    """examples/train_mlp.py: a run resumed from its checkpoint prints what the uninterrupted run
    prints (CSC with momentum correction and loss scaling: the most state to carry)."""
    import importlib.util
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("train_mlp", os.path.join(root, "examples", "train_mlp.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    base = ["--device", "cpu", "--density", "0.05", "--loss-scale", "--warmup-epochs", "1", "--batch", "128"]
    ckpt = str(tmp_path / "mlp")

    def run(*extra):
        capsys.readouterr()
        acc = example.main(base + list(extra))
        lines = capsys.readouterr().out.splitlines()
        return acc, [re.sub(r"  [0-9.]+ s", "", line) for line in lines]  # without the timings

    def check():
        whole_acc, whole = run("--epochs", "2")
        run("--epochs", "1", "--checkpoint", ckpt)
        assert os.path.exists(f"{ckpt}.rank{WORLD.rank}.pkl")
        acc, resumed = run("--epochs", "2", "--checkpoint", ckpt, "--resume")
        assert acc == whole_acc > 0.8
        if WORLD.rank == 0:
            assert resumed[0] == "resumed after epoch 1"
            assert resumed[1:] == whole[-2:] and "epoch   2" in resumed[1], (whole, resumed)

    on_all_ranks(check)


# Review findings (issue 8): each reproduces a reviewer's case.


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("compression", [None, "fp16"])
def test_failed_sparse_step_under_loss_scaling_keeps_the_scaled_gradients(compression):
    # The gradients were unscaled in place as they were pushed, so after a step that failed on another
    # rank they held g / scale, and a retry reduced g / scale**2: gradients lost.
    rng = rank_rng(70)
    params = {"w": np.zeros(64, np.float32), "b": np.zeros(8, np.float32)}
    dp = DataParallel(
        params,
        sparse={"density": 1.0, "chunk_elems": 8},
        compression=compression,
        loss_scaler=gflow.LossScaler(init_scale=4.0),
    )
    grads = dp.gradient_buffers()
    local = {k: np.array(rng.standard_normal(v.shape) * 4, np.float32) for k, v in grads.items()}
    for k in grads:
        grads[k][...] = local[k]
    bad = WORLD.rank == WORLD.size - 1

    def failing_step():
        dp.push("b")
        dp.push("w", np.zeros(63, np.float32) if bad else None)
        with pytest.raises(ValueError if bad else gflow.MismatchError):
            dp.synchronize()

    on_all_ranks(failing_step, "failing step")
    for k in grads:
        if not bad:
            np.testing.assert_array_equal(grads[k], local[k])  # as pushed, still scaled
        grads[k][...] = local[k]
    dp.push("b")
    dp.push("w")
    assert dp.synchronize()
    for k in grads:
        want = np.mean(WORLD.allgather(local[k].astype(np.float64) / 4.0), axis=0)
        np.testing.assert_allclose(grads[k], want, rtol=2e-3 if compression else 1e-6, atol=1e-3)


@pytest.mark.parallel([2])
def test_a_loss_scaler_on_another_communicator_is_refused():
    # LossScaler() agrees over COMM_WORLD: with DataParallel(comm=COMM_SELF) its agreement hung.
    from mpi4py import MPI

    with pytest.raises(ValueError, match="communicator"):
        DataParallel({"w": np.zeros(4, np.float32)}, comm=MPI.COMM_SELF, loss_scaler=gflow.LossScaler())
    dp = DataParallel(
        {"w": np.zeros(4, np.float32)},
        comm=MPI.COMM_SELF,
        loss_scaler=gflow.LossScaler(init_scale=1.0, comm=MPI.COMM_SELF),
    )
    dp.gradient_buffers()["w"][...] = WORLD.rank
    dp.push("w")
    assert dp.synchronize()
    assert dp.gradient_buffers()["w"][0] == WORLD.rank  # reduced over this rank alone


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("case", ["tied", "names", "empty"])
def test_broadcast_parameters_with_bad_params_on_one_rank_fails_every_rank(case):
    # The bad rank raised before any message and its peers waited in their first broadcast forever.
    good = {"a": np.ones(4, np.float32), "b": np.ones(3, np.float32)}
    shared = np.ones(4, np.float32)
    bad = {
        "tied": [shared, np.ones(3, np.float32), shared],
        "names": {0: np.ones(4, np.float32)},
        "empty": {},
    }
    mine = bad[case] if WORLD.rank == WORLD.size - 1 else good

    def call():
        with pytest.raises((TypeError, ValueError, gflow.MismatchError)) as info:
            broadcast_parameters(mine)
        if WORLD.rank != WORLD.size - 1:
            assert isinstance(info.value, gflow.MismatchError)

    on_all_ranks(call, case)
    x = np.full(5, float(WORLD.rank), np.float32)
    broadcast_parameters([x], root=0)  # the ranks are still in step
    assert (x == 0).all()


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("case", ["extra", "missing", "renamed", "unnamed"])
def test_broadcast_parameters_with_other_keys_on_one_rank_fails_every_rank(case):
    """helper-83 (found in gflow.torch's): a parameter one rank has past the others' last was broadcast
    on that rank alone, into the peers' next collective; a name that differs swapped values silently
    (each broadcast agreed on sizes only). The ranks agree on the count and names first."""
    last = WORLD.size - 1
    rng = rank_rng(640)
    mine = {"a": random_array(rng, 5, np.float32), "b": random_array(rng, 3, np.float64)}
    if WORLD.rank == last and case == "extra":
        mine["zz"] = random_array(rng, 2, np.float32)
    if WORLD.rank == last and case == "missing":
        del mine["b"]
    if WORLD.rank == last and case == "renamed":
        mine = {"a": mine["a"], "c": mine["b"]}
    before = {key: a.copy() for key, a in mine.items()}
    params = list(mine.values()) + ([random_array(rng, 2, np.float32)] if WORLD.rank == last else [])
    shown = "2 parameters" + ("" if case == "unnamed" else " named 'a', 'b'")
    first_line = {
        "extra": f"ranks disagree on the number of elements: rank 0 passed 2, rank {last} passed 3",
        "missing": f"ranks disagree on the number of elements: rank 0 passed 2, rank {last} passed 1",
        "renamed": f"ranks disagree on what it passed: rank 0 passed 'b', rank {last} passed 'c'",
        "unnamed": f"ranks disagree on the number of elements: rank 0 passed 2, rank {last} passed 3",
    }[case]

    def call():
        with pytest.raises(gflow.MismatchError) as info:
            broadcast_parameters(params if case == "unnamed" else mine)
        assert str(info.value).startswith(first_line), info.value
        assert "rank 0 called broadcast with 2 int32 elements" in str(info.value), info.value
        assert f"it passed broadcast_parameters with {shown}" in str(info.value), info.value

    on_all_ranks(call, case)
    for key, a in mine.items():  # (nothing moved)
        np.testing.assert_array_equal(a, before[key])
    same = {"a": random_array(rng, 5, np.float32), "b": random_array(rng, 3, np.float64)}
    broadcast_parameters(same, root=last)  # the ranks are in step
    for a in same.values():
        assert_same_on_all_ranks(a)


@pytest.mark.parallel([2, 3])
def test_one_buffer_pushed_for_two_parameters_is_refused_in_either_order():
    # push("b", grads["a"]) then push("a") (the default buffer, already pushed) was accepted: a's
    # buffer was reduced twice and b's kept its local value.
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    dp = DataParallel(params)
    grads = dp.gradient_buffers()

    def twice():
        dp.push("b", grads["a"])
        dp.push("a")
        with pytest.raises(ValueError, match="already pushed"):
            dp.synchronize()

    on_all_ranks(twice, "one buffer for two parameters")
    grads["a"][...], grads["b"][...] = 1.0, 2.0
    dp.push("b")
    dp.push("a")
    dp.synchronize()
    assert (grads["a"] == 1.0).all() and (grads["b"] == 2.0).all()


@pytest.mark.parallel([1, 2])
def test_a_gradient_buffer_replaced_by_another_array_fails_the_step():
    """grads[key] = g (another array) then push(key): the buffer's old values went out again, silently
    (helper-44); now the step fails on every rank, and writing into the buffer works."""
    dp = DataParallel({"w": np.ones(8, np.float32)})
    grads = dp.gradient_buffers()
    grads["w"][...] = WORLD.rank + 1.0
    dp.push("w")
    dp.synchronize()
    grads["w"] = np.full(8, 10.0 * (WORLD.rank + 1), np.float32)
    dp.push("w")
    error = ValueError if WORLD.size == 1 else (ValueError, gflow.MismatchError)
    with pytest.raises(error, match="another array now|rejected its own arguments"):
        dp.synchronize()
    grads = dp.gradient_buffers()  # (a program that recovers: the buffers again, written into)
    grads["w"][...] = 10.0 * (WORLD.rank + 1)
    dp.push("w")
    dp.synchronize()
    np.testing.assert_array_equal(dp.gradients()["w"], 5.0 * (WORLD.size + 1))


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize(("compression", "scaled"), [(None, False), ("fp16", False), ("fp16", True)])
def test_join_with_uneven_data_averages_over_every_rank(compression, scaled):
    """Rank r has 2 + r batches, then calls dp.join(): each rank's steps average the ranks still
    training with the joined ones' zeros, over every rank (Horovod's division), against float64;
    join() returns the last rank, whose parameters then go to every rank; the kit trains on. With a
    LossScaler too (its agreement on the scale counted a joined rank's zero as a scale of -0, and
    every step after the first join failed)."""
    r, size = WORLD.rank, WORLD.size
    params = make_params(3, np.float64 if compression is None else np.float32)
    start = {k: p.astype(np.float64) for k, p in params.items()}
    scaler = gflow.LossScaler(init_scale=2.0**6, growth_interval=100) if scaled else None
    dp = DataParallel(params, compression=compression, loss_scaler=scaler)

    def grads_of(step, rank):  # every rank's gradients, known everywhere (seeded by step and rank)
        return random_grads(np.random.default_rng([step, rank]), params)

    def pushed(step):  # this rank's gradients as backward leaves them: times the loss scale
        return {k: np.array(g * dp.loss_scale, g.dtype) for k, g in grads_of(step, r).items()}

    def reference(steps):  # float64: step s averages the ranks with more than s batches, over size
        ref = {k: v.copy() for k, v in start.items()}
        for s in range(steps):
            for k in ref:
                ref[k] -= (
                    0.1 * sum(grads_of(s, q)[k].astype(np.float64) for q in range(size) if s < 2 + q) / size
                )
        return ref

    def train():
        for step in range(2 + r):
            push_in_backward_order(dp, list(params), pushed(step), None)
            assert dp.synchronize()
            for k, p in params.items():
                p -= (0.1 * dp.gradients()[k]).astype(p.dtype)
        last = dp.join()
        assert last == size - 1
        tol = 1e-12 if compression is None else 5e-3
        for k, want in reference(2 + r).items():
            np.testing.assert_allclose(params[k], want, rtol=tol, atol=tol, err_msg=k)
        broadcast_parameters(params, root=last)
        identical(params)
        push_in_backward_order(dp, list(params), pushed(9), None)  # every rank steps again
        assert dp.synchronize()
        for k, got in dp.gradients().items():
            want = sum(grads_of(9, q)[k].astype(np.float64) for q in range(size)) / size
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=k)
        again = dp.join()  # (every rank at once: the last by the clocks, the same everywhere)
        assert WORLD.allgather(again) == [again] * size and 0 <= again < size

    on_all_ranks(train)


@pytest.mark.parallel([2, 3])
def test_after_join_a_loss_scaler_takes_the_last_ranks_scale():
    """Rank 0 joins at once; the others' first step overflows (their scale halves) and their second
    applies. A scaler on rank 0 saw neither: after join() every rank has the last rank's scale, and a
    step on every rank applies (every later step failed with "the ranks' loss scales differ": helper-45)."""
    r = WORLD.rank
    scaler = gflow.LossScaler(init_scale=2.0**6, growth_interval=100)
    dp = DataParallel({"w": np.ones(8, np.float32)}, loss_scaler=scaler)
    grad = rank_rng(3).uniform(0.5, 1.5, 8).astype(np.float32)

    def train():
        if r > 0:
            for step in range(2):
                scaled = grad * np.float32(dp.loss_scale)
                dp.push("w", np.full(8, np.inf, np.float32) if step == 0 else scaled)
                assert dp.synchronize() is (step == 1)
        assert dp.join() > 0  # (one of those that trained)
        assert WORLD.allgather(dp.loss_scale) == [2.0**5] * WORLD.size
        dp.push("w", grad * np.float32(dp.loss_scale))
        assert dp.synchronize()
        assert_close_to_reference(dp.gradients()["w"], grad, "mean")

    on_all_ranks(train)


@pytest.mark.parallel([2, 3])
def test_an_overflow_beside_a_joined_rank_leaves_the_channel_to_every_rank():
    """An async fp16 allreduce that overflows on the callers while the last rank is in join(): the
    callers dropped their background channel for a fresh one, which the joined rank never made, and
    their next async call hung (helper-45). inf/NaN is settled alike on every rank: the channel stays."""
    from gflow.collectives.join import join

    r, last = WORLD.rank, WORLD.size - 1

    def check():
        if r == last:
            assert join() in range(last)  # (a caller joins after it)
            return
        with pytest.raises(gflow.CompressionOverflowError):
            gflow.allreduce_async(np.full(64, 1e5, np.float32), compression="fp16").wait(timeout=20)
        got = gflow.allreduce_async(np.arange(256.0) * (r + 1), "sum").wait(timeout=20)
        np.testing.assert_array_equal(got, np.arange(256.0) * sum(q + 1 for q in range(last)))  # (exact)
        join()

    on_all_ranks(check)
    assert gflow.allreduce(np.ones(3)).tolist() == [float(WORLD.size)] * 3


@pytest.mark.parallel([1, 2])
def test_join_refuses_sparse_and_a_step_in_flight():
    """Refused on the joining rank before it serves anything: with sparse= (a joined rank takes part
    only in allreduces), and between a push and synchronize()."""
    params = make_params(4)
    sparse = DataParallel(params, sparse={"density": 0.1, "chunk_elems": 16})
    with pytest.raises(ValueError, match="not with sparse="):
        sparse.join()
    dp = DataParallel(params)
    dp.push("b2", np.ones(SHAPES["b2"], np.float32))
    with pytest.raises(RuntimeError, match="a step is in flight"):
        dp.join()
    for key in reversed(list(params)):
        if key != "b2":
            dp.push(key, np.ones(SHAPES[key], np.float32))
    assert dp.synchronize()
    assert dp.join() in range(WORLD.size)
