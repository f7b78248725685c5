"""Checkpoints: state_dict()/load_state_dict() of SparseAllreduce, LossScaler, LazyAllreduce and
DataParallel, at world sizes 1 to 4.

The central check: a run stopped at step k, saved to disk, and resumed by new objects built from the
saved files (as a new process would) ends bitwise where the uninterrupted run does.
"""

import pickle
import warnings

import numpy as np
import pytest
from helpers import WORLD, assert_same_on_all_ranks, on_all_ranks, rank_rng
from mpi4py import MPI
from numba import cuda

import gflow
from gflow.training.data_parallel import DataParallel

SIZES = [1, 2, 3, 4]
SHAPES = {"w1": (16, 12), "b1": (12,), "w2": (12, 3), "b2": (3,)}
CSC = {"density": 0.1, "chunk_elems": 8, "momentum": 0.9, "warmup_steps": 4}


def make_params(seed):
    rng = np.random.default_rng(seed)  # the same on every rank
    return {k: np.array(rng.standard_normal(s), np.float32) for k, s in SHAPES.items()}


class Trainer:
    """A tiny data-parallel trainer: gradients depend on the weights (so any difference would grow)
    plus noise drawn per (step, rank); SGD with momentum; dynamic loss scaling that grows every 2
    steps, so the scale changes across the checkpoint."""

    def __init__(self, settings, seed=0):
        self.params = make_params(seed)
        self.velocity = {k: np.zeros_like(p) for k, p in self.params.items()}
        scaler = gflow.LossScaler(init_scale=2.0**3, growth_interval=2)
        self.dp = DataParallel(self.params, threshold_bytes=64, loss_scaler=scaler, **settings)
        self.grads = self.dp.gradient_buffers()

    def run(self, steps):
        for step in steps:
            noise = np.random.default_rng([step, WORLD.rank])
            scale = np.float32(self.dp.loss_scale)
            for key in reversed(list(self.params)):
                p = self.params[key]
                self.grads[key][...] = (p * np.float32(0.05) + noise.standard_normal(p.shape)) * scale
                self.dp.push(key)
            if self.dp.synchronize():
                for key, p in self.params.items():
                    self.velocity[key] *= np.float32(0.9)
                    self.velocity[key] += self.grads[key]
                    p -= np.float32(0.01) * self.velocity[key]

    def save(self, path):
        with open(path, "wb") as f:
            pickle.dump({"params": self.params, "velocity": self.velocity, "dp": self.dp.state_dict()}, f)

    def load(self, path):
        with open(path, "rb") as f:
            saved = pickle.load(f)
        for key in self.params:
            np.copyto(self.params[key], saved["params"][key])
            np.copyto(self.velocity[key], saved["velocity"][key])
        self.dp.load_state_dict(saved["dp"])


@pytest.mark.parallel(SIZES)
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(tmp_path):
    n, k = 9, 3  # k inside CSC's warm-up
    for name, settings in [
        ("dense", {}),
        ("fp16", {"compression": "fp16"}),
        ("csc", {"sparse": CSC}),
        ("csc-fp16", {"sparse": CSC, "compression": "fp16"}),
    ]:
        path = tmp_path / f"{name}.rank{WORLD.rank}.pkl"

        def check(settings=settings, path=path):
            whole = Trainer(settings)
            whole.run(range(n))

            first = Trainer(settings)
            first.run(range(k))
            first.save(path)
            del first
            resumed = Trainer(settings, seed=1)  # other initial weights: the checkpoint must replace them
            resumed.load(path)
            assert resumed.dp.step_count == k
            resumed.run(range(k, n))

            assert resumed.dp.step_count == whole.dp.step_count == n
            assert resumed.dp.loss_scale == whole.dp.loss_scale != 2.0**3
            for key in whole.params:
                np.testing.assert_array_equal(resumed.params[key], whole.params[key])
                np.testing.assert_array_equal(resumed.velocity[key], whole.velocity[key])
                assert_same_on_all_ranks(resumed.params[key])
            if "sparse" in settings:  # the residuals were carried over too
                a, b = whole.dp.state_dict()["lazy"], resumed.dp.state_dict()["lazy"]
                assert a["segments"].keys() == b["segments"].keys() and len(a["segments"]) > 1
                for i, seg in a["segments"].items():
                    np.testing.assert_array_equal(seg["residual"], b["segments"][i]["residual"])
                    assert seg["residual"].any()

        on_all_ranks(check, name)


@pytest.mark.parallel([1, 3])
def test_sparse_state_round_trips_through_np_savez_and_a_new_object(tmp_path):
    settings = {"density": 0.2, "chunk_elems": 16, "momentum": 0.5, "warmup_steps": 3, "compression": "fp16"}
    rng = rank_rng(3)
    grads = [np.array(rng.standard_normal((30, 7)), np.float32) for _ in range(7)]
    path = tmp_path / f"csc.rank{WORLD.rank}.npz"

    def check():
        a = gflow.SparseAllreduce(**settings)
        assert a.state_dict()["residual"] is None  # before the first step
        for g in grads[:4]:
            a(g)
        state = a.state_dict()
        assert isinstance(state["residual"], np.ndarray) and state["velocity"].shape == (210,)
        np.savez(path, **state)
        with np.load(path, allow_pickle=False) as f:
            loaded = dict(f)
        b = gflow.SparseAllreduce(**settings)
        b.load_state_dict(loaded)
        assert b.step_count == 4 and b.residual.shape == (30, 7)
        state["residual"][...] = 0  # a copy: the object's residual is untouched
        assert a.residual.any()
        for g in grads[4:]:
            np.testing.assert_array_equal(a(g), b(g))
        np.testing.assert_array_equal(a.residual, b.residual)

    on_all_ranks(check)


def test_loss_scaler_and_lazy_round_trip():
    s = gflow.LossScaler(init_scale=256.0, growth_interval=3)
    for overflow in (False, True, False, False):
        s.update(overflow)
    t = gflow.LossScaler(init_scale=256.0, growth_interval=3)
    t.load_state_dict(pickle.loads(pickle.dumps(s.state_dict())))
    assert (t.scale, t.skipped_steps, t._good_steps) == (128.0, 1, 2)
    assert t.update(False) and t.scale == s.update(False) * 256.0 == 256.0
    # Dense LazyAllreduce: settings only.
    lazy = gflow.LazyAllreduce(threshold_bytes=1000, compression="fp16")
    state = lazy.state_dict()
    assert state["segments"] == {} and state["compression"] == "fp16" and state["sparse"] is None
    gflow.LazyAllreduce(threshold_bytes=1000, compression="fp16").load_state_dict(state)


@pytest.mark.parallel([1, 2])
def test_device_state_is_saved_on_the_host_and_restored_to_the_device():
    # Numba's CUDA simulator in the test suite (a GPU with GFLOW_TEST_GPU=1): keep it small.
    rng = rank_rng(4)
    grads = [np.array(rng.standard_normal(40), np.float32) for _ in range(4)]

    def check():
        a = gflow.SparseAllreduce(density=0.25, chunk_elems=5, momentum=0.5)
        for g in grads[:2]:
            a(cuda.to_device(g))
        state = a.state_dict()
        assert type(state["residual"]) is np.ndarray and state["memory"] == "device"
        b = gflow.SparseAllreduce(density=0.25, chunk_elems=5, momentum=0.5)
        b.load_state_dict(pickle.loads(pickle.dumps(state)))
        assert not isinstance(b.residual, np.ndarray)  # back in device memory
        for g in grads[2:]:
            np.testing.assert_array_equal(
                a(cuda.to_device(g)).copy_to_host(), b(cuda.to_device(g)).copy_to_host()
            )

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_a_state_saved_in_one_memory_resumes_with_gradients_in_the_other():
    """helper-55: a CSC state saved from device memory and loaded where the gradients are on the host
    (or the reverse) was taken, and the next step refused it: "the gradient changed: expected 64
    float32 elements (device memory), got 64 float32 (host memory)". The state follows the gradient.
    (Momentum 0: with momentum, the host's kernel may fuse a multiply-add that the simulator rounds twice.)"""
    rng = rank_rng(5)
    grads = [np.array(rng.standard_normal(40), np.float32) for _ in range(4)]
    place = {"host": lambda g: g.copy(), "device": cuda.to_device}
    back = {"host": lambda y: y, "device": lambda y: y.copy_to_host()}

    def check():
        for saved, used in (("device", "host"), ("host", "device")):
            a = gflow.SparseAllreduce(density=0.25, chunk_elems=5)
            for g in grads[:2]:
                a(place[saved](g))
            b = gflow.SparseAllreduce(density=0.25, chunk_elems=5)
            b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
            for g in grads[2:]:
                expected = back[saved](a(place[saved](g)))
                np.testing.assert_array_equal(back[used](b(place[used](g))), expected)
            assert b.state_dict()["memory"] == used

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_loading_residuals_at_another_world_size_or_other_settings_names_what_differs():
    size = WORLD.size
    csc = gflow.SparseAllreduce(density=0.5, chunk_elems=4)
    csc(np.ones(10, np.float32))
    scaler = gflow.LossScaler(growth_interval=10)
    lazy = gflow.LazyAllreduce(threshold_bytes=64, sparse={"density": 0.5, "chunk_elems": 4})
    lazy.push(np.ones(10, np.float32))
    lazy.flush()
    dp = DataParallel(make_params(0), sparse={"density": 0.5}, loss_scaler=gflow.LossScaler())
    dp.push("b1", np.ones(12, np.float32))
    dp.synchronize()
    objects = {"SparseAllreduce": csc, "LossScaler": scaler, "LazyAllreduce": lazy, "DataParallel": dp}
    states = {name: obj.state_dict() for name, obj in objects.items()}

    def check():
        for name, obj in objects.items():
            edited = dict(states[name], world_size=size + 1)
            if name == "LossScaler":  # (nothing per rank: it loads at any world size)
                obj.load_state_dict(edited)
            else:
                with pytest.raises(
                    ValueError, match=f"{name}.load_state_dict: world size differs: expected {size}"
                ):
                    obj.load_state_dict(edited)
            with pytest.raises(ValueError, match="version 99"):
                obj.load_state_dict(dict(states[name], version=99))
            with pytest.raises(ValueError, match=f"format 'gflow.{name}', got format 'gflow.LossScaler'"):
                if name != "LossScaler":
                    obj.load_state_dict(states["LossScaler"])
                else:
                    raise ValueError(f"format 'gflow.{name}', got format 'gflow.LossScaler'")
            assert obj.state_dict().keys() == states[name].keys()  # unchanged by the failed loads
        sparse_dp = {"sparse": {"density": 0.5}, "loss_scaler": gflow.LossScaler()}
        swapped = {{"w1": "w2", "w2": "w1"}.get(k, k): v for k, v in make_params(0).items()}
        lazy_csc = {"density": 0.5, "chunk_elems": 4}
        other = [
            (gflow.SparseAllreduce(density=0.25, chunk_elems=4), "SparseAllreduce",
             "density differs: expected 0.25"),
            (gflow.SparseAllreduce(density=0.5, chunk_elems=4, compression="fp16"), "SparseAllreduce",
             "compression differs: expected 'fp16' \\(this object\\), got 'none'"),
            (gflow.LossScaler(growth_interval=20), "LossScaler", "growth_interval differs: expected 20"),
            (gflow.LazyAllreduce(threshold_bytes=65, sparse=lazy_csc), "LazyAllreduce",
             "threshold_bytes differs: expected 65"),
            (gflow.LazyAllreduce(threshold_bytes=64), "LazyAllreduce", "sparse differs: expected None"),
            (DataParallel(make_params(0), sparse={"density": 0.5}), "DataParallel",
             "loss scaler differs: this object has none"),
            (DataParallel(make_params(0), loss_scaler=gflow.LossScaler()), "DataParallel",
             "sparse differs: expected None"),
            (DataParallel(dict(make_params(0), b3=np.zeros(2, np.float32)), **sparse_dp), "DataParallel",
             "number of parameters differs"),
            (DataParallel(dict(make_params(0), b2=np.zeros(4, np.float32)), **sparse_dp), "DataParallel",
             "parameter 'b2': shape differs: expected \\(4,\\) \\(this object\\), got \\(3,\\)"),
            (DataParallel(swapped, **sparse_dp), "DataParallel",
             "parameter 'w2': name differs: expected 'w2' \\(this object\\), got 'w1'"),
        ]  # fmt: skip
        for obj, name, match in other:
            with pytest.raises(ValueError, match=match):
                obj.load_state_dict(states[name])

    on_all_ranks(check)


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("threshold", [64, "auto"])
def test_a_dense_state_saved_by_a_smaller_job_resumes_in_a_larger_one(threshold):
    """helper-84: a dense DataParallel checkpoint saved at 2 ranks was refused at 3, though it holds
    nothing per rank. Saved here by the job's first size - 1 ranks (a communicator of their own) and
    loaded on all of them: the step count and the loss scale carry over, "auto" tunes again (saying
    so), and the next step's result is MPI's own allreduce of the gradients."""
    smaller = WORLD.Split(0 if WORLD.rank < WORLD.size - 1 else MPI.UNDEFINED, WORLD.rank)
    state = None
    if smaller != MPI.COMM_NULL:
        scaler = gflow.LossScaler(init_scale=2.0**3, growth_interval=2, comm=smaller)
        saver = DataParallel(make_params(0), threshold_bytes=threshold, loss_scaler=scaler, comm=smaller)
        for _ in range(3):
            for key, buf in saver.gradient_buffers().items():
                buf[...] = rank_rng(1).standard_normal(buf.shape)
                saver.push(key)
            saver.synchronize()
        state = pickle.loads(pickle.dumps(saver.state_dict()))
        smaller.Free()
    state = WORLD.bcast(state, root=0)  # (the file the smaller job left, read by every rank of this one)
    comm = WORLD.Dup()
    scaler = gflow.LossScaler(init_scale=2.0**3, growth_interval=2, comm=comm)
    dp = DataParallel(make_params(0), threshold_bytes=threshold, loss_scaler=scaler, comm=comm)

    def check():
        assert state["world_size"] == WORLD.size - 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp.load_state_dict(state)
        retuned = [w for w in caught if "tuned again from the start" in str(w.message)]
        assert len(retuned) == (threshold == "auto"), [str(w.message) for w in caught]
        assert dp.step_count == state["step_count"] and dp.loss_scale == state["loss_scaler"]["scale"]
        grads = {key: rank_rng(2).standard_normal(buf.shape).astype(np.float32)
                 for key, buf in dp.gradient_buffers().items()}  # fmt: skip
        for key, buf in dp.gradient_buffers().items():
            buf[...] = grads[key] * np.float32(dp.loss_scale)
            dp.push(key)
        assert dp.synchronize()
        for key, buf in dp.gradient_buffers().items():
            expected = np.empty_like(grads[key], np.float64)
            comm.Allreduce(grads[key].astype(np.float64), expected)
            np.testing.assert_allclose(buf, expected / WORLD.size, rtol=1e-5, atol=1e-6)
        assert dp.state_dict()["world_size"] == WORLD.size

    try:
        on_all_ranks(check, f"threshold={threshold}")
    finally:
        comm.Free()


@pytest.mark.parallel([1, 2])
def test_a_state_still_says_its_world_size_and_warns_only_once_it_has_loaded():
    """helper-86: once a dense state loaded at any world size, a malformed world_size ("four", None)
    loaded silently; and "tuned again" was warned of before a load that then failed on the loss
    scaler's settings (and changed nothing)."""
    scaler = gflow.LossScaler(growth_interval=100)
    dp = DataParallel(make_params(0), threshold_bytes="auto", loss_scaler=scaler)
    lazy = gflow.LazyAllreduce(threshold_bytes=64)
    states = {"DataParallel": dp.state_dict(), "LazyAllreduce": lazy.state_dict()}
    states["LossScaler"] = scaler.state_dict()
    objects = {"DataParallel": dp, "LazyAllreduce": lazy, "LossScaler": scaler}
    other = DataParallel(make_params(0), threshold_bytes="auto", loss_scaler=gflow.LossScaler())

    def check():
        for name, obj in objects.items():
            for bad in ("four", None, -3, 1.5, True):
                match = f"{name}.load_state_dict: world_size must be an int >= 1"
                with pytest.raises(ValueError, match=match):
                    obj.load_state_dict(dict(states[name], world_size=bad))
        resized = dict(states["DataParallel"], world_size=WORLD.size + 1)
        resized["lazy"] = dict(resized["lazy"], world_size=WORLD.size + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="growth_interval differs"):
                other.load_state_dict(resized)
        assert not caught, [str(w.message) for w in caught]
        with pytest.warns(UserWarning, match=f"saved at {WORLD.size + 1} ranks, loaded at {WORLD.size}"):
            dp.load_state_dict(resized)

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_sparse_state_loaded_on_another_rank_is_refused():
    size, rank = WORLD.size, WORLD.rank
    csc = gflow.SparseAllreduce(density=0.5, chunk_elems=4)
    csc(np.ones(10, np.float32))
    dp = DataParallel(make_params(0), sparse={"density": 0.5})
    dp.synchronize()
    neighbour = (rank + 1) % size
    theirs = WORLD.allgather((csc.state_dict(), dp.state_dict()))[neighbour]

    def check():
        message = (
            f"rank differs: expected {rank} \\(this rank\\), got {neighbour}.*each rank must save and load"
        )
        with pytest.raises(ValueError, match="SparseAllreduce.load_state_dict: " + message):
            csc.load_state_dict(theirs[0])
        with pytest.raises(ValueError, match="LazyAllreduce.load_state_dict: segment 0: .*" + message):
            dp.load_state_dict(theirs[1])
        before = csc.residual.copy()
        csc.load_state_dict(csc.state_dict())  # its own: fine
        np.testing.assert_array_equal(csc.residual, before)

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_no_loading_mid_step():
    lazy = gflow.LazyAllreduce(threshold_bytes=16, sparse={"density": 0.5, "chunk_elems": 2})
    x = np.ones(8, np.float32)
    lazy.push(x)
    lazy.flush()
    state = lazy.state_dict()

    def check():
        y = np.full(8, 2.0, np.float32)
        lazy.push(y)  # a segment fired: its SparseAllreduce is mid-step too
        with pytest.raises(RuntimeError, match="LazyAllreduce.load_state_dict: a step is in flight"):
            lazy.load_state_dict(state)
        with pytest.raises(RuntimeError, match="in flight"):
            lazy.state_dict()
        lazy.flush()  # the step itself is unaffected
        lazy.load_state_dict(state)

    on_all_ranks(check)
