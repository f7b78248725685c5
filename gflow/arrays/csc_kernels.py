"""The sparse path's host hot loop in Numba: residual update and chunk norms in one pass.

CSC touches every element of the gradient each step; done as separate NumPy passes (u = m*u + g,
v += u, |v|, per-chunk sums) that is seven or more sweeps of memory. Fused, it is one: read g, u, v,
write the new u, v, and sum |v| per chunk on the way (gflow/arrays/host_ops.py's accumulate_norms calls this).
The new state goes to separate arrays (which may be the old ones), so a step that fails later can
leave the old state as it was.
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def accumulate_norms(u_out, v_out, u, v, g, momentum, chunk, norms):
    """u_out = momentum*u + g; v_out = v + u_out; norms[c] = sum(|v_out|) over chunk c (float32).
    With momentum 0 the velocity is just g, so u and u_out are neither read nor written (they may
    be empty)."""
    n = v.size
    for c in range(norms.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        acc = np.float32(0.0)
        if momentum == 0.0:
            for i in range(lo, hi):
                x = v[i] + g[i]
                v_out[i] = x
                acc += np.float32(abs(x))
        else:
            for i in range(lo, hi):
                w = momentum * u[i] + g[i]
                u_out[i] = w
                x = v[i] + w
                v_out[i] = x
                acc += np.float32(abs(x))
        norms[c] = acc
