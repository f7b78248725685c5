"""gflow's exceptions.

Argument errors are the builtin TypeError/ValueError, raised before any data moves. GflowError is what
gflow raises when the ranks of one collective call disagree, or MPI fails underneath it.
"""


class GflowError(RuntimeError):
    """A collective failed as a whole: raised on every rank of the call."""


class MismatchError(GflowError):
    """The ranks called one collective with different arguments (length, dtype, op, ...)."""


class NotServedInJoinError(GflowError):
    """A collective that ranks in join() do not take part in (all but allreduces, as in Horovod, and
    Adasum's), raised on the ranks that called it. Made from its message alone, as every GflowError:
    gflow.torch remakes them so (as_horovod_error)."""


class NonFiniteError(GflowError):
    """A reduction met inf or NaN where gflow checks for it (every rank sees the same reduced values,
    so every rank raises). Under dynamic loss scaling this is an overflow: skip the step."""


class CompressionOverflowError(NonFiniteError):
    """A compressed (float16) reduction overflowed or met NaN/inf. Every rank sees the same reduced
    values, so every rank raises; scale the values down (gflow.LossScaler) or send them uncompressed."""
