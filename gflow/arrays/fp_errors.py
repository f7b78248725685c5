"""NumPy's floating-point reports, off inside gflow's own arithmetic.

A reduction gives inf + -inf = NaN and overflows to inf without a word, as MPI's own does: NumPy's
RuntimeWarnings for them are not the program's, and where a program turns warnings into errors, one
raised inside a collective would stop it half way on one rank. np.errstate around each reduction costs
2 us a call (a small allreduce makes several); NumPy 2 keeps its error state in a context variable,
which costs 0.3 us to set.
"""

import numpy as np

try:
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj

    _QUIET = _make_extobj(all="ignore")  # (every field set: none taken from the state at import)

    def quietly(ufunc, a, b, out) -> None:
        """ufunc(a, b, out=out) with NumPy's floating-point reports off."""
        token = _extobj_contextvar.set(_QUIET)
        try:
            ufunc(a, b, out=out)
        finally:
            _extobj_contextvar.reset(token)

except ImportError:  # (NumPy 1: its error state is np.errstate's alone)

    def quietly(ufunc, a, b, out) -> None:
        """ufunc(a, b, out=out) with NumPy's floating-point reports off."""
        with np.errstate(all="ignore"):
            ufunc(a, b, out=out)
