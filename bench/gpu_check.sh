#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU. Installs nothing from the network: if a folder .whl/
# of wheels sits at the repository root (cupy, mpi4py, mpich, numba, numba-cuda, ...), they are
# installed from it into /tmp/site; otherwise the current Python environment must already have them.
# Bounded: the kernel/allreduce check gets 240 s, the GPU test run 120 s.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
timeout 240 python3 bench/gpu_check.py "$@" || status=$?
GFLOW_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cupy.py || status=$?
exit $status
