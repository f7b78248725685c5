"""NumPy's floating-point reports, off inside gflow's own arithmetic.

A reduction gives inf + -inf = NaN and overflows to inf without a word, as MPI's own does: NumPy's
RuntimeWarnings for them are not the program's, and where a program turns warnings into errors, one
raised inside a collective would stop it half way on one rank. np.errstate around each reduction costs
2 us a call (a small allreduce makes several); NumPy 2 keeps its error state in a context variable,
which costs about 0.2 us to set and reset (bench/RESULTS.md, "inf, -inf and overflow, quietly"). Use:

    token = quiet()
    try:
        ufunc(a, b, out=out)
    finally:
        unquiet(token)
"""

import functools

import numpy as np

try:
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj

    # Every field set: none taken from the state at import. (partial and reset are C calls: a
    # function of ours around them cost 0.13 us more a reduction.)
    quiet = functools.partial(_extobj_contextvar.set, _make_extobj(all="ignore"))
    unquiet = _extobj_contextvar.reset

except ImportError:  # (NumPy 1: its error state is np.errstate's alone)

    def quiet():
        state = np.errstate(all="ignore")
        state.__enter__()
        return state

    def unquiet(state) -> None:
        state.__exit__(None, None, None)
