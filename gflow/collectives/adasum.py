"""Adasum (Maleki et al., 2021; Horovod's op=hvd.Adasum): an allreduce that combines gradients by
their geometry instead of summing them.

Two vectors combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector's squared norm is below sqrt(DBL_MIN), as Horovod's), and p
ranks as a binary tree over the ranks' bits: adasum(adasum(x0, x1), adasum(x2, x3)) at p = 4. Each
tensor of a fused buffer is combined on its own (`sizes`).

The algorithm is Horovod's vector-halving, distance-doubling one. At level d = 1, 2, 4, ... rank r
pairs with r ^ d: the lower keeps the first half of its current slice and the upper the second, each
sends the other half and receives the partner's copy of the half it keeps. The dot product and the
two squared norms of the combined vectors are sums over the group of 2d ranks that share the slices
of these vectors: each rank computes its slice's partial sums in float64 and the group adds them
(recursive doubling over distances 1 .. d, one small message each, the same additions on every
member, so every member gets bitwise the same coefficients). After log2(p) levels each rank holds
1/p of the result; the halves then travel back in the reverse order (distance halving) until every
rank holds all of it, bitwise the same everywhere.

Restrictions, as Horovod's on MPI: the number of ranks must be a power of two; floating dtypes only.
The arithmetic runs in float64 on the host (device arrays are staged through it) and the result is
rounded to the array's dtype once.
"""

import numpy as np
from mpi4py import MPI

from ..runtime.context import TAG_ADASUM, CommContext
from ..runtime.signature import is_floating

_SMALLEST_NORM = float(np.sqrt(np.finfo(np.float64).tiny))  # Horovod's sqrt(DBL_MIN)


def check_adasum(size: int, dtype) -> None:
    """NotImplementedError/TypeError for what Adasum does not take, before any communication."""
    if size & (size - 1):
        raise NotImplementedError(
            f"Adasum needs a power-of-two number of ranks (as Horovod's on MPI), got {size}"
        )
    if not is_floating(np.dtype(dtype)):
        raise TypeError(f"Adasum combines floating-point arrays, got {np.dtype(dtype)}")


def _split(counts: list, first: int) -> tuple:
    """Per-tensor counts of a slice's first `first` elements and of the rest."""
    head, tail, seen = [], [], 0
    for c in counts:
        take = max(0, min(c, first - seen))
        head.append(take)
        tail.append(c - take)
        seen += c
    return head, tail


def _partials(a: np.ndarray, b: np.ndarray, counts: list, lower: bool) -> np.ndarray:
    """Per tensor: the dot product, the lower group's squared norm and the upper group's, of this
    rank's slice (a: its own group's values, b: the partner group's)."""
    out = np.zeros((len(counts), 3))
    at = 0
    for i, c in enumerate(counts):
        x, y = a[at : at + c], b[at : at + c]
        mine, theirs = float(x @ x), float(y @ y)
        out[i] = (float(x @ y), mine, theirs) if lower else (float(x @ y), theirs, mine)
        at += c
    return out


def _group_sum(ctx: CommContext, values: np.ndarray, level: int) -> np.ndarray:
    """The sum of `values` over the 2 * level ranks of this rank's group (recursive doubling)."""
    total, incoming = values.copy(), np.empty_like(values)
    distance = 1
    while distance <= level:
        peer = ctx.rank ^ distance
        ctx.sendrecv([total, MPI.DOUBLE], peer, TAG_ADASUM, [incoming, MPI.DOUBLE], peer, TAG_ADASUM)
        total += incoming  # (a + b == b + a in IEEE arithmetic: both partners get the same sum)
        distance <<= 1
    return total


@np.errstate(invalid="ignore", over="ignore", divide="ignore")  # (inf in, NaN out, as a sum: fp_errors.py)
def adasum(ctx: CommContext, work: np.ndarray, sizes: list) -> None:
    """Combine the ranks' float64 `work` (flat, the tensors of `sizes` one after another) in place."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    counts, lo, hi = list(sizes), 0, work.size
    received = np.empty(work.size // 2 + 1)
    passed = []  # per level: the range handed to the partner, to take back on the way down
    level = 1
    while level < p:
        peer, lower = r ^ level, (r & level) == 0
        first = (hi - lo) // 2
        head, tail = _split(counts, first)
        if lower:
            keep, give, counts = (lo, lo + first), (lo + first, hi), head
        else:
            keep, give, counts = (lo + first, hi), (lo, lo + first), tail
        mine = work[keep[0] : keep[1]]
        theirs = received[: keep[1] - keep[0]]
        ctx.sendrecv(
            [work[give[0] : give[1]], MPI.DOUBLE], peer, TAG_ADASUM, [theirs, MPI.DOUBLE], peer, TAG_ADASUM
        )
        sums = _group_sum(ctx, _partials(mine, theirs, counts, lower), level)
        at = 0
        for i, c in enumerate(counts):
            dot, lower_sq, upper_sq = sums[i]
            own_sq, other_sq = (lower_sq, upper_sq) if lower else (upper_sq, lower_sq)
            own = 1.0 - dot / own_sq * 0.5 if own_sq >= _SMALLEST_NORM else 1.0
            other = 1.0 - dot / other_sq * 0.5 if other_sq >= _SMALLEST_NORM else 1.0
            # the lower group's vector first, whichever side holds it: both sides add alike
            x, y = mine[at : at + c], theirs[at : at + c]
            mine[at : at + c] = own * x + other * y if lower else other * y + own * x
            at += c
        passed.append((give, peer))
        lo, hi = keep
        level <<= 1
    for give, peer in reversed(passed):  # distance halving: each level's other half comes back
        ctx.sendrecv(
            [work[lo:hi], MPI.DOUBLE],
            peer,
            TAG_ADASUM,
            [work[give[0] : give[1]], MPI.DOUBLE],
            peer,
            TAG_ADASUM,
        )
        lo, hi = min(lo, give[0]), max(hi, give[1])
