"""Horovod's elastic mode is not part of gflow.torch; importing this module says what to do instead."""

raise ImportError(
    "gflow.torch has no elastic mode (horovod.torch.elastic: ranks joining and leaving a running job). "
    "A gflow job keeps its ranks from start to end: save a checkpoint every few steps (gflow's "
    "checkpoints restore bitwise, see docs/training.md), and when a rank fails gflow names it on the "
    "others and the job ends; start it again with mpiexec and resume from the last checkpoint."
)
