"""The collective algorithms and the public operations: recursive doubling (latency path and argument
agreement), the ring, topology and the hierarchical two-level allreduce; dispatch.py owns every
algorithm choice; operations.py holds allreduce, reduce_scatter, allgather, broadcast and the
agreement/reject path. Built on gflow/arrays/ and gflow/runtime/."""
