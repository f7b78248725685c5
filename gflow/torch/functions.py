"""Horovod's helpers: broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object.

Objects travel pickled, with cloudpickle when it is importable (as Horovod: lambdas and local classes
travel too), else with pickle (torch tensors inside them pickle as tensors); the bytes go through
gflow's broadcast/allgather like any tensor, so ranks that call different collectives fail together
with MismatchError instead of hanging. An object that cannot be pickled raises its error on its rank
and MismatchError on the others.
"""

import pickle
import warnings
import zlib
from collections.abc import Mapping

import torch

import gflow

from . import _basics
from ._basics import as_horovod_error, refused_in_join_as
from ._common import reject_blocking, set_comm
from ._gather import allgather, broadcast_, broadcast_into
from .process_sets import global_process_set

try:
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle is in the torch extra
    _pickler = pickle


def _payload(obj, collective: str, process_set) -> torch.Tensor:
    """obj pickled, as uint8 bytes. When it cannot be pickled, the peers' `collective` (the first one
    of broadcast_object / allgather_object) fails with MismatchError instead of waiting for this rank,
    and the pickler's error is raised here."""
    on, exc = set_comm(process_set, f"{collective}_object")
    if exc is not None:
        reject_blocking(collective, exc, on)
    try:
        data = _pickler.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any failure reaches the peers
        reject_blocking(collective, exc, on)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """uint8 bytes padded to a multiple of 4, as int32 words (a dtype gflow moves)."""
    padded = torch.zeros(-(-raw.numel() // 4) * 4, dtype=torch.uint8)
    padded[: raw.numel()] = raw
    return padded.view(torch.int32)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Return root_rank's obj (pickled, broadcast, unpickled) on every rank (of process_set).

    Typical use: `state = hvd.broadcast_object(optimizer.state_dict(), 0)`.
    """
    if _basics.rank() == root_rank:
        words = _words(_payload(obj, "broadcast", process_set))
        length = torch.tensor([words.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    with refused_in_join_as("broadcast_object", "broadcasts"):
        broadcast_into(length, root_rank, None, process_set, "broadcast_object")
        if _basics.rank() != root_rank:
            words = torch.empty(int(length[0]), dtype=torch.int32)
        broadcast_into(words, root_rank, None, process_set, "broadcast_object")
    if _basics.rank() == root_rank:
        return obj
    return pickle.loads(words.view(torch.uint8).numpy().tobytes())


def allgather_object(obj, name=None, process_set=None) -> list:
    """Return the list of every rank's obj (of process_set), in rank order."""
    raw = _payload(obj, "allgather", process_set)
    with refused_in_join_as("allgather_object", "allgathers"):
        sizes = allgather(torch.tensor([raw.numel()], dtype=torch.int64), process_set=process_set)
        gathered = allgather(_words(raw), process_set=process_set).view(torch.uint8)
    objects, offset = [], 0
    for n in sizes.tolist():
        objects.append(pickle.loads(gathered[offset : offset + n].numpy().tobytes()))
        offset += -(-n // 4) * 4
    return objects


def broadcast_parameters(params, root_rank=0, process_set=None) -> None:
    """Overwrite each tensor in place with root_rank's values (every rank starts from the same weights).

    Args:
        params: model.state_dict(), a dict name -> tensor (broadcast in sorted name order), or a list
            (or any iterable: model.parameters(), model.named_parameters()) of tensors or of
            (name, tensor) pairs, in the same order on every rank. Any dtype.
        root_rank: the rank whose values are sent.
        process_set: the ranks to broadcast to (default all; a gflow extension of Horovod's call).
    """
    if isinstance(params, Mapping):
        items = list(params.items())
        try:
            items.sort(key=lambda item: item[0])
        except TypeError:
            pass  # names that do not compare: the dict's own order
    elif isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    _agree_on_keys([name for name, _ in items], root_rank, process_set)
    for name, tensor in items:  # (named, as Horovod does: keys that differ fail on every rank, not swap)
        # (a channels_last model: through a contiguous copy, where Horovod's raises; other layouts, an
        # expanded tensor, are refused before anything moves, as Horovod's)
        copied = isinstance(tensor, torch.Tensor) and not tensor.is_contiguous() and _dense_permuted(tensor)
        work = tensor.contiguous() if copied else tensor
        broadcast_(work, root_rank, name=None if name is None else str(name), process_set=process_set)
        if copied:
            with torch.no_grad():
                tensor.copy_(work)


def _agree_on_keys(names: list, root_rank: int, process_set) -> None:
    """Raise MismatchError on every rank, before any parameter moves, where the ranks' lists of
    names (of tensors, for an unnamed list) differ. Each tensor's broadcast agrees on its name, but a
    key one rank has past the others' last was broadcast on that rank alone: it met the peers' next
    collective (crossed waits, or a hang), and a missing one left that rank's tensor as it was while
    its peers went on (helper-83). One small broadcast agrees on the count and a checksum of the
    names; only where they differ are the lists gathered, to name the keys."""
    words = "\0".join("" if name is None else str(name) for name in names)
    label = f"broadcast_parameters: the list of {len(names)} keys (checksum {zlib.crc32(words.encode()):08x})"
    try:
        broadcast_(torch.zeros(len(names), dtype=torch.int32), root_rank, name=label, process_set=process_set)
    except gflow.MismatchError as exc:  # (or another disagreement, root_rank's: raised as it is)
        lists = allgather_object([str(name) for name in names], process_set=process_set)
        ranks = (global_process_set if process_set is None else process_set).ranks
        apart = _keys_apart(dict(zip(ranks, lists, strict=True)), root_rank)
        if apart is None:
            raise
        raise as_horovod_error(gflow.MismatchError(apart)) from exc


def _keys_apart(lists: dict, root_rank: int) -> str | None:
    """The first rank whose list of keys differs from root_rank's, and how (None where none does):
    for a MismatchError. `lists`: each rank's (hvd.rank()'s numbering)."""
    root = lists[root_rank]
    root_keys = set(root)
    for rank, keys in lists.items():
        if keys == root:
            continue
        own = set(keys)
        extra = [key for key in keys if key not in root_keys]
        missing = [key for key in root if key not in own]
        if extra or missing:
            text = "; ".join(
                f"{what} {', '.join(map(repr, found[:8]))}{' and more' if len(found) > 8 else ''}"
                for what, found in ((f"rank {rank} has keys root rank {root_rank} has not:", extra),
                                    (f"root rank {root_rank} has keys rank {rank} has not:", missing))
                if found
            )  # fmt: skip
        elif len(keys) != len(root):
            text = f"rank {rank} passed {len(keys)} tensors, root rank {root_rank} {len(root)}"
        else:
            text = f"rank {rank} passed root rank {root_rank}'s keys in another order"
        return f"broadcast_parameters: the ranks passed different parameters: {text}"
    return None


def _dense_permuted(tensor) -> bool:
    """Whether a strided tensor's elements fill its memory once each in some order of its dimensions
    (channels_last, a transpose): a contiguous copy can be written back into it."""
    if tensor.layout != torch.strided or tensor.is_inference():
        return False
    expected = 1
    dims = sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class _Slot:
    """A tensor's place in a pickled optimizer state: its index in the list broadcast separately."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index, shape, dtype):
        self.index, self.shape, self.dtype = index, shape, dtype

    def __getstate__(self):
        return (self.index, self.shape, self.dtype)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype = state


class _SparseSlot:
    """A sparse COO tensor's place (SGD's momentum over nn.Embedding(sparse=True)): its indices and
    values as two _Slots, exactly as root holds them (coalesced or not)."""

    __slots__ = ("indices", "values", "shape", "coalesced")

    def __init__(self, indices, values, shape, coalesced):
        self.indices, self.values, self.shape, self.coalesced = indices, values, shape, coalesced

    def __getstate__(self):
        return (self.indices, self.values, self.shape, self.coalesced)

    def __setstate__(self, state):
        self.indices, self.values, self.shape, self.coalesced = state


class _RootFailed:
    """Sent instead of the state when root could not take its own apart: every rank raises."""

    def __init__(self, text: str):
        self.text = text


def _split(value, tensors: list):
    """value with every tensor replaced by a _Slot (its host copy appended to `tensors`)."""
    if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:
        indices, values = _split(value._indices(), tensors), _split(value._values(), tensors)
        return _SparseSlot(indices, values, tuple(value.shape), value.is_coalesced())
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu", copy=True).contiguous())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _join(value, tensors: list):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, _SparseSlot):
        indices, values = tensors[value.indices.index], tensors[value.values.index]
        return torch.sparse_coo_tensor(indices, values, value.shape, is_coalesced=value.coalesced)
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_join(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=None) -> None:
    """Make every rank's optimizer state (per-parameter state and the param groups' settings, e.g.
    the learning rate) root_rank's.

    The structure travels pickled; the state tensors travel through gflow's broadcast, fused by
    dtype. Unlike Horovod, an optimizer whose state is still empty is not stepped with zero
    gradients first (that step changes the parameters under weight decay, and Adam's step count):
    every rank just gets root's (empty) state. As Horovod's, it leaves a zero gradient on each
    parameter that requires one and has none yet (programs written for Horovod read or broadcast
    p.grad right after), but where root's state is empty, on every rank alike: Horovod decides on
    each rank's own, and after root alone loaded a checkpoint (its resume recipe) the other ranks
    held zero gradients where root held none, which SGD's momentum and weight decay or Adam then
    applied on them only, for a parameter unused in the first step (helper-58). For a
    DistributedOptimizer, every rank also takes root's position in tuning threshold_bytes="auto"
    (the threshold it settled on, or where it is in the schedule), so that restoring a checkpoint on
    root alone, Horovod's idiom, keeps the ranks fusing alike; gflow's per-rank state (CSC
    residuals) is left alone. `model` is accepted and ignored.
    process_set: the ranks to broadcast to (default all; a gflow extension of Horovod's call).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "broadcast_optimizer_state: optimizer must be a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    wrapped = getattr(optimizer, "_gflow_wrapped", False)
    is_root = _basics.rank() == root_rank
    own = optimizer._wrapped_state_dict() if wrapped else optimizer.state_dict()
    tensors: list = []
    skeleton = None
    failure = None
    if is_root:
        try:
            skeleton = _split(own, tensors)
        except Exception as exc:  # noqa: BLE001 - raised below, once the others know (they would wait)
            failure, skeleton = exc, _RootFailed(f"{type(exc).__name__}: {exc}")
    skeleton = broadcast_object(skeleton, root_rank, process_set=process_set)
    if isinstance(skeleton, _RootFailed):
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"broadcast_optimizer_state: root rank {root_rank} could not send its optimizer state "
            f"({skeleton.text}); nothing was changed here"
        )
    if not skeleton.get("state"):  # (root's, on every rank)
        _zero_gradients(optimizer)
    if not is_root:
        slots: list = []
        _collect_slots(skeleton, slots)
        tensors = [None] * len(slots)
        for slot in slots:
            tensors[slot.index] = torch.empty(slot.shape, dtype=slot.dtype)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        members = by_dtype[dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in members]) if is_root else None
        if not is_root:
            flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=dtype)
        broadcast_(flat, root_rank, process_set=process_set)
        offset = 0
        for i in members:
            n = tensors[i].numel()
            tensors[i] = flat[offset : offset + n].view(tensors[i].shape).clone()
            offset += n
    if not is_root:
        state = _join(skeleton, tensors)
        if wrapped:
            optimizer._wrapped_load_state_dict(state)
        else:
            optimizer.load_state_dict(state)
    if wrapped:
        kit = optimizer._dp
        position = kit.tuning_position() if is_root else None
        kit.adopt_tuning(broadcast_object(position, root_rank, process_set=process_set))


def _zero_gradients(optimizer) -> None:
    """A zero p.grad where a parameter requires a gradient and has none (Horovod's side effect)."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p, memory_format=torch.preserve_format)
                p.grad = zero.to_sparse() if sparse else zero


def _collect_slots(value, slots: list) -> None:
    if isinstance(value, _Slot):
        slots.append(value)
    elif isinstance(value, _SparseSlot):
        slots += [value.indices, value.values]
    elif isinstance(value, dict):
        for v in value.values():
            _collect_slots(v, slots)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_slots(v, slots)


def start_timeline(file_path, mark_cycles: bool = False) -> None:
    """Horovod's start_timeline, onto gflow's timeline: each rank writes its own Chrome trace
    (file_path on one rank; with more, <root>.<rank><ext>, see gflow.start_timeline). mark_cycles:
    gflow has no cycles to mark (True warns, once)."""
    if not file_path:
        raise ValueError("start_timeline: file_path must name a file, got an empty path")
    if mark_cycles:
        warnings.warn("gflow.torch.start_timeline: mark_cycles is ignored (no cycles in gflow)", stacklevel=2)
    gflow.start_timeline(file_path)


def stop_timeline() -> None:
    """Horovod's stop_timeline: finish and close this rank's timeline file."""
    gflow.stop_timeline()
