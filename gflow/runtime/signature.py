"""Argument checks, and the call signature the ranks compare.

Local checks raise TypeError/ValueError before any data moves. The signature is a short int64 vector
describing one call (collective, algorithm, element count, dtype, op, one extra field); the agreement
in collectives/recursive_doubling.py compares it across ranks, so that ranks that called differently
all raise MismatchError instead of hanging or returning garbage.
"""

import functools
import struct
import zlib

import numpy as np
from mpi4py import MPI

from .config import config

# Codes are part of the wire format: append, never renumber. bfloat16 is ml_dtypes' (what JAX uses; NumPy
# has none): its kind is 'V', as a 2-byte void's; its name tells it apart. ml_dtypes is imported only
# where a bfloat16 dtype is made (bfloat16()): from version 0.7 its import takes about 0.9 s here, most of
# gflow's, on every rank of every job, and an array of bfloat16 comes from a program that imported it.
DTYPE_NAMES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
_BFLOAT16_CODE = DTYPE_NAMES.index("bfloat16") + 1
_NUMPY_CODE = {np.dtype(name): i + 1 for i, name in enumerate(DTYPE_NAMES) if name != "bfloat16"}
CODE_DTYPE_NAME = {i + 1: name for i, name in enumerate(DTYPE_NAMES)}


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether an np.dtype is ml_dtypes' bfloat16 (told without importing ml_dtypes)."""
    return dtype.kind == "V" and dtype.name == "bfloat16"


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def finfo(dtype):
    """The floating-point limits of a floating dtype, bfloat16's too (NumPy's finfo refuses it under
    ml_dtypes 0.4); its values are NumPy scalars of the dtype's own precision."""
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def dtype_code(dtype) -> int:
    """A supported dtype's code in a signature (KeyError for another)."""
    code = _NUMPY_CODE.get(dtype)
    if code is not None:
        return code
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return _BFLOAT16_CODE
    return _NUMPY_CODE[dtype]


def code_dtype(code) -> np.dtype:
    """The dtype of a signature's code (KeyError for a code gflow does not know)."""
    name = CODE_DTYPE_NAME[int(code)]
    return bfloat16() if name == "bfloat16" else np.dtype(name)


OPS = ("sum", "mean", "max", "min")
OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
CODE_OP = {code: name for name, code in OP_CODE.items()}
_MPI_OPS = ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.MIN, "min"))  # MPI.Op is not hashable

COLLECTIVES = (
    "allreduce", "reduce_scatter", "allgather", "broadcast", "lazy", "sparse", "gradient_buffers", "alltoall"
)  # fmt: skip
COLLECTIVE_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}
CODE_COLLECTIVE = {code: name for name, code in COLLECTIVE_CODE.items()}
# What a person reads for a collective whose internal name means nothing to them.
_IN_WORDS = {
    "lazy": "a gradient step (fused allreduce)",
    "sparse": "a CSC sparse step",
    "gradient_buffers": "gradient_buffers()",
}


def collective_in_words(code) -> str:
    """A collective's code as an error message names it: 'allreduce', 'a gradient step (fused
    allreduce)' (LazyAllreduce's segments: DistributedOptimizer's and DataParallel's steps), ..."""
    name = CODE_COLLECTIVE.get(int(code), f"<collective {int(code)}>")
    return _IN_WORDS.get(name, name)


# "auto": a bandwidth-sized call under algorithm="auto", whose algorithm (ring or hierarchical) is
# settled after the agreement, from the topology (collectives/dispatch.py).
ALGORITHMS = ("recursive_doubling", "ring", "mpi", "auto", "hierarchical", "adasum")
ALGORITHM_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
CODE_ALGORITHM = {code: name for name, code in ALGORITHM_CODE.items()}
# Above the algorithm's code, "auto" and "hierarchical" carry a checksum of the settings that shape
# them: ranks that would run differently (one the ring, one the hierarchical allreduce; pieces of
# different sizes) must disagree here, not hang later.
_AUTO_SHIFT = 8


# The gflow.config settings each algorithm's shape depends on, and `validate` for every call that
# agrees before it moves data: a rank that does not validate skips those agreements, so ranks set
# differently must find out in the one agreement that still runs (recursive_doubling.wants_agreement).
_SETTINGS = {
    "ring": ("ring_segment_bytes", "validate"),
    "hierarchical": ("shared_memory_max_bytes", "ring_segment_bytes", "validate"),
    "auto": (
        "shared_memory_min_bytes",
        "hierarchical_min_bytes",
        "shared_memory_max_bytes",
        "ring_segment_bytes",
        "validate",
    ),
    "mpi": ("validate",),
    "adasum": ("validate",),
}


def settings_checksum(algorithm: str) -> int:
    """A 24-bit checksum of the gflow.config settings `algorithm` depends on (0: none). The ring's
    segment size is among them: ranks cutting its messages differently would truncate them."""
    values = [getattr(config, name) for name in _SETTINGS.get(algorithm, ())]
    if not values:
        return 0
    return zlib.crc32(struct.pack(f"<{len(values)}q", *values)) & 0xFFFFFF


def settings_words(sig) -> str | None:
    """This rank's values of the settings in sig's checksum, in words (shared after a mismatch on
    them, so that the message names the setting that differs); None where sig has none."""
    names = _SETTINGS.get(CODE_ALGORITHM.get(int(sig[1]) & 0xFF), ())
    return ", ".join(f"{name}={getattr(config, name)}" for name in names) or None


_SETTINGS_DIFFER = "gflow.config's settings for the algorithm"


def settings_differ(sig_a, sig_b) -> bool:
    """Whether what two signatures first disagree on is their settings checksum (as difference()
    says)."""
    return difference(sig_a, sig_b)[0] == _SETTINGS_DIFFER


# A rank whose local checks failed sends this status so its peers fail with it instead of hanging.
SIG_OK = 0
SIG_REJECTED = 1
SIG_LEN = 8  # collective, algorithm, count, dtype, op, extra, memory, status
MEMORY_CODE = {"host": 1, "device": 2}
CODE_MEMORY = {code: memory for memory, code in MEMORY_CODE.items()}


def check_op(op, dtype: np.dtype) -> str:
    """Return the canonical op name, or raise for unknown ops and mean on integers."""
    if isinstance(op, MPI.Op):
        name = next((n for mpi_op, n in _MPI_OPS if op == mpi_op), None)
        if name is None:
            raise ValueError(f"op: expected one of {OPS} or MPI.SUM/MAX/MIN, got an unsupported MPI.Op")
    elif op.__class__ is str and op in OP_CODE:
        name = op
    else:
        raise ValueError(f"op: expected one of {OPS} or MPI.SUM/MAX/MIN, got {op!r}")
    if name == "mean" and not is_floating(dtype):
        raise TypeError(
            f"op='mean' needs a floating dtype, got {dtype}: use op='sum' and divide as your integers need"
        )
    return name


def holds(dtype) -> np.dtype:
    """The dtype one of gflow's flat buffers holds: on the device bfloat16 is uint16 bits (Numba has
    no bfloat16 type; gflow reduces no uint16), everywhere else the buffer's own dtype."""
    dtype = np.dtype(dtype)
    return bfloat16() if dtype == np.uint16 else dtype


def is_floating(dtype: np.dtype) -> bool:
    """float16/32/64 or bfloat16 (whose NumPy kind is 'V')."""
    return dtype.kind == "f" or is_bfloat16(dtype)


_SUPPORTED_STR = {dtype.str for dtype in _NUMPY_CODE}  # '<f4' etc.: hashing strings is cheap


def check_dtype(dtype) -> np.dtype:
    if dtype.str not in _SUPPORTED_STR and not (is_bfloat16(dtype) and dtype.isnative):
        raise TypeError(f"unsupported dtype {dtype}: expected one of {', '.join(DTYPE_NAMES)}")
    return dtype


def check_root(root, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"root must be an int, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"root must be in [0, {size}), got {root}")
    return int(root)


def signature(
    collective: str, algorithm: str, count: int, dtype, op: str | None, extra: int = 0, memory: str = "host"
):
    """The tuple of SIG_LEN ints the ranks compare; see describe() for how it reads."""
    code = ALGORITHM_CODE[algorithm] | settings_checksum(algorithm) << _AUTO_SHIFT
    return (
        COLLECTIVE_CODE[collective],
        code,
        count,
        dtype_code(dtype),
        OP_CODE[op] if op else 0,
        extra,
        MEMORY_CODE[memory],
        SIG_OK,
    )


def rejected_signature(collective: str) -> tuple:
    return (COLLECTIVE_CODE[collective], 0, 0, 0, 0, 0, 0, SIG_REJECTED)


def _op_name(sig) -> str:
    """The op a signature names (Adasum's carries none: its algorithm says it)."""
    if not sig[4] and CODE_ALGORITHM.get(int(sig[1]) & 0xFF) == "adasum":
        return "adasum"
    return CODE_OP.get(int(sig[4]), "?")


def describe(sig, other=None) -> str:
    """Human-readable form of a signature, for mismatch messages; beside `other` (the signature it
    disagrees with), the settings checksum only where the two differ in it."""
    collective = CODE_COLLECTIVE.get(int(sig[0]), f"<collective {int(sig[0])}>")
    if int(sig[7]) == SIG_REJECTED:
        return f"called {collective_in_words(sig[0])} with arguments it rejected (see the error raised there)"
    memory = CODE_MEMORY.get(int(sig[6]), "?")
    elements = f"{int(sig[2])} {CODE_DTYPE_NAME.get(int(sig[3]), '?')} elements"
    if collective in ("allgather", "alltoall"):
        elements = f"rows of {elements}"
    if collective == "lazy" and _final_exchange([int(v) for v in sig]) and not int(sig[4]):
        fired = int(sig[2])
        elements = f"its final exchange (after {fired} segment{'s' * (fired != 1)})"
    elif collective == "sparse":  # (its exchanges: the chunk norms, then the chunks chosen)
        elements = f"an exchange of {elements} (chunk norms, or the chunks chosen)"
    text = f"called {collective_in_words(sig[0])} with {elements} ({memory} array)"
    if int(sig[4]):
        text += f", op={CODE_OP.get(int(sig[4]), '?')}"
    algorithm = CODE_ALGORITHM.get(int(sig[1]) & 0xFF, "?")
    text += f", algorithm={algorithm}"
    if int(sig[1]) >> _AUTO_SHIFT and (other is None or settings_differ(sig, other)):
        names = ", ".join(_SETTINGS.get(algorithm, ("?",)))
        checksum = int(sig[1]) >> _AUTO_SHIFT
        text += f" (settings checksum {checksum}: compare gflow.config.{names} across ranks)"
    if collective == "broadcast":  # the root in the low 32 bits, a shape checksum above them
        text += f", root={int(sig[5]) & 0xFFFFFFFF}"
        if int(sig[5]) >> 32:
            text += f", shape fingerprint {int(sig[5]) >> 32}"
    elif collective in ("allgather", "alltoall") and int(sig[5]):
        text += f", trailing-shape fingerprint {int(sig[5])}"
    elif collective == "reduce_scatter" and int(sig[5]):
        text += f", split by rows of shape fingerprint {int(sig[5])}"
    elif collective == "lazy":
        text += (
            f", push-order checksum {int(sig[5])} (of the tensors pushed so far, the fusion threshold and, "
            "with threshold_bytes='auto', where it is in its tuning: compare those across ranks)"
        )
    elif collective == "sparse":
        text += f", gradient size and settings fingerprint {int(sig[5])}"
    elif collective == "allreduce" and int(sig[5]):
        text += f", fingerprint {int(sig[5])} (shape; in gflow.torch also op and factors)"
    elif int(sig[5]):
        text += f", extra={int(sig[5])}"
    return text


_EXTRA_MEANS = {
    "allreduce": "the shape (with the same number of elements), or in gflow.torch the op, scale factors "
    "or name=",
    "allgather": "the trailing axes (or, in gflow.torch, the dtype or name=)",
    "alltoall": "the trailing axes (or, in gflow.torch, the dtype or name=)",
    "reduce_scatter": "the shape or rows= (or, in gflow.torch, the op, scale factors or name=)",
    "broadcast": "the shape (with the same number of elements), or in gflow.torch the dtype or name=",
    "lazy": "the tensors pushed so far (their order or sizes: a parameter frozen or set_absent() on some "
    "ranks only?), the fusion threshold, or its tuning",
    "sparse": "the gradient size or the CSC settings",
    "gradient_buffers": "the parameters' shapes (their number, order or sizes)",
}


_AS_WORDS = ("allgather", "broadcast", "alltoall")  # (gflow.torch moves other dtypes as int32 words)


def _final_exchange(sig) -> bool:
    """Whether a "lazy" signature may be a step's final exchange (LazyAllreduce's flush: the segment
    count as int64, no op, or max with agree=); int64 and max may also be a segment of int64s."""
    return sig[3] == _NUMPY_CODE[np.dtype(np.int64)] and sig[4] in (0, OP_CODE["max"])


def _one_step_ended(a, b) -> bool:
    """Whether of two "lazy" signatures one is certainly a step's final exchange and the other a
    segment (of another dtype), or both are final exchanges without agree= (no op)."""
    fa, fb = _final_exchange(a), _final_exchange(b)
    return (fa != fb and a[3] != b[3]) or (fa and fb and a[4] == b[4] == 0)


def _segment_or_end(sig) -> str:
    if _final_exchange(sig):
        return f"ended its step after {sig[2]} segment{'s' * (sig[2] != 1)}"
    return f"sent a segment of {sig[2]} {CODE_DTYPE_NAME.get(int(sig[3]), '?')} elements"


PASSED_BYTES = 512  # each rank's words for its call, shared after a mismatch, are cut there


class Words:
    """A call's words for a MismatchError, made only when one asks (str(words) calls make(*args)):
    a call on the hot path records what it has, not a sentence."""

    def __init__(self, make, *args):
        self.make, self.args = make, args

    def __str__(self) -> str:
        return self.make(*self.args)


_PUSHED = " arrays pushed in its step: "


def pushes_in_words(pushes, count: int) -> str:
    """A LazyAllreduce step's first `count` pushes ((name or None, shape, dtype) each), in words that
    first_push_apart reads back: what a rank shares with its peers after a mismatch."""
    items = (
        f"{'' if name is None else f'{name} '}{tuple(shape)} {dtype.name}"
        for name, shape, dtype in pushes[:count]
    )
    return f"{count}{_PUSHED}" + "; ".join(items)


def first_push_apart(words_a: str, words_b: str):
    """Where two ranks' pushes_in_words first differ, as (rank A's, rank B's) words; None where the
    words are not both such, or their shared part (each cut at the exchange's size) shows none."""
    lists = []
    for words in (words_a, words_b):
        count, found, items = words.partition(_PUSHED)
        if not found or not count.isdigit():
            return None
        items = items.split("; ") if items else []
        whole = len(items) == int(count) and len(words.encode()) < PASSED_BYTES
        lists.append((items if whole else items[:-1], whole))
    (a, whole_a), (b, whole_b) = lists
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"pushed {x} as its push {index + 1}", f"pushed {y}"
    if len(a) != len(b) and (whole_a if len(a) < len(b) else whole_b):
        index = min(len(a), len(b))
        ended = "had pushed no more" if index else "had pushed nothing"
        return (
            (ended, f"pushed {b[index]} as its push {index + 1}")
            if len(a) < len(b)
            else (f"pushed {a[index]} as its push {index + 1}", ended)
        )
    return None


def difference(sig_a, sig_b, world=lambda ranks: "") -> tuple:
    """What two ranks' signatures first disagree on, as (what, rank A's value, rank B's value) in
    words: the line a person reads first in a MismatchError (describe() gives the details); `world`
    adds the world rank of a root on another communicator."""
    a, b = [int(v) for v in sig_a], [int(v) for v in sig_b]
    collective = CODE_COLLECTIVE.get(a[0], f"<collective {a[0]}>")
    if a[7] == SIG_REJECTED or b[7] == SIG_REJECTED:
        words = ("rejected its own (see its error)", "accepted its own")
        return "the arguments", *(words[0] if s[7] else words[1] for s in (a, b))
    if a[0] != b[0]:
        return "the collective", *(f"called {collective_in_words(s[0])}" for s in (a, b))
    if a[6] != b[6]:
        return "where the array lives", *(f"passed a {CODE_MEMORY.get(s[6], '?')} array" for s in (a, b))
    if collective == "lazy" and (a[2], a[3]) != (b[2], b[3]) and _one_step_ended(a, b):
        what = "how many fused segments the step has (the ranks pushed different tensors, or one flushed "
        what += "a step the others did not: compare the push-order checksums below)"
        return what, *(_segment_or_end(s) for s in (a, b))
    if a[3] != b[3]:
        words = " (or a dtype gflow.torch moves as int32 words)" if collective in _AS_WORDS else ""
        names = [CODE_DTYPE_NAME.get(s[3], "?") for s in (a, b)]
        return "the dtype", *(f"passed {n}{words if n == 'int32' else ''}" for n in names)
    if a[2] != b[2]:
        unit = {"allgather": "elements per row", "alltoall": "elements per row"}.get(collective, "elements")
        if collective == "lazy":
            unit = "elements in a fused segment (a different model, a parameter frozen or set_absent() on "
            unit += "some ranks only, another fusion threshold, or a step one rank left half-pushed, an "
            unit += "exception between its pushes, and went on with the next)"
        return f"the number of {unit}", *(f"passed {s[2]}" for s in (a, b))
    if a[4] != b[4]:
        if collective == "lazy" and 0 in (a[4], b[4]):  # (a step's final exchange: op max with agree=)
            what = "whether the step's final exchange carries an agree= vector (flush(agree=), "
            what += "synchronize(agree=))"
            return what, *("passed one" if s[4] else "passed none" for s in (a, b))
        return "the op", *(f"op={_op_name(s)}" for s in (a, b))
    if a[1] & 0xFF != b[1] & 0xFF:  # (passed alike, "auto" chooses by gflow.config: say so)
        what = "the algorithm (as passed, or as chosen by gflow.config's settings: small_message_bytes, ...)"
        return what, *(f"algorithm={CODE_ALGORITHM.get(s[1] & 0xFF, '?')}" for s in (a, b))
    if a[1] != b[1]:
        return _SETTINGS_DIFFER, "has one checksum of them", "another"
    if collective == "broadcast" and a[5] & 0xFFFFFFFF != b[5] & 0xFFFFFFFF:
        return "the root", *(f"root={s[5] & 0xFFFFFFFF}{world([s[5] & 0xFFFFFFFF])}" for s in (a, b))
    means = _EXTRA_MEANS.get(collective, "the call's extra field")
    if collective == "lazy" and a[4] == OP_CODE["max"] and a[3] == _NUMPY_CODE[np.dtype(np.int64)]:
        means += ", or the length of the agree= vector in the step's final exchange"
    return means, "passed one", "another"
