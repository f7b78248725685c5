"""Every CUDA kernel in gflow/cuda/kernels.py compiled for a real GPU (PTX for sm_90, the H200's), on a
machine without one: Numba's CUDA compiler with NVVM from the nvidia-nvvm wheel (the test extra).

The simulator runs the kernels as Python, so it cannot see what only the CUDA compiler refuses (a
type it cannot unify, an operation it has no lowering for, a tuple it cannot index); the GPU sessions
that found such defects are rare. Each kernel is compiled here for the argument types gflow/cuda/ops.py
launches it with, in a process of its own without NUMBA_ENABLE_CUDASIM (which tests/conftest.py sets).
A kernel added to kernels.py without signatures here fails the test.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_kernel_compiles_to_ptx_for_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "compiled" in done.stdout, done.stdout


def _signatures():
    """{kernel name: [argument types]} as ops.py launches each kernel."""
    from numba import types as t

    def a(dtype):
        return t.Array(dtype, 1, "C")

    floats, ints = [t.float16, t.float32, t.float64], [t.int32, t.int64]
    stored = floats + ints + [t.uint16]  # (bfloat16 lives on the device as its uint16 bits)
    flag = a(t.int32)
    wide = {t.float16: t.float32, t.float32: t.float32, t.float64: t.float64}  # np.result_type(_, f32)
    bits = a(t.uint16)
    sigs = {name: [(a(d), a(d), a(d)) for d in floats + ints] for name in ("add", "maximum", "minimum")}
    sigs["copy"] = [(a(d), a(d)) for d in stored]
    sigs["fill"] = [(a(d), d) for d in stored]
    sigs["divide"] = [(a(d), d) for d in floats]
    sigs["reduce_parts"] = [(a(d), t.UniTuple(a(d), k), t.int64) for d in floats + ints for k in (2, 3, 8)]
    sigs["reduce_parts_bf16"] = [(bits, t.UniTuple(bits, k), t.int64) for k in (2, 3, 8)]
    sigs["gather_blocks"] = [(a(d), t.UniTuple(a(d), 4), t.UniTuple(t.int64, 5)) for d in stored]
    pairs = [(dst, src) for dst in (t.float32, t.float64) for src in (t.float32, t.float64)]
    sigs["cast_scaled"] = [(a(dst), a(src), t.float32, wide[src], flag) for dst, src in pairs]
    sigs["encode_f16"] = [(a(t.float16), a(src), t.float32, flag) for src in (t.float32, t.float64)]
    sigs["decode_f16"] = [(a(dst), a(t.float16), t.float32, flag) for dst in (t.float32, t.float64)]
    sigs["encode_bf16"] = [(bits, a(src), t.float32, flag) for src in floats]
    sigs["decode_bf16"] = [(a(dst), bits, t.float32, flag) for dst in floats]
    sigs["rescale_bf16"] = [(bits, bits, t.float32, flag)]
    sigs["reduce_bf16"] = [(bits, bits, bits, t.int64)]
    sigs["divide_bf16"] = [(bits, t.float32)]
    sigs["chunk_norms"] = [(a(t.float32), a(d), t.int64) for d in floats]
    for name in ("pack", "scatter_add"):
        sigs[name] = [(a(d), a(d), a(t.int64), t.int64) for d in floats]
    sigs["zero_chunks"] = [(a(d), a(t.int64), t.int64) for d in floats]
    sigs["accumulate"] = [(a(d), a(d), a(d), a(d), a(d), d) for d in (t.float32, t.float64)]
    return sigs


def main() -> None:
    """Compile every kernel for its signatures (run without the simulator: see the test above)."""
    import types

    from numba import cuda
    from numba.cuda import api, dispatcher

    # A device function compiles for the current device's compute capability: name the H200's.
    h200 = types.SimpleNamespace(compute_capability=(9, 0))
    api.get_current_device = dispatcher.get_current_device = lambda: h200

    from gflow.cuda import kernels

    found = {
        name
        for name, value in vars(kernels).items()
        if isinstance(value, dispatcher.CUDADispatcher) and not value.targetoptions.get("device")
    }
    sigs = _signatures()
    missing = found - set(sigs)
    assert not missing, f"kernels without signatures in {__file__}: {sorted(missing)}"
    count = 0
    for name in sorted(found):
        for sig in sigs[name]:
            try:
                cuda.compile_ptx(getattr(kernels, name).py_func, sig, cc=(9, 0))
            except Exception as exc:
                raise SystemExit(f"{name}{sig}: {type(exc).__name__}: {exc}") from exc
            count += 1
    print(f"compiled {len(found)} kernels for {count} signatures (PTX, sm_90)")


if __name__ == "__main__":
    main()
