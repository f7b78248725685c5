"""One-pass reductions of several arrays on the host (Numba, compiled once per machine: cache=True)."""

from numba import njit


@njit(cache=True, boundscheck=False)
def fused_sum(out, parts):
    """out = ((parts[0] + parts[1]) + parts[2]) ..., elementwise; each part read once."""
    k = len(parts)
    for i in range(out.size):
        acc = parts[0][i]
        for q in range(1, k):
            acc = acc + parts[q][i]
        out[i] = acc
