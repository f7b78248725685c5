"""What fp_errors' quiet error state costs a reduction: host_ops.reduce on float32 arrays, in two trees
(one without it), alternating, medians of 15 rounds (each the best of 3 x 5000 calls).

    git clone -q . /tmp/lat_before && git -C /tmp/lat_before checkout -q ce39520
    python bench/reduce_quietly.py /tmp/lat_before .
"""

import statistics
import sys
import timeit

import numpy as np


def load(root):
    """gflow.arrays.host_ops as the tree at root has it (the other tree's modules dropped first)."""
    for m in [k for k in sys.modules if k == "gflow" or k.startswith("gflow.")]:
        del sys.modules[m]
    sys.path.insert(0, root)
    import gflow.arrays.host_ops as h

    sys.path.pop(0)
    return h


def main() -> None:
    before, after = load(sys.argv[1]), load(sys.argv[2])
    assert before.__file__ != after.__file__, (before.__file__, after.__file__)
    print(f"before: {before.__file__}\nafter: {after.__file__}")
    for n in (64, 1024, 32768):
        a = np.random.default_rng(0).random(n, dtype=np.float32)
        b, out = a.copy(), np.empty_like(a)
        times = {"before": [], "after": []}
        for _ in range(15):
            for name, h in (("before", before), ("after", after)):
                call = lambda h=h, out=out, a=a, b=b: h.reduce(out, a, b, "sum")  # noqa: E731
                best = min(timeit.repeat(call, number=5000, repeat=3))
                times[name].append(best / 5000 * 1e6)
        b_us, a_us = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"n = {n:6d} float32: before {b_us:.3f} us, after {a_us:.3f} us, added {a_us - b_us:+.3f} us")


if __name__ == "__main__":
    main()
