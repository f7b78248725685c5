#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU. Installs nothing from the network: if a folder .whl/
# of wheels sits at the repository root (mpich, mpi4py, mpi-pytest, numpy<2.5: numba-cuda 0.30 cannot
# compile kernels under NumPy 2.5, which removed np.row_stack), a venv that sees python3's
# packages (CuPy, torch, numba, numba-cuda) gets them, so its mpiexec is the MPICH wheel's, as in CI;
# otherwise the current Python environment must already have everything.
# Bounded: the kernel/allreduce check gets 90 s, the GPU tests 220 s, the device node phase 150 s.
# Logs go to $OUT if it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -d .whl ]; then
  python3 -m venv /tmp/gflow-venv || exit 1
  # python3 may itself be a venv (the image's torch one): see its packages, and run their .pth files
  # (numba-cuda's redirect of numba.cuda is one), through site.addsitedir
  python3 -c 'import site; print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()))' \
    >"$(/tmp/gflow-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/system.pth"
  /tmp/gflow-venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
  PY=/tmp/gflow-venv/bin/python
  export PATH=/tmp/gflow-venv/bin:$PATH
fi
LOGS=${OUT:-bench/out}
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
$PY - <<'EOF'
import importlib
import numba.cuda
print("numba.cuda from", numba.cuda.__file__)
for name in ("numpy", "numba", "numba_cuda", "cupy", "torch", "mpi4py"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
EOF
$PY -m gflow info
status=0
timeout 90 $PY bench/gpu_check.py "$@" 2>&1 | tee "$LOGS/gpu_check.log" || status=1
# The device tests: real kernels, CuPy arrays, CUDA tensors, then every test that has a device variant.
GFLOW_TEST_GPU=1 timeout 220 $PY -m pytest -q -n 8 --durations=15 --junitxml="$LOGS/gpu_tests.xml" \
  tests/test_kernels.py tests/test_cupy.py tests/test_torch_cuda.py tests/test_device.py \
  tests/test_sparse.py tests/test_checkpoint.py tests/test_large_messages.py tests/test_error_paths.py \
  tests/test_faults.py tests/test_hierarchical.py -k "device or cuda or cupy or kernel or test_kernels" 2>&1 \
  | tee "$LOGS/gpu_tests.log" || status=1
# The node phase in CUDA IPC peer memory against the staged ring, 2 and 4 ranks sharing the GPU (issue 26).
timeout 150 $PY bench/device_node_phase.py --procs 2 4 --mbytes 256 --rounds 5 2>&1 \
  | tee "$LOGS/device_node_phase.log" || status=1
exit $status
