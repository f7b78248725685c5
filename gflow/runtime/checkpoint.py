"""State dicts for checkpoints: the common header, the checks on loading, host copies of state arrays.

A state dict holds Python scalars, strings, None and NumPy arrays (host copies, also of device
state), so pickle, torch.save and np.savez (after flattening) all work and a restart may put the
state back on another device. Each carries its format name and version, the settings it was made
with and the world size, and loading checks them, because a residual or a loss scale loaded into an
object with other settings or another world size would train silently wrong.
"""

import numpy as np
from mpi4py import MPI

VERSION = 1
_MISSING = object()


def world(comm) -> tuple[int, int]:
    """(rank, size) of the user's communicator. Read directly rather than through gflow's context:
    making a context is collective, and a state dict may be taken on one rank alone."""
    comm = MPI.COMM_WORLD if comm is None else comm
    return comm.Get_rank(), comm.Get_size()


def header(owner: str) -> dict:
    """The first entries of a state dict: whose it is (a class name) and the format's version."""
    return {"format": f"gflow.{owner}", "version": VERSION}


def check_header(state, owner: str, who: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{who}: expected a state dict, got {type(state).__name__}")
    fmt = plain_value(state.get("format"))
    if fmt != f"gflow.{owner}":
        raise ValueError(f"{who}: expected a state dict of format 'gflow.{owner}', got format {fmt!r}")
    version = plain_value(state.get("version"))
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ValueError(
            f"{who}: state format version {version!r} is not one this gflow reads (1 to {VERSION})"
        )


def get(state: dict, key: str, who: str):
    """state[key], as the Python scalar it was saved from where np.savez made it a 0-d array."""
    value = state.get(key, _MISSING)
    if value is _MISSING:
        raise ValueError(f"{who}: the state dict lacks {key!r}")
    return plain_value(value)


def check_equal(state: dict, expected: dict, who: str) -> None:
    """Every entry of `expected` (this object's settings) must equal the state's."""
    for key, mine in expected.items():
        theirs = get(state, key, who)
        if theirs != mine:
            raise ValueError(
                f"{who}: {key} differs: expected {mine!r} (this object), got {theirs!r} (the state dict); "
                f"make the object with {key}={theirs!r} to load this state"
            )


def saved_world_size(state: dict, who: str) -> int:
    """The world size a state was saved at (an int >= 1: a state that loads at another size still
    says at which)."""
    value = get(state, "world_size", who)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: world_size must be an int >= 1, got {value!r}")
    return value


def check_world_size(state: dict, size: int, who: str) -> None:
    """A state that holds something per rank (CSC's residuals) loads at its own world size only."""
    theirs = saved_world_size(state, who)
    if theirs != size:
        raise ValueError(
            f"{who}: world size differs: expected {size} (this run), got {theirs!r} (the state dict was "
            "saved at another world size)"
        )


def plain_value(value):
    """A 0-d NumPy value (as np.savez gives back) as the Python scalar it was saved from."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def compression_name(compression) -> str:
    return "none" if compression is None else compression


def get_count(state: dict, key: str, who: str) -> int:
    """An int >= 0 from the state (a step or a count)."""
    value = get(state, key, who)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}: {key} must be an int >= 0, got {value!r}")
    return value
