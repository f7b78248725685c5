"""gflow.torch's async handles (Horovod's integers): poll, synchronize, and shutdown, which forgets
them."""

import itertools

from . import _basics
from ._basics import as_horovod_error

# --- handles ---------------------------------------------------------------------------------------


class Pending:
    """An operation started by an *_async call: gflow handles to wait for, then finish(results)."""

    __slots__ = ("handles", "finish", "error")

    def __init__(self, handles=(), finish=None, error=None):
        self.handles = list(handles)
        self.finish = finish
        self.error = error


_handle_map: dict = {}
_counter = itertools.count()
# (operation, process set id, name=) of an async operation whose handle is not synchronized yet ->
# that handle, and back: Horovod refuses a second one under a name in flight (_common.names_in_flight).
_handle_of_name: dict = {}
_name_of_handle: dict = {}


def register(pending: Pending) -> int:
    handle = next(_counter)
    _handle_map[handle] = pending
    return handle


def in_flight(key):
    """The handle of the operation under `key` (see _handle_of_name) not synchronized yet, or None."""
    return _handle_of_name.get(key)


def name_handle(key, handle) -> None:
    _handle_of_name[key] = handle
    _name_of_handle[handle] = key


def shutdown() -> None:
    """Forget the communicator and the async handles; is_initialized() is then False until the next
    init(). MPI stays up (mpi4py finalizes it at exit), and async operations started before still
    complete."""
    _handle_map.clear()
    _handle_of_name.clear()
    _name_of_handle.clear()
    _basics.forget_comm()


def poll(handle) -> bool:
    """True once the operation of `handle` has finished; synchronize() then does not block."""
    pending = _handle_map.get(handle)
    if pending is None:
        raise ValueError(f"poll: handle {handle!r} was not created or has already been synchronized")
    return all(h.done() for h in pending.handles)


def synchronize(handle):
    """Wait for the operation of `handle` and return its output tensor (the input tensor itself for the
    in-place variants; a list for the grouped ones). An unknown or already synchronized handle
    returns None, as in Horovod.

    Raises:
        HorovodInternalError: the collective failed on every rank (gflow's MismatchError etc., which
            are instances of it); TypeError/ValueError: this rank's own arguments were bad.
    """
    if callable(handle):  # (sparse_allreduce_async's handle is a function, as in Horovod)
        return handle()
    pending = _handle_map.pop(handle, None)
    if pending is None:
        return None
    name = _name_of_handle.pop(handle, None)
    if name is not None:
        _handle_of_name.pop(name, None)
    error, results = pending.error, []
    for h in pending.handles:  # wait for all of them, even after a failure: the channel resets
        try:
            results.append(h.wait())
        except Exception as exc:  # noqa: BLE001 - raised below, once all have finished
            error = error or exc
    if error is not None:
        raise as_horovod_error(error).with_traceback(error.__traceback__)
    return pending.finish(results)


def raise_as_horovod(exc):
    raise as_horovod_error(exc).with_traceback(exc.__traceback__) from None
