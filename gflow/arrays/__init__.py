"""Memory: the kinds of array gflow accepts, written down as protocols (protocols.py), with their
adapters (NumPy: numpy_arrays.py, torch tensors: torch_tensors.py; device arrays live in gflow/cuda/),
the per-element ops on host memory and their Numba CPU kernels (host_ops.py, *_kernels.py), and the
2-byte wire codecs (codecs.py). Above gflow/runtime/, below everything else."""
