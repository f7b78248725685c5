"""gflow's device side: Numba CUDA kernels (kernels.py), the ops launching them (ops.py), adapting
device arrays (arrays.py) and how device buffers reach MPI (transport.py). Imported only when a device
array is passed, so host-only users never pay for loading Numba's CUDA support."""
